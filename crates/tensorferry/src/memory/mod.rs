//! Host memory that tensorferry owns: aligned pageable buffers, and the pinned pool.

mod aligned;
pub mod pinned;

pub use aligned::{AlignedBuffer, HOST_ALIGNMENT};
pub use pinned::{PinnedAllocator, PinnedBuffer, PinnedPool, PoolStats};
