//! safetensors files, read and written exactly as the format says (the official package
//! reads what tensorferry writes and the other way round): the codec ([`format`]), the
//! filesystem under it ([`fs`]), sharded checkpoints ([`checkpoint`]), object storage
//! ([`object`]), and the entry points that route a path to them ([`load`], [`save`]).
//! A tree's nesting and plain values are recorded in `__metadata__` under the reserved
//! key `"tensorferry"` (a flat dict of tensors needs none); reading trusts nothing in a
//! file and allocates at most four times its size plus 4 MiB.

mod checkpoint;
mod format;
mod fs;
mod into_device;
pub mod object;
mod pool;
mod read;
mod route;
mod write;

pub use checkpoint::index::{parse_index, Index, INDEX_SUFFIX, MAX_INDEX_BYTES};
pub use checkpoint::sharded::{load_sharded, shard_files};
pub use format::header::Header;
pub use format::header_reader::parse_header;
pub use fs::direct_runs::{read_runs, Run, RunFile};
pub use read::{load_bytes, read_header, read_run_file_header, LoadOptions, Loaded, Mapping};
pub use route::{load, load_to, load_to_until, put, read_metadata, resolve, save, save_sharded};
pub use write::{header_bytes, SaveOptions};
