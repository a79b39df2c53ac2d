//! Host memory that tensorferry owns: aligned pageable buffers, and the pinned pool.

mod aligned;
pub(crate) mod pinned;

pub(crate) use aligned::PagesAhead;
pub use aligned::{AlignedBuffer, HOST_ALIGNMENT};
pub(crate) use pinned::PinnedBuffer;
pub use pinned::{PinnedPool, PoolStats};

/// Host memory that results of a transfer land in: ordinary (pageable) memory, or a
/// buffer of the pinned pool.
pub(crate) enum HostBuffer {
    /// Ordinary memory, 64-byte aligned.
    Pageable(AlignedBuffer),
    /// A pinned buffer, returned to its pool when dropped.
    Pinned(PinnedBuffer),
}

impl HostBuffer {
    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        match self {
            HostBuffer::Pageable(b) => b.len(),
            HostBuffer::Pinned(b) => b.len(),
        }
    }

    /// The bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            HostBuffer::Pageable(b) => b.as_slice(),
            HostBuffer::Pinned(b) => b.as_slice(),
        }
    }

    /// The start address, without making a slice (a copy may be writing the bytes).
    pub(crate) fn as_ptr(&self) -> *const u8 {
        match self {
            HostBuffer::Pageable(b) => b.as_ptr(),
            HostBuffer::Pinned(b) => b.as_ptr(),
        }
    }

    /// Marks the memory as lent to another library (see [`PinnedBuffer::lend`]); ordinary
    /// memory needs nothing: no pool reuses it.
    pub(crate) fn lend(&self) {
        if let HostBuffer::Pinned(b) = self {
            b.lend();
        }
    }
}
