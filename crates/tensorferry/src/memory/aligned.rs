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

/// From this size on, a buffer's pages are faulted in ahead of its filler ([`PagesAhead`]),
/// this many bytes at a time (a multiple of every page size).
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

    /// The span to fault in ahead of the code that fills this buffer ([`PagesAhead`]):
    /// `None` under 32 MiB, or for heap memory, which fills as fast alone.
    pub(crate) fn page_span(&self) -> Option<PageSpan> {
        (self.map.is_some() && self.len >= POPULATE_ASIDE).then_some(PageSpan {
            start: self.ptr.as_ptr() as usize,
            len: self.len,
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

/// The page-aligned span of a mapped buffer, to fault in ahead of its filler.
pub(crate) struct PageSpan {
    start: usize,
    len: usize,
}

/// A buffer's pages faulted in ahead of the code filling it, from the start, by a thread
/// of its own (with `MADV_POPULATE_WRITE`, Linux 5.14; on older kernels, or without a
/// thread, the filler faults them in itself), until the guard is dropped, which stops the
/// thread and waits for it. For a large buffer filled piecemeal from the network: a page
/// fault per 4 KiB page on the filling threads cost about as much as the download itself
/// (a 1 GB object load took 1.13 s with them, 0.80 s with the pages faulted in aside;
/// docs/benchmarks.md). The pages' contents are never touched: what the filler wrote
/// stays.
pub(crate) struct PagesAhead {
    stop: std::sync::Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PagesAhead {
    /// Starts faulting `span`'s pages in.
    ///
    /// # Safety
    /// The buffer `span` was taken from must stay allocated until the guard is dropped.
    pub(crate) unsafe fn start(span: PageSpan) -> PagesAhead {
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tensorferry-pages".into())
            .spawn(move || {
                let mut at = 0;
                while at < span.len && !stopped.load(Ordering::Relaxed) {
                    let step = POPULATE_STEP.min(span.len - at);
                    // SAFETY: `span.start + at .. + step` lies inside the buffer's map (its
                    // page-aligned start, `at` a multiple of the page size), which the caller
                    // of `start` keeps allocated until this thread is joined.
                    if !unsafe { populate_write(span.start + at, step) } {
                        break; // an older kernel: the pages fault in as the filler writes.
                    }
                    at += step;
                }
            })
            .ok();
        PagesAhead { stop, thread }
    }
}

impl Drop for PagesAhead {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
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
            // SAFETY: `buf` outlives the guard, dropped below.
            let pages = buf
                .page_span()
                .map(|span| unsafe { PagesAhead::start(span) });
            assert_eq!(pages.is_some(), len >= POPULATE_ASIDE);
            let bytes = buf.as_mut_slice();
            for &step in order {
                let at = step * POPULATE_STEP;
                let half = POPULATE_STEP.min(bytes.len() - at) / 2;
                for (i, b) in bytes[at..at + half].iter_mut().enumerate().step_by(4093) {
                    *b = (i % 251) as u8 + 1;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            drop(pages);
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
