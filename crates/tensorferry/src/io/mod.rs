//! safetensors files: streaming, atomic writes and validated, zero-copy reads.
//!
//! Files follow the safetensors format rules exactly, so the official `safetensors`
//! package reads what tensorferry writes and the other way round. The nesting of a
//! tree and its plain values are recorded in `__metadata__` under one reserved key,
//! [`TREE_METADATA_KEY`], so that tensorferry reads back exactly what it wrote.

mod header;
mod read;
mod tree_meta;
mod write;

pub use header::{parse_header, Header, TensorEntry, MAX_HEADER_BYTES};
pub use read::{load, load_bytes, load_node, read_header, LoadOptions, Loaded};
pub use write::{save, save_node, SaveOptions};

/// The `__metadata__` key under which tensorferry records a tree's structure.
pub const TREE_METADATA_KEY: &str = "tensorferry";
