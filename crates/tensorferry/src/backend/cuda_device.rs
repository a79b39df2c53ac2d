//! The CUDA backend: device memory and copies through the driver API (cudarc's `sys`
//! layer, loaded at run time), in each GPU's primary context so that pointers from
//! PyTorch, JAX and CuPy in the same process are valid here.
//!
//! Each GPU has one CUDA stream of its own, created *blocking* (flags 0) so that it runs
//! after work on the legacy default stream, which DLPack producers synchronise with when no
//! stream is passed. A worker thread per GPU takes batches in order: it waits for the
//! host-side events the batch depends on, queues every copy of the batch on the stream
//! without waiting in between (`cuda_copy`: one `cuMemcpyBatchAsync` where the
//! driver has it, else one `cuMemcpy*Async` per copy), synchronises the stream once, and
//! completes the batch's event.
//!
//! NOTE: exercised in CI against the fake driver in `crates/fake-cuda` (which checks
//! contexts, address ranges and stream order); it has not run on a real GPU yet.

use std::any::Any;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};

use super::cuda::{status, CudaStatus};
use super::cuda_copy::CopyQueue;
pub use super::cuda_copy::{CopyPath, BATCHED_COPY_DRIVER, COPY_PATH_VAR};
use super::cuda_pinned::CudaPinnedAllocator;
use super::event::{Failure, Outcome};
use super::stream::{Job, StreamThread};
use super::{Backend, CopyBatch, DeviceMemory, Event};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::PinnedPool;

/// Most bytes the pinned pool keeps pinned (pinning is slow; so is holding too much).
const PINNED_POOL_CAP: usize = 8 << 30;

/// A primary context handle, shared between threads (the driver allows that).
#[derive(Clone, Copy)]
pub(crate) struct Context(sys::CUcontext);
// SAFETY: a CUDA context handle may be made current on any thread; it is never freed
// while the process runs (the primary context is retained once and kept).
unsafe impl Send for Context {}
// SAFETY: see `Send`.
unsafe impl Sync for Context {}

impl Context {
    /// Makes the context current on the calling thread until the guard drops, then
    /// restores the thread's previous context — so a user's thread (and what PyTorch
    /// takes for its current device) is left as tensorferry found it.
    pub(crate) fn enter(self, device: Device) -> Result<Current> {
        // SAFETY: the handle came from `cuDevicePrimaryCtxRetain` and stays retained.
        check(
            unsafe { sys::cuCtxPushCurrent_v2(self.0) },
            device,
            "cuCtxPushCurrent",
        )?;
        Ok(Current {
            _not_send: std::marker::PhantomData,
        })
    }

    /// Makes the context current on the calling thread for good (tensorferry's own
    /// threads only).
    pub(crate) fn make_current(self, device: Device) -> Result<()> {
        // SAFETY: the handle came from `cuDevicePrimaryCtxRetain` and stays retained.
        check(
            unsafe { sys::cuCtxSetCurrent(self.0) },
            device,
            "cuCtxSetCurrent",
        )
    }
}

/// A context pushed on the calling thread by [`Context::enter`]; popped when dropped, on
/// the same thread (the guard cannot move to another).
pub(crate) struct Current {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for Current {
    fn drop(&mut self) {
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `enter` pushed a context on this thread (the guard is not `Send`), so
        // there is one to pop; `previous` is a live out pointer.
        unsafe {
            sys::cuCtxPopCurrent_v2(&mut previous);
        }
    }
}

/// Turns a driver result into ours, naming the call that failed.
pub(crate) fn check(code: CUresult, device: Device, what: &str) -> Result<()> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::DeviceUnavailable {
            device: device.to_string(),
            reason: format!("{what} failed: {code:?}"),
        })
    }
}

/// One GPU: its primary context and the thread that runs its batches in order.
pub struct CudaDevice {
    ordinal: usize,
    pub(crate) context: Context,
    queue: Arc<CopyQueue>,
    stream: StreamThread,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice(cuda:{})", self.ordinal)
    }
}

/// The backend of `cuda:ordinal`, set up on first use.
pub fn device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    static REGISTRY: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    let name = Device::Cuda(ordinal);
    match status() {
        CudaStatus::Unavailable { reason } => {
            return Err(Error::DeviceUnavailable {
                device: name.to_string(),
                reason: reason.clone(),
            })
        }
        CudaStatus::Available { gpus, .. } if ordinal >= gpus.len() => {
            return Err(Error::DeviceUnavailable {
                device: name.to_string(),
                reason: format!("only {} CUDA device(s) present", gpus.len()),
            })
        }
        CudaStatus::Available { .. } => {}
    }
    let mut devices = REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(d) = devices.get(&ordinal) {
        return Ok(d.clone());
    }
    let mut dev: sys::CUdevice = 0;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver is loaded and initialised (`status()` is Available); the out
    // pointers are live locals of the right types.
    unsafe {
        check(
            sys::cuDeviceGet(&mut dev, ordinal as i32),
            name,
            "cuDeviceGet",
        )?;
        check(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            name,
            "cuDevicePrimaryCtxRetain",
        )?;
    }
    let context = Context(ctx);
    let queue = {
        let _current = context.enter(name)?;
        Arc::new(CopyQueue::new(name, driver_version_of(status()))?)
    };
    let stream = StreamThread::spawn(name, move || {
        let _ = context.make_current(name);
    })?;
    let d = Arc::new(CudaDevice {
        ordinal,
        context,
        queue,
        stream,
    });
    devices.insert(ordinal, d.clone());
    Ok(d)
}

/// Device memory from `cuMemAlloc`, freed with `cuMemFree` (which waits for the device).
struct Allocation {
    address: sys::CUdeviceptr,
    context: Context,
    device: Device,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if let Ok(_current) = self.context.enter(self.device) {
            // SAFETY: `address` came from `cuMemAlloc_v2` in this context and is freed once;
            // the engine drops it only after every batch using it has completed.
            unsafe {
                sys::cuMemFree_v2(self.address);
            }
        }
    }
}

impl Backend for CudaDevice {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// One process-wide pool: PORTABLE pinned memory serves every GPU.
    fn pinned_pool(&self) -> Result<Arc<PinnedPool>> {
        static POOL: OnceLock<Arc<PinnedPool>> = OnceLock::new();
        if let Some(p) = POOL.get() {
            return Ok(p.clone());
        }
        let allocator = CudaPinnedAllocator::new(self.ordinal)?;
        Ok(POOL
            .get_or_init(|| PinnedPool::new(Box::new(allocator), PINNED_POOL_CAP))
            .clone())
    }

    /// The driver copies ordinary host memory through its own small pinned buffers, one
    /// synchronous piece at a time: the engine's ring overlaps that with host copies.
    fn prefers_pinned_staging(&self) -> bool {
        true
    }

    fn alloc(&self, len: usize) -> Result<DeviceMemory> {
        let name = Backend::device(self);
        if len == 0 {
            // SAFETY: zero bytes: nothing is ever read or written at the null address.
            return Ok(unsafe { DeviceMemory::new(name, std::ptr::null_mut(), 0, Box::new(())) });
        }
        let _current = self.context.enter(name)?;
        let mut address: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; `address` is a live out pointer.
        let code = unsafe { sys::cuMemAlloc_v2(&mut address, len) };
        if code == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: live out pointers; the context is current.
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
            return Err(Error::OutOfMemory {
                device: name.to_string(),
                requested: len,
                free,
                total,
            });
        }
        check(code, name, "cuMemAlloc")?;
        let release = Allocation {
            address,
            context: self.context,
            device: name,
        };
        // SAFETY: `cuMemAlloc` succeeded: `address` is `len` bytes of this device's memory,
        // freed once, by `release`'s drop.
        Ok(unsafe { DeviceMemory::new(name, address as *mut u8, len, Box::new(release)) })
    }

    unsafe fn submit(&self, batch: CopyBatch, keep: Box<dyn Any + Send>, event: &Event) {
        let done = event.clone();
        let name = Backend::device(self);
        let queue = self.queue.clone();
        let job: Job = Box::new(move || {
            // The whole batch (it is `Send`), not its fields.
            let batch = batch;
            // SAFETY: `submit`'s contract: the addresses are valid for `len` bytes in the
            // memories the direction names until the event completes, which is after
            // `run_batch` has returned (with the stream synchronised, whatever happened);
            // this thread has the device's primary context current.
            let outcome = unsafe { run_batch(&queue, &batch, name) };
            // What the batch held goes first (buffers back to their pool), so that anyone
            // woken by the event finds the pool as the batch left it.
            drop(keep);
            done.complete(outcome);
        });
        self.stream.queue(job, event);
    }
}

/// One batch on the stream thread of `device`: its waits, then its copies. When anything
/// fails or panics, the stream is synchronised before this returns, so that no copy
/// already queued still runs once the batch's memory is released.
///
/// # Safety
/// As [`CopyQueue::run`].
unsafe fn run_batch(queue: &CopyQueue, batch: &CopyBatch, device: Device) -> Outcome {
    for e in &batch.waits {
        e.wait_outcome()?;
    }
    // SAFETY: forwarded contract.
    match catch_unwind(AssertUnwindSafe(|| unsafe { queue.run(batch) })) {
        Ok(result) => result.map_err(|e| Failure::from_error(device, &e)),
        Err(panic) => {
            queue.synchronize();
            Err(Failure::internal(device, &*panic))
        }
    }
}

impl CudaDevice {
    /// The raw `CUstream` handle this GPU's copies run on: a producer that makes it wait
    /// for its own stream (DLPack's `__dlpack__(stream=handle)`) needs no host
    /// synchronisation before tensorferry reads its tensors.
    pub fn stream_handle(&self) -> usize {
        self.queue.stream_handle()
    }

    /// Why this GPU gave up batched copies, if a batched call failed.
    pub fn copy_fallback(&self) -> Option<String> {
        self.queue.fallback_reason()
    }

    /// How this GPU's batches are queued: batched where the driver allows it.
    pub fn copy_path(&self) -> CopyPath {
        self.queue.path()
    }
}

fn driver_version_of(s: &CudaStatus) -> i32 {
    match s {
        CudaStatus::Available { driver_version, .. } => *driver_version,
        CudaStatus::Unavailable { .. } => 0,
    }
}

/// Blocks until the work queued on a producer's CUDA stream (a raw `CUstream` handle from
/// PyTorch, CuPy or JAX) has finished, so tensorferry reads what it computed. Without a
/// CUDA driver it fails with `DeviceUnavailable` and touches nothing.
///
/// # Safety
/// `handle` must be a live `CUstream` of this process (created in a context of this
/// process and not yet destroyed), or 1 (`CU_STREAM_LEGACY`) or 2 (`CU_STREAM_PER_THREAD`).
/// The driver rejects some bad handles with an error code, but it does not validate every
/// integer: one that names no stream may be read as a stream object, which is undefined
/// behaviour.
pub unsafe fn stream_synchronize(handle: usize) -> Result<()> {
    if let CudaStatus::Unavailable { reason } = status() {
        return Err(Error::DeviceUnavailable {
            device: "cuda".into(),
            reason: reason.clone(),
        });
    }
    // SAFETY: the driver is loaded and initialised; the handle is a live stream of this
    // process or a default-stream constant (this function's contract).
    check(
        unsafe { sys::cuStreamSynchronize(handle as sys::CUstream) },
        Device::Cuda(0),
        "cuStreamSynchronize",
    )
}

/// The GPU that owns device memory at `address` — a pointer handed over by another
/// producer (the CUDA Array Interface names no device) — as the driver reports it.
pub fn pointer_device(address: usize) -> Result<usize> {
    if let CudaStatus::Unavailable { reason } = status() {
        return Err(Error::DeviceUnavailable {
            device: "cuda".into(),
            reason: reason.clone(),
        });
    }
    let mut ordinal: std::ffi::c_int = -1;
    // SAFETY: the driver is loaded and initialised; the out pointer is a live int, the size
    // the device-ordinal attribute writes; an unknown address is an error code.
    check(
        unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut std::ffi::c_int).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                address as sys::CUdeviceptr,
            )
        },
        Device::Cuda(0),
        "cuPointerGetAttribute (the device of a foreign pointer)",
    )?;
    usize::try_from(ordinal).map_err(|_| Error::DeviceUnavailable {
        device: "cuda".into(),
        reason: format!("the driver gave device ordinal {ordinal} for address {address:#x}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn current() -> sys::CUcontext {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is loaded (the caller checked); live out pointer.
        unsafe { sys::cuCtxGetCurrent(&mut ctx) };
        ctx
    }

    #[test]
    fn a_users_thread_keeps_its_current_context() {
        if device(0).is_err() {
            eprintln!("skipped: no CUDA driver");
            return;
        }
        // A thread with no context, as PyTorch leaves its workers until they touch a GPU.
        std::thread::spawn(|| {
            assert!(current().is_null());
            let host = crate::Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
            let there = host.to(Device::Cuda(0), false).unwrap();
            let back = there.to(Device::Cpu, false).unwrap();
            drop(there);
            assert_eq!(back.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
            assert!(current().is_null(), "tensorferry left a context current");
        })
        .join()
        .unwrap();
    }
}
