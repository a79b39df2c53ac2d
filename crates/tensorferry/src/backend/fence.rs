//! What a backend hands back for work it queued on a device: a fence that can be polled or
//! waited for, and after which another library's stream (a [`StreamHandle`]) can be ordered. Backend-neutral:
//! a host [`super::Event`] carries one while its work is queued on a device, and the
//! engine, the transfer layer and the bindings see only this trait, never a driver type.

use std::any::Any;
use std::fmt;

use crate::device::Device;
use crate::error::Result;

/// A point in a device's queue, passed once the work queued before it has run.
pub trait Fence: Send + Sync + fmt::Debug {
    /// The device whose queue the fence is in.
    fn device(&self) -> Device;

    /// Whether the device has passed the fence: `Ok(true)` done, `Ok(false)` not yet, or
    /// the device's error.
    fn poll(&self) -> Result<bool>;

    /// Blocks until the device has passed the fence; the device's error, if any.
    fn wait(&self) -> Result<()>;

    /// Makes the work queued on another library's `stream` from now on wait, on the device,
    /// until the fence is passed (the caller does not wait).
    fn order_stream(&self, stream: StreamHandle) -> Result<()>;

    /// The fence as the type of the backend that made it, which orders its own queues
    /// after its fences.
    fn as_any(&self) -> &dyn Any;
}

/// A stream of another library (PyTorch, JAX, CuPy, Numba), as a raw handle: a producer's
/// whose queued work tensorferry must read after, or a consumer's that must wait for
/// tensorferry's copies. Made only through the `unsafe` [`StreamHandle::new`], so that the
/// functions taking one can be safe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamHandle(usize);

impl StreamHandle {
    /// Names the stream `handle`.
    ///
    /// # Safety
    /// `handle` must be a live stream of this process (a CUDA stream of the primary
    /// context of the GPU it is used with, as PyTorch, JAX and CuPy create them), or a
    /// default-stream constant (1: legacy, 2: per-thread), for as long as the value is
    /// used: the driver does not validate every handle.
    pub unsafe fn new(handle: usize) -> StreamHandle {
        StreamHandle(handle)
    }

    /// The raw handle.
    pub fn handle(self) -> usize {
        self.0
    }
}
