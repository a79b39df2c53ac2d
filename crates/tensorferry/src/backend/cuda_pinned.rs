//! Pinned host memory for the CUDA pinned pool: `cuMemHostAlloc(PORTABLE)`, never
//! write-combined (which would make CPU reads slow).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};

use super::cuda_device::{check, device, Context, CudaDevice};
use super::Backend;
use crate::device::Device;
use crate::error::{Error, Result};

/// Pins host memory with `cuMemHostAlloc(PORTABLE)` — never write-combined, which would
/// make CPU reads slow — for the pinned pool. Like the rest of this module it has not run
/// on a GPU yet.
pub(crate) struct CudaPinnedAllocator {
    device: Arc<CudaDevice>,
}

impl CudaPinnedAllocator {
    /// An allocator pinning through `cuda:ordinal`'s primary context (usable by every GPU).
    pub(crate) fn new(ordinal: usize) -> Result<CudaPinnedAllocator> {
        Ok(CudaPinnedAllocator {
            device: device(ordinal)?,
        })
    }
}

/// Memory from `cuMemHostAlloc`, freed with `cuMemFreeHost`.
struct PinnedRelease {
    ptr: *mut c_void,
    context: Context,
    device: Device,
}

// SAFETY: the pointer only names the pinned block this value frees once.
unsafe impl Send for PinnedRelease {}
// SAFETY: see `Send`.
unsafe impl Sync for PinnedRelease {}

impl Drop for PinnedRelease {
    fn drop(&mut self) {
        if let Ok(_current) = self.context.enter(self.device) {
            // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once, after the pool
            // has given the block up.
            unsafe {
                sys::cuMemFreeHost(self.ptr);
            }
        }
    }
}

// SAFETY: each block is a fresh `cuMemHostAlloc` allocation of exactly `len` bytes (host
// memory, readable and writable from any thread of the process), freed once by its release
// (`cuMemFreeHost` in `PinnedRelease::drop`) when the block is dropped.
unsafe impl crate::memory::pinned::PinnedAllocator for CudaPinnedAllocator {
    fn alloc(&self, len: usize) -> Result<crate::memory::pinned::HostBlock> {
        let name = Backend::device(&*self.device);
        let _current = self.device.context.enter(name)?;
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
            ptr,
            context: self.device.context,
            device: name,
        });
        // SAFETY: `cuMemHostAlloc` succeeded: `ptr` is `len` bytes of pinned host memory,
        // freed once by `release`.
        Ok(unsafe { crate::memory::pinned::HostBlock::new(ptr as *mut u8, len, release) })
    }
}
