//! Host memory that tensorferry owns: aligned pageable buffers, and the pinned pool.

mod aligned;
pub mod pinned;

pub use aligned::{AlignedBuffer, HOST_ALIGNMENT};
pub use pinned::{PinnedAllocator, PinnedBuffer, PinnedPool, PoolStats};

/// Host memory that results of a transfer land in: ordinary (pageable) memory, or a
/// buffer of the pinned pool.
pub enum HostBuffer {
    /// Ordinary memory, 64-byte aligned.
    Pageable(AlignedBuffer),
    /// A pinned buffer, returned to its pool when dropped.
    Pinned(PinnedBuffer),
}

impl HostBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            HostBuffer::Pageable(b) => b.len(),
            HostBuffer::Pinned(b) => b.len(),
        }
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            HostBuffer::Pageable(b) => b.as_slice(),
            HostBuffer::Pinned(b) => b.as_slice(),
        }
    }

    /// The start address, for the one copy that fills the buffer.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            HostBuffer::Pageable(b) => b.as_mut_slice().as_mut_ptr(),
            HostBuffer::Pinned(b) => b.as_ptr(),
        }
    }
}
