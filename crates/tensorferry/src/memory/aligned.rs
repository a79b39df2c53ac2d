//! A heap buffer aligned to 64 bytes: JAX and NumPy share such memory instead of
//! copying it, and vector copies run at full speed on it.
//!
//! Large buffers are anonymous memory maps (page aligned) marked for transparent huge
//! pages: the first touch of each page is what fresh buffers pay for, and 2 MiB pages
//! make that several times cheaper (NumPy does the same for its large arrays).

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::{Advice, MmapMut};

use crate::error::{Error, Result};

/// Alignment of every host buffer tensorferry allocates, in bytes.
pub const HOST_ALIGNMENT: usize = 64;

/// From this size on, buffers are anonymous maps with huge pages.
const MAP_THRESHOLD: usize = 4 << 20;

/// From this size on, [`AlignedBuffer::fill_with_pages_ahead`] faults pages in on a thread
/// of its own, this many bytes at a time (a multiple of every page size).
const POPULATE_ASIDE: usize = 32 << 20;
const POPULATE_STEP: usize = 8 << 20;

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

    /// Runs `fill` on the buffer's bytes while a thread of its own faults the buffer's
    /// pages in ahead of it, from the start, with `MADV_POPULATE_WRITE` (Linux 5.14; on
    /// older kernels, and for buffers under 32 MiB, `fill` simply runs alone). For a large
    /// buffer filled piecemeal from the network: a page fault per 4 KiB page on the filling
    /// thread cost about as much as the download itself (a 1 GB object load took 1.13 s
    /// with them, 0.80 s with the pages faulted in aside; docs/benchmarks.md).
    ///
    /// Returns `fill`'s result once the faulting thread has stopped too (it stops early
    /// when `fill` returns first).
    pub fn fill_with_pages_ahead<R>(&mut self, fill: impl FnOnce(&mut [u8]) -> R) -> R {
        if self.map.is_none() || self.len < POPULATE_ASIDE {
            return fill(self.as_mut_slice());
        }
        let (start, len) = (self.ptr.as_ptr() as usize, self.len);
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            let done = &done;
            // Without a thread (none could be started), `fill` faults the pages in itself.
            let _ = std::thread::Builder::new()
                .name("tensorferry-pages".into())
                .spawn_scoped(s, move || {
                    let mut at = 0;
                    while at < len && !done.load(Ordering::Relaxed) {
                        let step = POPULATE_STEP.min(len - at);
                        // SAFETY: `start + at .. + step` lies inside this buffer's map (`start`
                        // is its page-aligned start, `at` a multiple of the page size), which
                        // outlives this thread: the scope joins it before `self` is released.
                        if !unsafe { populate_write(start + at, step) } {
                            break; // an older kernel: the pages fault in as `fill` writes.
                        }
                        at += step;
                    }
                });
            let result = fill(self.as_mut_slice());
            done.store(true, Ordering::Relaxed);
            result
        })
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

/// Faults in the `len` bytes of memory from `addr` (page aligned) as writable, without
/// writing them; false when the kernel cannot (before Linux 5.14, or not Linux).
///
/// # Safety
/// `addr .. addr + len` must lie inside a private anonymous map that stays mapped for the
/// call. Populating never changes a byte the program can see (a missing page becomes a
/// zeroed page, which is what reading it gives; a present page is left as it is), so it
/// may race with writes into the same memory.
#[cfg(target_os = "linux")]
unsafe fn populate_write(addr: usize, len: usize) -> bool {
    // SAFETY: the caller's contract; madvise only reads and changes page tables.
    unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) == 0 }
}

#[cfg(not(target_os = "linux"))]
unsafe fn populate_write(_addr: usize, _len: usize) -> bool {
    false
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

    #[test]
    fn pages_faulted_in_aside_never_clobber_what_fill_wrote() {
        // 64 MiB: above the size from which a thread populates the pages. `fill` writes a
        // pattern into pages in an order the populating thread does not follow (from the
        // end, every other 8 MiB step first), sleeping between steps so that both run.
        for len in [POPULATE_ASIDE - 4096, 64 << 20] {
            let mut buf = AlignedBuffer::zeroed_small_pages(len).unwrap();
            let steps: Vec<usize> = (0..len.div_ceil(POPULATE_STEP)).rev().collect();
            let order = steps
                .iter()
                .step_by(2)
                .chain(steps.iter().skip(1).step_by(2));
            let written = buf.fill_with_pages_ahead(|bytes| {
                for &step in order {
                    let at = step * POPULATE_STEP;
                    let half = POPULATE_STEP.min(bytes.len() - at) / 2;
                    for (i, b) in bytes[at..at + half].iter_mut().enumerate().step_by(4093) {
                        *b = (i % 251) as u8 + 1;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                "done"
            });
            assert_eq!(written, "done");
            for (s, chunk) in buf.as_slice().chunks(POPULATE_STEP).enumerate() {
                for (i, &b) in chunk.iter().enumerate() {
                    let want = match i < chunk.len() / 2 && i % 4093 == 0 {
                        true => (i % 251) as u8 + 1,
                        false => 0,
                    };
                    assert_eq!(b, want, "len {len}: step {s}, byte {i}");
                }
            }
        }
    }
}
