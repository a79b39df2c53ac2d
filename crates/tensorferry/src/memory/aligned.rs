//! A heap buffer aligned to 64 bytes: JAX and NumPy share such memory instead of
//! copying it, and vector copies run at full speed on it.
//!
//! Large buffers are anonymous memory maps (page aligned) marked for transparent huge
//! pages: the first touch of each page is what fresh buffers pay for, and 2 MiB pages
//! make that several times cheaper (NumPy does the same for its large arrays).

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use memmap2::{Advice, MmapMut};

use crate::error::{Error, Result};

/// Alignment of every host buffer tensorferry allocates, in bytes.
pub const HOST_ALIGNMENT: usize = 64;

/// From this size on, buffers are anonymous maps with huge pages.
const MAP_THRESHOLD: usize = 4 << 20;

/// The error of host memory that could not be had for `len` bytes.
fn out_of_memory(len: usize) -> Error {
    Error::OutOfMemory {
        device: "cpu".into(),
        requested: len,
        free: 0,
        total: 0,
    }
}

/// An owned, zero-initialised, 64-byte-aligned byte buffer.
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// The map backing a large buffer (`ptr` points into it); `None` for heap memory.
    map: Option<MmapMut>,
}

// SAFETY: the buffer owns its allocation exclusively; access goes through `&self`/`&mut self`,
// so the usual borrow rules make sharing between threads sound, as for `Vec<u8>`.
unsafe impl Send for AlignedBuffer {}
// SAFETY: see `Send`; `&AlignedBuffer` only gives out `&[u8]`.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// Allocates `len` zeroed bytes; an allocation failure is an [`Error::OutOfMemory`].
    pub fn zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(AlignedBuffer {
                // A dangling pointer that is still aligned (to a page, so that it serves
                // `zeroed_page_aligned` too), never dereferenced for len 0.
                ptr: NonNull::new(4096 as *mut u8).expect("non-zero"),
                len: 0,
                map: None,
            });
        }
        if len >= MAP_THRESHOLD {
            return Self::mapped(len);
        }
        let layout = Self::layout(len)?;
        // SAFETY: `layout` has a non-zero size (len > 0) and a valid power-of-two alignment.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| out_of_memory(len))?;
        Ok(AlignedBuffer {
            ptr,
            len,
            map: None,
        })
    }

    /// Allocates `len` zeroed bytes starting at a page boundary (4096-byte aligned or more,
    /// whatever the size), as `O_DIRECT` reads need: an anonymous map even when small.
    ///
    /// ```
    /// use tensorferry::internal::memory::AlignedBuffer;
    /// let b = AlignedBuffer::zeroed_page_aligned(100)?;
    /// assert_eq!(b.as_ptr() as usize % 4096, 0);
    /// # Ok::<(), tensorferry::Error>(())
    /// ```
    pub fn zeroed_page_aligned(len: usize) -> Result<Self> {
        if len == 0 {
            return Self::zeroed(0);
        }
        Self::mapped(len)
    }

    /// Allocates `len` zeroed bytes as [`AlignedBuffer::zeroed`] does, but never asks the
    /// kernel for huge pages: for a buffer filled piecemeal from the network. Where the
    /// kernel compacts memory to make a huge page at the fault (`defrag=madvise`, a common
    /// default), those faults stall behind a full page cache: a 1 GB object load took 2.6 s
    /// instead of 1.0 s against the same server (docs/benchmarks.md, object storage).
    pub fn zeroed_small_pages(len: usize) -> Result<Self> {
        if len < MAP_THRESHOLD {
            return Self::zeroed(len);
        }
        Self::map_anon(len)
    }

    /// `len` (> 0) zeroed bytes of an anonymous map, marked for huge pages.
    fn mapped(len: usize) -> Result<Self> {
        let mut buffer = Self::map_anon(len)?;
        if let Some(map) = buffer.map.as_mut() {
            // Only a hint: without huge pages the buffer works the same, just slower to fill.
            let _ = map.advise(Advice::HugePage);
        }
        Ok(buffer)
    }

    /// `len` (> 0) zeroed bytes of an anonymous map.
    fn map_anon(len: usize) -> Result<Self> {
        let mut map = MmapMut::map_anon(len).map_err(|_| out_of_memory(len))?;
        let ptr = NonNull::new(map.as_mut_ptr()).expect("maps are never null");
        Ok(AlignedBuffer {
            ptr,
            len,
            map: Some(map),
        })
    }

    /// Allocates a buffer holding a copy of `bytes`.
    pub fn copy_from(bytes: &[u8]) -> Result<Self> {
        let mut buf = Self::zeroed(bytes.len())?;
        buf.as_mut_slice().copy_from_slice(bytes);
        Ok(buf)
    }

    fn layout(len: usize) -> Result<Layout> {
        Layout::from_size_align(len, HOST_ALIGNMENT).map_err(|_| out_of_memory(len))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start address (64-byte aligned; dangling but aligned when empty).
    ///
    /// ```
    /// use tensorferry::internal::memory::{AlignedBuffer, HOST_ALIGNMENT};
    /// let b = AlignedBuffer::zeroed(100)?;
    /// assert_eq!(b.as_ptr() as usize % HOST_ALIGNMENT, 0);
    /// # Ok::<(), tensorferry::Error>(())
    /// ```
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes (zeroed at allocation, by the
        // allocator or the kernel for a map, which `self.map` keeps alive) for the lifetime of
        // `self`, or dangling-but-aligned with len 0, which a slice allows.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        if self.len > 0 && self.map.is_none() {
            let layout = Self::layout(self.len).expect("layout was valid at allocation");
            // SAFETY: heap buffers (no map) came from `alloc_zeroed` with exactly this layout,
            // and are freed once; maps are released by their own drop.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for AlignedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuffer({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_64_byte_aligned_and_zeroed() {
        for len in [0, 1, 63, 64, 65, 4096, 1 << 20] {
            let buf = AlignedBuffer::zeroed(len).unwrap();
            assert_eq!(buf.as_slice().as_ptr() as usize % HOST_ALIGNMENT, 0);
            assert_eq!(buf.len(), len);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn page_aligned_buffers_start_on_a_page_and_are_zeroed_at_every_size() {
        for len in [0, 1, 4095, 4096, 4097, 1 << 20, 5 << 20] {
            let buf = AlignedBuffer::zeroed_page_aligned(len).unwrap();
            assert_eq!(buf.as_ptr() as usize % 4096, 0, "{len} bytes");
            assert_eq!(buf.len(), len);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn an_impossible_size_is_out_of_memory_not_a_panic() {
        let err = AlignedBuffer::zeroed(usize::MAX - 10).unwrap_err();
        assert!(
            matches!(err, Error::OutOfMemory { requested, .. } if requested == usize::MAX - 10)
        );
    }
}
