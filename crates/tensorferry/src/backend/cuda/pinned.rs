//! Pinned host memory for the CUDA pinned pool: `cuMemHostAlloc(PORTABLE)`, never
//! write-combined (which would make CPU reads slow).

use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUresult};

use super::driver::{check, synchronize_active_gpus, Context};
use super::freer::Freer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::pinned::{GiveBack, HostBlock};

/// Pins host memory with `cuMemHostAlloc(PORTABLE)` — never write-combined, which would
/// make CPU reads slow — for the pinned pool. Like the rest of this module it has not run
/// on a GPU yet.
pub(crate) struct CudaPinnedAllocator {
    context: Context,
    device: Device,
    freer: Arc<Freer>,
    /// Drops what it is handed once the GPUs have run the work queued so far on the
    /// streams a consumer of lent memory may have used (never on the calling thread).
    lent_fence: LentFence,
}

/// Drops its argument once the consumers' stream work queued so far has run.
pub(crate) type LentFence = fn(Arc<dyn Any + Send + Sync>);

/// A lent block on its way back. When the last legacy-stream fence holding it drops it
/// (on a completer thread), the freeing thread synchronises every active GPU context —
/// which also covers work a consumer queued on its own non-blocking streams, which no
/// legacy-stream event orders — and only then gives the block back to the pool. After the
/// legacy fences have passed, that synchronisation rarely has anything left to wait for;
/// a block whose synchronisation fails is kept for good.
struct LentBlock {
    block: Mutex<Option<(HostBlock, GiveBack)>>,
    freer: Arc<Freer>,
}

impl Drop for LentBlock {
    fn drop(&mut self) {
        let taken = self
            .block
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((block, back)) = taken {
            self.freer.run(
                0,
                Box::new(move || match synchronize_active_gpus() {
                    Ok(()) => back(block),
                    Err(_) => std::mem::forget(block),
                }),
            );
        }
    }
}

impl CudaPinnedAllocator {
    /// An allocator pinning through `device`'s primary context `context` (usable by every
    /// GPU), freeing on that GPU's freeing thread `freer`, taking lent blocks back behind
    /// `lent_fence`.
    pub(crate) fn new(
        context: Context,
        device: Device,
        freer: Arc<Freer>,
        lent_fence: LentFence,
    ) -> Self {
        CudaPinnedAllocator {
            context,
            device,
            freer,
            lent_fence,
        }
    }
}

/// Memory from `cuMemHostAlloc`, freed with `cuMemFreeHost` on the GPU's freeing thread:
/// `cuMemFreeHost` waits for the GPU, and a pinned block is dropped wherever the pool gives
/// it up (a thread taking another size, a Python thread in a DLPack deleter).
struct PinnedRelease {
    /// The block's address (an integer: only the freeing thread uses it).
    address: usize,
    context: Context,
    device: Device,
    freer: Arc<Freer>,
}

impl Drop for PinnedRelease {
    fn drop(&mut self) {
        let (address, context, device) = (self.address, self.context, self.device);
        self.freer.run(
            0,
            Box::new(move || {
                if let Ok(_current) = context.enter(device) {
                    // SAFETY: `address` came from `cuMemHostAlloc` and is freed once, after
                    // the pool has given the block up (no copy uses it any more).
                    unsafe {
                        sys::cuMemFreeHost(address as *mut c_void);
                    }
                }
            }),
        );
    }
}

// SAFETY: each block is a fresh `cuMemHostAlloc` allocation of exactly `len` bytes (host
// memory, readable and writable from any thread of the process), freed once by its release
// (`cuMemFreeHost` in `PinnedRelease::drop`) when the block is dropped.
unsafe impl crate::memory::pinned::PinnedAllocator for CudaPinnedAllocator {
    fn alloc(&self, len: usize) -> Result<crate::memory::pinned::HostBlock> {
        let name = self.device;
        let _current = self.context.enter(name)?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: the context is current; `ptr` is a live out pointer.
        let code = unsafe { sys::cuMemHostAlloc(&mut ptr, len, sys::CU_MEMHOSTALLOC_PORTABLE) };
        if code == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(Error::OutOfMemory {
                device: "cpu (pinned)".into(),
                requested: len,
                free: 0,
                total: 0,
            });
        }
        check(code, name, "cuMemHostAlloc")?;
        let release = Box::new(PinnedRelease {
            address: ptr as usize,
            context: self.context,
            device: name,
            freer: self.freer.clone(),
        });
        // SAFETY: `cuMemHostAlloc` succeeded: `ptr` is `len` bytes of pinned host memory,
        // freed once by `release`.
        Ok(unsafe { crate::memory::pinned::HostBlock::new(ptr as *mut u8, len, release) })
    }

    /// Behind the allocator's fence (events on the consumers' streams, passed on the
    /// GPUs' completers), then a synchronisation of every active GPU context on the freeing
    /// thread (see `LentBlock`): its copies out of the block were queued before it let the
    /// block go. A block whose fence fails is kept for good.
    fn return_lent(&self, block: HostBlock, back: GiveBack) {
        (self.lent_fence)(Arc::new(LentBlock {
            block: Mutex::new(Some((block, back))),
            freer: self.freer.clone(),
        }));
    }
}
