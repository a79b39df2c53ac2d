//! The CUDA driver layer under the backend: the primary context (entered with the
//! thread's own context and capture mode restored after), the typed result of a driver
//! call, and the questions asked of the driver as a whole (the GPUs' handles and primary
//! contexts, the device of a foreign pointer, a synchronisation of every active GPU).
//! Knows nothing of the backend above it: the backend's files depend on it, never the
//! other way.

use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};

use super::{status, CudaStatus};
use crate::device::Device;
use crate::error::{Error, Result};

/// A primary context handle, shared between threads (the driver allows that).
#[derive(Clone, Copy)]
pub(crate) struct Context(pub(crate) sys::CUcontext);
// SAFETY: a CUDA context handle may be made current on any thread; it is never freed
// while the process runs (the primary context is retained once and kept).
unsafe impl Send for Context {}
// SAFETY: see `Send`.
unsafe impl Sync for Context {}

impl Context {
    /// Makes the context current on the calling thread until the guard drops, then
    /// restores the thread's previous context — so a user's thread (and what PyTorch
    /// takes for its current device) is left as tensorferry found it.
    ///
    /// For the guard's life the thread's stream-capture mode is also *relaxed*: while
    /// another thread captures a CUDA graph in PyTorch's default (global) mode, the calls
    /// tensorferry makes (event queries, stream synchronisation) would otherwise invalidate
    /// that capture. The thread's own mode comes back with its context.
    pub(crate) fn enter(self, device: Device) -> Result<Current> {
        // SAFETY: the handle came from `cuDevicePrimaryCtxRetain` and stays retained.
        check(
            unsafe { sys::cuCtxPushCurrent_v2(self.0) },
            device,
            "cuCtxPushCurrent",
        )?;
        Ok(Current {
            capture_mode: exchange_capture_mode(RELAXED),
            _not_send: std::marker::PhantomData,
        })
    }

    /// Blocks until `stream` has run the work queued on it so far, with the context entered
    /// for the call (whose default stream the handles 1 and 2 name); `what` names the call
    /// in the error.
    ///
    /// # Safety
    /// `stream` must be a live stream of this process usable in this context, or a
    /// default-stream constant (1: legacy, 2: per-thread): the driver does not validate
    /// every handle.
    pub(crate) unsafe fn synchronize(
        self,
        device: Device,
        stream: usize,
        what: &str,
    ) -> Result<()> {
        let _current = self.enter(device)?;
        // SAFETY: the context is current; the caller's contract covers the handle.
        let code = unsafe { sys::cuStreamSynchronize(stream as sys::CUstream) };
        check(code, device, what)
    }

    /// Makes the context current on the calling thread for good, its stream-capture mode
    /// relaxed (tensorferry's own threads only).
    pub(crate) fn make_current(self, device: Device) -> Result<()> {
        // SAFETY: the handle came from `cuDevicePrimaryCtxRetain` and stays retained.
        check(
            unsafe { sys::cuCtxSetCurrent(self.0) },
            device,
            "cuCtxSetCurrent",
        )?;
        exchange_capture_mode(RELAXED);
        Ok(())
    }
}

/// The relaxed stream-capture mode (`CU_STREAM_CAPTURE_MODE_RELAXED`).
pub(crate) const RELAXED: std::ffi::c_uint =
    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED as std::ffi::c_uint;

/// Sets the calling thread's stream-capture mode; returns the one it replaced (`None` if
/// the driver refused, and then nothing changed). Modes are kept as the driver's integers:
/// one this build's enum does not name must not become an enum value.
pub(crate) fn exchange_capture_mode(mode: std::ffi::c_uint) -> Option<std::ffi::c_uint> {
    let mut mode = mode;
    // SAFETY: the driver is loaded (a context exists); `mode` is a live in/out integer of
    // the enum's size (a C enum is an unsigned int), which the driver reads and overwrites
    // with the thread's previous mode; Rust never reads it as the enum type.
    let code = unsafe {
        sys::cuThreadExchangeStreamCaptureMode(
            (&mut mode as *mut std::ffi::c_uint).cast::<sys::CUstreamCaptureMode>(),
        )
    };
    (code == CUresult::CUDA_SUCCESS).then_some(mode)
}

/// A context pushed on the calling thread by [`Context::enter`]; popped when dropped, on
/// the same thread (the guard cannot move to another), the thread's capture mode restored.
pub(crate) struct Current {
    capture_mode: Option<std::ffi::c_uint>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for Current {
    fn drop(&mut self) {
        if let Some(mode) = self.capture_mode {
            exchange_capture_mode(mode);
        }
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

/// A context to ask the driver about addresses in (under unified addressing any context
/// answers for every GPU's memory): the primary context of the first GPU whose primary
/// context is active — the producer's, for a pointer another library handed over — else
/// GPU 0's, so that no GPU gets a context only for a question. Retained once and kept.
fn lookup_context(gpus: usize) -> Result<(Context, Device)> {
    static LOOKUP: OnceLock<(Context, Device)> = OnceLock::new();
    if let Some(found) = LOOKUP.get() {
        return Ok(*found);
    }
    let mut chosen = cu_device(0)?;
    let mut ordinal = 0;
    for i in 0..gpus {
        let name = Device::Cuda(i);
        // A GPU the driver cannot answer about is passed over.
        let active = cu_device(i).and_then(|dev| Ok((dev, primary_is_active(dev, name)?)));
        if let Ok((dev, true)) = active {
            (chosen, ordinal) = (dev, i);
            break;
        }
    }
    let name = Device::Cuda(ordinal);
    // Retained for the life of the process.
    let ctx = retain_primary(chosen, name)?;
    Ok(*LOOKUP.get_or_init(|| (Context(ctx), name)))
}

/// The driver's handle of GPU `ordinal`. Call only with the driver available.
pub(crate) fn cu_device(ordinal: usize) -> Result<sys::CUdevice> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: the driver is loaded and initialised (callers checked that `status()` is
    // Available); the out pointer is a live local of the right type.
    let result = unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) };
    check(result, Device::Cuda(ordinal), "cuDeviceGet")?;
    Ok(dev)
}

/// Whether the primary context of GPU `dev` is active (some library of the process uses
/// it).
pub(crate) fn primary_is_active(dev: sys::CUdevice, name: Device) -> Result<bool> {
    let (mut flags, mut active): (std::ffi::c_uint, std::ffi::c_int) = (0, 0);
    // SAFETY: `dev` came from `cuDeviceGet`; the out pointers are live locals of the
    // right types.
    let result = unsafe { sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) };
    check(result, name, "cuDevicePrimaryCtxGetState")?;
    Ok(active != 0)
}

/// Retains the primary context of GPU `dev`: the caller releases it
/// (`cuDevicePrimaryCtxRelease_v2`) or keeps it for the life of the process.
pub(crate) fn retain_primary(dev: sys::CUdevice, name: Device) -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `dev` came from `cuDeviceGet`; the out pointer is a live local of the right
    // type.
    let result = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) };
    check(result, name, "cuDevicePrimaryCtxRetain")?;
    Ok(ctx)
}

/// Synchronises the primary context of every GPU whose primary context is active: the
/// contexts tensorferry and the other libraries of the process (PyTorch, JAX, CuPy) use,
/// all their streams included. The last fence behind which memory lent to another library,
/// whose streams are unknown, is used again. It waits for the GPUs: freeing threads only.
pub(crate) fn synchronize_active_gpus() -> Result<()> {
    let super::CudaStatus::Available { gpus, .. } = super::status() else {
        return Ok(());
    };
    for ordinal in 0..gpus.len() {
        let name = Device::Cuda(ordinal);
        let dev = cu_device(ordinal)?;
        if !primary_is_active(dev, name)? {
            continue; // no context: no work
        }
        // Retained here and released below.
        let ctx = retain_primary(dev, name)?;
        let synchronised = Context(ctx).enter(name).and_then(|_current| {
            // SAFETY: the driver is loaded and the context is current on this thread.
            check(unsafe { sys::cuCtxSynchronize() }, name, "cuCtxSynchronize")
        });
        // SAFETY: retained above, released once.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) };
        synchronised?;
    }
    Ok(())
}

/// The GPU that owns device memory at `address` — a pointer handed over by another
/// producer (the CUDA Array Interface names no device) — as the driver reports it. The
/// driver answers in the current context, so one is pushed for the call (and popped: the
/// calling thread keeps its own).
pub(crate) fn pointer_device(address: usize) -> Result<usize> {
    let gpus = match status() {
        CudaStatus::Unavailable { reason } => {
            return Err(Error::DeviceUnavailable {
                device: "cuda".into(),
                reason: reason.clone(),
            })
        }
        CudaStatus::Available { gpus, .. } => gpus.len(),
    };
    let (context, name) = lookup_context(gpus)?;
    let _current = context.enter(name)?;
    let mut ordinal: std::ffi::c_int = -1;
    // SAFETY: the driver is loaded and initialised, a context is current; the out pointer
    // is a live int, the size the device-ordinal attribute writes; an unknown address is an
    // error code.
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
