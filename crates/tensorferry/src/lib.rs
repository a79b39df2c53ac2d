#![doc = include_str!("../../../README.md")]
#![deny(missing_docs)]

pub(crate) mod backend;
pub(crate) mod consolidate;
pub(crate) mod device;
pub(crate) mod dlpack;
pub(crate) mod dtype;
pub(crate) mod error;
pub(crate) mod io;
pub(crate) mod memory;
pub(crate) mod storage;
pub(crate) mod tensor;
pub(crate) mod transfer;
pub(crate) mod tree;

// The public surface: the tree and its tensors, devices and dtypes, save and load with
// their options, the moves between devices, and the one error type. Everything else is
// the crate's own, and what the bindings and the CLI need of it is in `internal`.
pub use backend::available_devices;
pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use io::{load, load_to, save, LoadOptions, Loaded, Mapping, SaveOptions};
pub use storage::Storage;
pub use tensor::Tensor;
pub use transfer::{move_tensors, MoveOptions, Staging};
pub use tree::{consolidate, DictKey, KeyPath, Node, TensorDict, Value};

/// The crate's internals that tensorferry's own bindings, command, tests and fuzz targets
/// reach, each under the name of its module in the crate: not a public API, and free to
/// change in any release.
#[doc(hidden)]
pub mod internal {
    /// Device backends: the emulated device, CUDA, copy batches and events. A glob, as
    /// the layering test keeps CUDA's module names out of this file.
    pub mod backend {
        pub use crate::backend::*;
    }
    /// Packing tensors into one buffer.
    pub mod consolidate {
        pub use crate::consolidate::{copy_into, pack, PackedLayout};
    }
    /// DLPack import and export.
    pub mod dlpack {
        pub use crate::dlpack::*;
    }
    /// safetensors files, sharded checkpoints and object storage.
    pub mod io {
        pub use crate::io::{
            header_bytes, load_bytes, load_sharded, load_to_until, object, parse_header,
            parse_index, put, read_header, read_metadata, read_run_file_header, read_runs, resolve,
            save_sharded, shard_files, Header, Index, Run, RunFile, INDEX_SUFFIX, MAX_INDEX_BYTES,
        };
    }
    /// Host memory: aligned buffers and the pinned pool.
    pub mod memory {
        pub use crate::memory::{AlignedBuffer, PinnedPool, PoolStats, HOST_ALIGNMENT};
    }
    /// Tensor layout arithmetic.
    pub mod tensor {
        pub use crate::tensor::{checked_nbytes, contiguous_strides};
    }
    /// The transfer engine and its staging ring.
    pub mod transfer {
        pub use crate::transfer::{staging, wait_queued_timeout, Readable};
    }
}

/// The ordering rules of the backends and the engine, proved with gates (a test module of
/// its own: it reaches into both).
#[cfg(test)]
mod ordering_tests;
