//! Host memory that tensorferry owns.

mod aligned;

pub use aligned::{AlignedBuffer, HOST_ALIGNMENT};
