#![doc = include_str!("../../../README.md")]
#![deny(missing_docs)]

pub mod backend;
pub mod consolidate;
pub mod device;
pub mod dlpack;
pub mod dtype;
pub mod error;
pub mod io;
pub mod memory;
pub mod storage;
pub mod tensor;
pub mod transfer;
pub mod tree;

pub use backend::available_devices;
pub use consolidate::{consolidate, pack};
pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use io::{load, save, LoadOptions, Loaded, Mapping, SaveOptions};
pub use storage::Storage;
pub use tensor::Tensor;
pub use transfer::{move_tensors, MoveOptions, Staging};
pub use tree::{DictKey, KeyPath, Node, TensorDict, Value};
