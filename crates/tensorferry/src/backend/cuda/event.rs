//! A CUDA event (`CUevent`) recorded after a batch's copies: what later batches wait on
//! on the GPU (`cuStreamWaitEvent`), and the batch's [`Fence`], which the completer polls
//! to know the batch is done.
//! Destroyed when the last holder drops it (the batch's completer entry, the host
//! [`super::Event`] it marks, batches about to wait on it).

use cudarc::driver::sys::{self, CUresult};

use super::driver::{check, Context};
use crate::backend::fence::{Fence, StreamHandle};
use crate::device::Device;
use crate::error::Result;

/// `CU_EVENT_DISABLE_TIMING`: the event only orders and signals (cheaper to record).
const DISABLE_TIMING: u32 = 0x2;

/// One `CUevent` of a GPU's primary context.
pub(crate) struct CudaEvent {
    raw: sys::CUevent,
    context: Context,
    device: Device,
}

// SAFETY: a CUevent handle may be used from any thread with a context of the process
// current; it is destroyed once, in `drop`, when no holder is left.
unsafe impl Send for CudaEvent {}
// SAFETY: see `Send`; the driver serialises use of an event internally.
unsafe impl Sync for CudaEvent {}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaEvent({})", self.device)
    }
}

impl CudaEvent {
    /// Creates an event in `context` (which must be current on this thread) and records
    /// it on `stream` (a stream of that context): it completes when the stream reaches
    /// this point.
    pub(crate) fn record(context: Context, device: Device, stream: sys::CUstream) -> Result<Self> {
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the context is current (caller's contract); `raw` is a live out pointer.
        check(
            unsafe { sys::cuEventCreate(&mut raw, DISABLE_TIMING) },
            device,
            "cuEventCreate",
        )?;
        let event = CudaEvent {
            raw,
            context,
            device,
        };
        // SAFETY: the event was just created; the stream is live in the current context.
        check(
            unsafe { sys::cuEventRecord(event.raw, stream) },
            device,
            "cuEventRecord",
        )?;
        Ok(event)
    }

    /// Whether the GPU has passed the event: `Ok(true)` done, `Ok(false)` not yet, or the
    /// driver's error.
    pub(crate) fn query(&self) -> Result<bool> {
        // SAFETY: the event is live (destroyed only on drop).
        match unsafe { sys::cuEventQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => check(code, self.device, "cuEventQuery").map(|()| true),
        }
    }

    /// Makes `stream` (of the current context) wait on the GPU until this event is passed.
    pub(crate) fn wait_on(&self, stream: sys::CUstream, on: Device) -> Result<()> {
        // SAFETY: the event is live; the stream belongs to the current context (caller's
        // contract: the stream's device context is current).
        check(
            unsafe { sys::cuStreamWaitEvent(stream, self.raw, 0) },
            on,
            "cuStreamWaitEvent",
        )
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if let Ok(_current) = self.context.enter(self.device) {
            // SAFETY: created by `cuEventCreate` in this context and destroyed once; the
            // driver defers the release of an event still pending on a stream.
            unsafe {
                sys::cuEventDestroy_v2(self.raw);
            }
        }
    }
}

impl Fence for CudaEvent {
    fn device(&self) -> Device {
        self.device
    }

    fn poll(&self) -> Result<bool> {
        self.query()
    }

    fn wait(&self) -> Result<()> {
        let _current = self.context.enter(self.device)?;
        // SAFETY: the event is live; its context is current.
        check(
            unsafe { sys::cuEventSynchronize(self.raw) },
            self.device,
            "cuEventSynchronize",
        )
    }

    /// Runs with the event's context entered, whose default stream the handles 1 and 2
    /// name; `StreamHandle::new`'s contract makes the handle a live stream of this process
    /// usable with this event's GPU, or a default-stream constant.
    fn order_stream(&self, stream: StreamHandle) -> Result<()> {
        let _current = self.context.enter(self.device)?;
        self.wait_on(stream.handle() as sys::CUstream, self.device)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
