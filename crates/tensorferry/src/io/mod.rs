//! safetensors files: streaming, atomic writes and validated, zero-copy reads.
//!
//! Files follow the safetensors format rules exactly, so the official `safetensors`
//! package reads what tensorferry writes and the other way round. The nesting of a
//! tree and its plain values are recorded in `__metadata__` under one reserved key,
//! `"tensorferry"`, so that tensorferry reads back exactly what it wrote. A flat
//! dict of tensors needs no record and gets none: its header lists the tensors in the
//! dict's order (their bytes follow in order of falling dtype size, for alignment), and a
//! file without a record reads back as a flat dict in its header's order.
//!
//! Reading trusts nothing in a file, and allocates at most four times the file's size
//! plus 4 MiB: a header describing more (many tiny tensors, dimensions, metadata entries
//! or plain values for the bytes the file holds) is refused before anything is built,
//! and the writer refuses to write such a file. Only regular files are read or replaced.
//!
//! Large trees can be saved as Hugging Face style shards with an index
//! ([`save_sharded`]); [`load`] reads an index, or a folder holding one, as one tree.
//!
//! Files are read through the page cache (into fresh memory, or mapped with the `unsafe`
//! opt-in [`Mapping::map`]), or with
//! `O_DIRECT` past it ([`LoadOptions::direct`]), and [`load_to`] reads one straight
//! into a device's memory through a bounded ring of host buffers.
//!
//! Paths that are object-storage URLs (`s3://…`, `gs://…`, `az://…`, `http(s)://…`) are
//! loaded and saved through [`object`].

mod checkpoint;
mod format;
mod fs;
mod into_device;
pub mod object;
mod pool;
mod read;
mod route;
mod write;

pub use checkpoint::index::INDEX_SUFFIX;
pub use checkpoint::sharded::{load_sharded, shard_files};
pub use format::header::Header;
pub use format::header_reader::parse_header;
pub use fs::direct_runs::{read_runs, Run, RunFile};
pub use read::{load_bytes, read_header, LoadOptions, Loaded, Mapping};
pub use route::{load, load_to, load_to_until, read_metadata, save, save_sharded};
pub use write::{header_bytes, SaveOptions};
