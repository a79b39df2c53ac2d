//! A pool of page-locked ("pinned") host buffers: pinning costs 0.1–0.25 s per GB, so
//! buffers are kept by size class and reused, and a repeated transfer pins nothing new.
//!
//! The pool is written against [`PinnedAllocator`], so its bookkeeping (size classes,
//! reuse, the cap, statistics) is the same whatever pins the memory: CUDA's
//! `cuMemHostAlloc` (flags 0 or PORTABLE, never write-combined, which makes CPU reads slow)
//! on a GPU machine, a plain allocator in tests.
//!
//! A buffer lent to another library ([`PinnedBuffer::lend`]: a DLPack export) may still be
//! read by device work that library queued on streams tensorferry does not know (PyTorch's
//! `t.cuda(non_blocking=True); del t`): it comes back to the pool only behind a fence the
//! allocator provides ([`PinnedAllocator::return_lent`]), as PyTorch's own host allocator
//! waits for events recorded on the streams that used a block.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::Result;

/// Page-locked memory from an allocator; dropping it frees the memory (through `release`).
pub(crate) struct HostBlock {
    ptr: *mut u8,
    len: usize,
    _release: Box<dyn Any + Send + Sync>,
}

// SAFETY: the block owns its memory through `_release`; the pointer only addresses it.
unsafe impl Send for HostBlock {}
// SAFETY: see `Send`; shared access only reads the address.
unsafe impl Sync for HostBlock {}

impl HostBlock {
    /// Wraps `len` bytes of host memory at `ptr`; dropping `release` frees them.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, used by nothing else, until
    /// `release` is dropped, and dropping `release` must free them exactly once.
    pub(crate) unsafe fn new(
        ptr: *mut u8,
        len: usize,
        release: Box<dyn Any + Send + Sync>,
    ) -> HostBlock {
        HostBlock {
            ptr,
            len,
            _release: release,
        }
    }
}

/// What takes a lent block back into its pool, once it may be reused.
pub(crate) type GiveBack = Box<dyn FnOnce(HostBlock) + Send>;

/// Something that pins host memory.
///
/// # Safety
/// Implementors promise that every block [`PinnedAllocator::alloc`] returns is at least
/// the `len` bytes asked for, valid for reads and writes from any thread until the block is
/// dropped, and used by nothing else meanwhile (the pool hands it to copies as it likes).
pub(crate) unsafe trait PinnedAllocator: Send + Sync {
    /// Allocates `len` bytes of pinned host memory.
    fn alloc(&self, len: usize) -> Result<HostBlock>;

    /// Takes back a block that was lent to another library, whose device work on it is
    /// unknown, and passes it to `back` once no device work queued so far can still read or
    /// write it — or never, keeping it for good, when that cannot be known. Must not wait
    /// on the calling thread. By default at once: no device reads such memory behind the
    /// host's back.
    fn return_lent(&self, block: HostBlock, back: GiveBack) {
        back(block);
    }
}

/// What the pool holds and how it has served requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes pinned now (in use and cached).
    pub pinned_bytes: usize,
    /// Bytes cached for reuse.
    pub cached_bytes: usize,
    /// Requests served from the cache.
    pub hits: u64,
    /// Requests that had to pin new memory.
    pub misses: u64,
}

struct State {
    free: BTreeMap<usize, Vec<HostBlock>>,
    stats: PoolStats,
}

/// Pinned buffers by size class (powers of two from 64 KiB), reused, within a cap.
pub struct PinnedPool {
    allocator: Box<dyn PinnedAllocator>,
    cap: usize,
    state: Mutex<State>,
}

/// The smallest size class.
pub(crate) const MIN_CLASS: usize = 64 << 10;

/// The size class serving `len` bytes.
pub(crate) fn size_class(len: usize) -> usize {
    len.max(MIN_CLASS).next_power_of_two()
}

impl PinnedPool {
    /// A pool that keeps at most `cap` bytes pinned once buffers come back.
    pub(crate) fn new(allocator: Box<dyn PinnedAllocator>, cap: usize) -> Arc<PinnedPool> {
        Arc::new(PinnedPool {
            allocator,
            cap,
            state: Mutex::new(State {
                free: BTreeMap::new(),
                stats: PoolStats::default(),
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The statistics now.
    pub fn stats(&self) -> PoolStats {
        self.state().stats
    }

    /// A buffer of at least `len` bytes: a cached one of its size class when there is
    /// one, else newly pinned (cached buffers are unpinned first to stay within the cap).
    pub(crate) fn take(self: &Arc<Self>, len: usize) -> Result<PinnedBuffer> {
        let class = size_class(len);
        let evicted = {
            let mut s = self.state();
            if let Some(block) = s.free.get_mut(&class).and_then(Vec::pop) {
                s.stats.hits += 1;
                s.stats.cached_bytes -= class;
                return Ok(PinnedBuffer {
                    block: Some(block),
                    len,
                    lent: AtomicBool::new(false),
                    pool: self.clone(),
                });
            }
            s.stats.misses += 1;
            let mut evicted = Vec::new();
            while s.stats.pinned_bytes + class > self.cap && s.stats.cached_bytes > 0 {
                let largest = *s
                    .free
                    .keys()
                    .next_back()
                    .expect("cached bytes imply a block");
                let blocks = s.free.get_mut(&largest).expect("present");
                let block = blocks.pop().expect("non-empty lists only");
                if blocks.is_empty() {
                    s.free.remove(&largest);
                }
                s.stats.cached_bytes -= block.len;
                s.stats.pinned_bytes -= block.len;
                evicted.push(block);
            }
            evicted
        };
        drop(evicted); // unpinned outside the lock
        let block = self.allocator.alloc(class)?;
        self.state().stats.pinned_bytes += class;
        Ok(PinnedBuffer {
            block: Some(block),
            len,
            lent: AtomicBool::new(false),
            pool: self.clone(),
        })
    }

    /// Takes every cached buffer of `len`'s size class, and one newly pinned, so that the
    /// next buffer of that class must be pinned anew (tests that refuse pinning).
    #[cfg(test)]
    pub(crate) fn hold_cached(self: &Arc<Self>, len: usize) -> Vec<PinnedBuffer> {
        let mut held = Vec::new();
        loop {
            let misses = self.stats().misses;
            held.push(self.take(len).unwrap());
            if self.stats().misses > misses {
                return held;
            }
        }
    }

    fn give_back(&self, block: HostBlock) {
        let mut s = self.state();
        if s.stats.pinned_bytes > self.cap {
            s.stats.pinned_bytes -= block.len;
            drop(s);
            drop(block); // over the cap: unpin instead of caching
            return;
        }
        s.stats.cached_bytes += block.len;
        s.free.entry(block.len).or_default().push(block);
    }
}

/// A pinned buffer from the pool; goes back to it when dropped (behind the allocator's
/// fence once it was lent).
pub(crate) struct PinnedBuffer {
    block: Option<HostBlock>,
    len: usize,
    /// Handed to another library: see [`PinnedBuffer::lend`].
    lent: AtomicBool,
    pool: Arc<PinnedPool>,
}

impl PinnedBuffer {
    /// Marks the buffer as lent to another library (a DLPack consumer), whose device work on
    /// it tensorferry cannot see: when dropped, it returns to the pool only behind the
    /// allocator's fence ([`PinnedAllocator::return_lent`]).
    pub(crate) fn lend(&self) {
        self.lent.store(true, Ordering::Relaxed);
    }

    /// Bytes asked for (the block may be larger).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The start address.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.block.as_ref().expect("held until drop").ptr
    }

    /// The bytes asked for.
    pub(crate) fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the block holds at least `len` bytes (its size class is ≥ len), owned by
        // this buffer until it is dropped; allocators hand out initialised memory (zeroed
        // host memory, or pinned memory tensorferry fills before anyone reads it).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let Some(block) = self.block.take() else {
            return;
        };
        if *self.lent.get_mut() {
            let pool = self.pool.clone();
            let back = Box::new(move |block| pool.give_back(block));
            self.pool.allocator.return_lent(block, back);
        } else {
            self.pool.give_back(block);
        }
    }
}

/// Host memory standing in for pinned memory where nothing needs pinning (the emulated
/// device): ordinary buffers, page aligned as the driver's pinned memory is (which
/// `O_DIRECT` reads into a staging buffer rely on), so the pool's bookkeeping runs the same.
pub(crate) struct PageableAllocator;

// SAFETY: each block is a fresh, zeroed `AlignedBuffer` of exactly `len` bytes, owned by
// the block (its release) and freed once when the block is dropped.
unsafe impl PinnedAllocator for PageableAllocator {
    fn alloc(&self, len: usize) -> Result<HostBlock> {
        let mut buffer = super::aligned::AlignedBuffer::zeroed_page_aligned(len)?;
        let ptr = buffer.as_mut_slice().as_mut_ptr();
        // SAFETY: `ptr` addresses `buffer`'s `len` bytes, which the release owns and frees.
        Ok(unsafe { HostBlock::new(ptr, len, Box::new(buffer)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::AlignedBuffer;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Stands in for cuMemHostAlloc: counts what it "pins" and what is still alive.
    struct Counting {
        pinned: Arc<AtomicUsize>,
        live: Arc<AtomicUsize>,
    }

    struct Release(AlignedBuffer, Arc<AtomicUsize>);
    impl Drop for Release {
        fn drop(&mut self) {
            self.1.fetch_sub(self.0.len(), Ordering::SeqCst);
        }
    }

    // SAFETY: each block is a fresh `AlignedBuffer` of `len` bytes, freed with its release.
    unsafe impl PinnedAllocator for Counting {
        fn alloc(&self, len: usize) -> Result<HostBlock> {
            self.pinned.fetch_add(len, Ordering::SeqCst);
            self.live.fetch_add(len, Ordering::SeqCst);
            let mut buf = AlignedBuffer::zeroed(len)?;
            let ptr = buf.as_mut_slice().as_mut_ptr();
            let release = Box::new(Release(buf, self.live.clone()));
            // SAFETY: `ptr` addresses `buf`'s `len` bytes, owned and freed by `release`.
            Ok(unsafe { HostBlock::new(ptr, len, release) })
        }
    }

    fn pool(cap: usize) -> (Arc<PinnedPool>, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let pinned = Arc::new(AtomicUsize::new(0));
        let live = Arc::new(AtomicUsize::new(0));
        let alloc = Counting {
            pinned: pinned.clone(),
            live: live.clone(),
        };
        (PinnedPool::new(Box::new(alloc), cap), pinned, live)
    }

    #[test]
    fn a_repeated_transfer_pins_nothing_new() {
        let (p, pinned, _) = pool(1 << 30);
        for _ in 0..5 {
            let a = p.take(3 << 20).unwrap();
            let b = p.take(100).unwrap();
            assert!(a.len() == 3 << 20 && b.len() == 100);
        }
        assert_eq!(pinned.load(Ordering::SeqCst), (4 << 20) + MIN_CLASS);
        let s = p.stats();
        assert_eq!((s.misses, s.hits), (2, 8));
        assert_eq!(s.cached_bytes, s.pinned_bytes);
    }

    #[test]
    fn size_classes_are_powers_of_two_from_64_kib() {
        assert_eq!(size_class(1), MIN_CLASS);
        assert_eq!(size_class(MIN_CLASS + 1), 2 * MIN_CLASS);
        assert_eq!(size_class(3 << 20), 4 << 20);
    }

    #[test]
    fn the_cap_unpins_cached_buffers_first() {
        let (p, _, live) = pool(4 << 20);
        drop(p.take(4 << 20).unwrap());
        assert_eq!(p.stats().cached_bytes, 4 << 20);
        let b = p.take(2 << 20).unwrap(); // a different class: the cached 4 MiB goes
        assert_eq!(live.load(Ordering::SeqCst), 2 << 20);
        assert_eq!(p.stats().pinned_bytes, 2 << 20);
        drop(b);
    }

    /// Holds lent blocks back until the test lets them go, as a fence that has not passed.
    struct Fenced(Arc<Mutex<Vec<(HostBlock, GiveBack)>>>);

    // SAFETY: each block is a fresh `AlignedBuffer` of `len` bytes, freed with its release.
    unsafe impl PinnedAllocator for Fenced {
        fn alloc(&self, len: usize) -> Result<HostBlock> {
            let mut buf = AlignedBuffer::zeroed(len)?;
            let ptr = buf.as_mut_slice().as_mut_ptr();
            // SAFETY: `ptr` addresses `buf`'s `len` bytes, owned and freed by the release.
            Ok(unsafe { HostBlock::new(ptr, len, Box::new(buf)) })
        }

        fn return_lent(&self, block: HostBlock, back: GiveBack) {
            self.0.lock().unwrap().push((block, back));
        }
    }

    #[test]
    fn a_lent_buffer_is_reused_only_once_its_fence_has_passed() {
        let held = Arc::new(Mutex::new(Vec::new()));
        let p = PinnedPool::new(Box::new(Fenced(held.clone())), 1 << 30);
        drop(p.take(100).unwrap());
        let lent = p.take(100).unwrap();
        assert_eq!(p.stats().hits, 1, "a buffer never lent comes back at once");
        lent.lend();
        drop(lent);
        let other = p.take(100).unwrap();
        assert_eq!(p.stats().misses, 2, "reused behind its fence");
        let (block, back) = held.lock().unwrap().pop().unwrap();
        back(block); // the fence passes
        drop(p.take(100).unwrap());
        assert_eq!(p.stats().hits, 2);
        drop(other);
    }

    #[test]
    fn buffers_over_the_cap_are_unpinned_when_returned() {
        let (p, _, live) = pool(1 << 20);
        let a = p.take(1 << 20).unwrap();
        let b = p.take(1 << 20).unwrap(); // over the cap while both are in use
        drop(a);
        drop(b);
        assert!(live.load(Ordering::SeqCst) <= 1 << 20);
        assert!(p.stats().pinned_bytes <= 1 << 20);
    }
}
