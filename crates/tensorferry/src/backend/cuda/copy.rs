//! How one batch of copies is queued on a GPU's streams (one for uploads, one for copies
//! that read device memory): all of them without waiting in between, and without waiting
//! for them (the caller records an event after them).
//!
//! Two paths, chosen once per GPU: `cuMemcpyBatchAsync` (one driver call for the whole
//! batch; drivers 12.8 and newer that export it) and one `cuMemcpy*Async` per copy (every
//! driver). `TENSORFERRY_CUDA_COPY=batched|per-copy` forces one, to measure both. When a
//! batched call fails, the batch is queued again copy by copy (copies are idempotent and
//! stream-ordered, so a partly queued batch is harmless) and the GPU stays on that path,
//! with the reason kept for `tensorferry info`.

use std::ffi::c_void;
use std::fmt;
use std::sync::Mutex;

use cudarc::driver::sys::{self, CUresult};

use super::driver::check;
use crate::backend::interface::{CopyBatch, CopyOp, Direction};
use crate::backend::lane::{lane_of, LANES};
use crate::device::Device;
use crate::error::{Error, Result};

/// The environment variable that forces a copy path.
pub const COPY_PATH_VAR: &str = "TENSORFERRY_CUDA_COPY";

/// The first driver version with `cuMemcpyBatchAsync` (12.8).
pub const BATCHED_COPY_DRIVER: i32 = 12080;

/// How a GPU's batches are queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyPath {
    /// One `cuMemcpyBatchAsync` per batch.
    Batched,
    /// One `cuMemcpy*Async` per copy.
    PerCopy,
}

impl fmt::Display for CopyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CopyPath::Batched => "batched (cuMemcpyBatchAsync)",
            CopyPath::PerCopy => "per copy (cuMemcpyAsync)",
        })
    }
}

/// The path for a driver of `version`: batched when the driver has it, unless
/// `forced` (the value of [`COPY_PATH_VAR`]) says otherwise. `has_symbol` tells whether
/// the loaded library exports the entry point (CUDA 13 renamed it).
pub(crate) fn choose_path(
    version: i32,
    has_symbol: bool,
    forced: Option<&str>,
) -> Result<CopyPath> {
    let available = version >= BATCHED_COPY_DRIVER && has_symbol;
    match forced.map(str::trim) {
        // Forcing a path the driver lacks falls back: never fail for a driver too old.
        None | Some("" | "auto" | "batched") if available => Ok(CopyPath::Batched),
        None | Some("" | "auto" | "batched" | "per-copy") => Ok(CopyPath::PerCopy),
        Some(other) => Err(Error::InvalidValue {
            key: COPY_PATH_VAR.into(),
            reason: format!("{other:?}: expected auto, batched or per-copy"),
        }),
    }
}

/// A GPU's stream handle (created in its primary context, never destroyed).
struct Stream(sys::CUstream);
// SAFETY: a CUDA stream handle may be used from any thread with its context current.
unsafe impl Send for Stream {}
// SAFETY: see `Send`; the driver serialises use of a stream internally.
unsafe impl Sync for Stream {}

/// A GPU's streams and the path its batches take.
pub(crate) struct CopyQueue {
    device: Device,
    streams: [Stream; LANES],
    path: Mutex<(CopyPath, Option<String>)>,
}

impl CopyQueue {
    /// Creates the stream of `device` (its context must be current on this thread), with
    /// the path for a driver of `driver_version`.
    pub(crate) fn new(device: Device, driver_version: i32) -> Result<CopyQueue> {
        let create = || {
            let mut stream: sys::CUstream = std::ptr::null_mut();
            // SAFETY: the context is current (caller's contract); `stream` is a live out
            // pointer. A non-blocking stream: no implicit synchronisation with the legacy
            // default stream (PyTorch's default), so copies overlap the work queued there
            // instead of stalling it; every order with a producer's stream is explicit.
            check(
                unsafe {
                    sys::cuStreamCreate(
                        &mut stream,
                        sys::CUstream_flags::CU_STREAM_NON_BLOCKING as std::ffi::c_uint,
                    )
                },
                device,
                "cuStreamCreate",
            )
            .map(|()| Stream(stream))
        };
        let streams = [create()?, create()?];
        // SAFETY: the library is loaded (the device exists); looking a symbol up calls
        // nothing.
        let has_symbol = unsafe {
            sys::culib()
                .get::<*const c_void>(b"cuMemcpyBatchAsync\0")
                .is_ok()
        };
        let forced = std::env::var(COPY_PATH_VAR).ok();
        let path = choose_path(driver_version, has_symbol, forced.as_deref())?;
        Ok(CopyQueue {
            device,
            streams,
            path: Mutex::new((path, None)),
        })
    }

    /// The stream of lane `lane` (see [`lane_of`]).
    pub(crate) fn stream(&self, lane: usize) -> sys::CUstream {
        self.streams[lane].0
    }

    /// The path batches take now, and why the batched path was given up, if it was.
    pub(crate) fn path(&self) -> (CopyPath, Option<String>) {
        self.path.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Queues every copy of `batch` on its direction's stream, without waiting for them.
    /// On an error, the copies queued before it stay queued: the caller must not release
    /// their memory before the stream has passed them.
    ///
    /// # Safety
    /// Every op's ranges must be valid in the memories the direction names until the
    /// stream has passed these copies, and the device's context must be current on this
    /// thread.
    pub(crate) unsafe fn enqueue(&self, batch: &CopyBatch) -> Result<()> {
        let ops: Vec<&CopyOp> = batch.ops.iter().filter(|op| op.len > 0).collect();
        if ops.is_empty() {
            return Ok(());
        }
        let mut queued = false;
        if ops.len() > 1 && self.path().0 == CopyPath::Batched {
            // SAFETY: forwarded contract.
            match unsafe { self.queue_batched(batch.direction, &ops) } {
                Ok(()) => queued = true,
                Err(code) => {
                    *self.path.lock().unwrap_or_else(|p| p.into_inner()) = (
                        CopyPath::PerCopy,
                        Some(format!("cuMemcpyBatchAsync failed: {code:?}")),
                    );
                }
            }
        }
        if !queued {
            for (i, op) in ops.iter().enumerate() {
                // SAFETY: forwarded contract.
                let code = unsafe { self.queue_one(batch.direction, op) };
                if code != CUresult::CUDA_SUCCESS {
                    // The copies queued before this one still read and write the batch's
                    // memory: the caller waits for them before releasing it.
                    let what = format!(
                        "cuMemcpyAsync of copy {} of {} ({} bytes)",
                        i + 1,
                        ops.len(),
                        op.len
                    );
                    return check(code, self.device, &what);
                }
            }
        }
        Ok(())
    }

    /// One `cuMemcpy*Async`.
    ///
    /// # Safety
    /// As [`CopyQueue::enqueue`].
    unsafe fn queue_one(&self, direction: Direction, op: &CopyOp) -> CUresult {
        let s = self.stream(lane_of(direction));
        // SAFETY: forwarded contract: valid ranges, current context, our stream.
        unsafe {
            match direction {
                Direction::HostToDevice => sys::cuMemcpyHtoDAsync_v2(
                    op.dst as sys::CUdeviceptr,
                    op.src as *const c_void,
                    op.len,
                    s,
                ),
                Direction::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(
                    op.dst as *mut c_void,
                    op.src as sys::CUdeviceptr,
                    op.len,
                    s,
                ),
                // The generic copy: under unified addressing the driver finds each side's
                // GPU, so a source on another GPU is a peer copy: direct once this GPU has
                // peer access to that one (enabled by the first copy from there, where the
                // two can reach each other: `CudaDevice::reach`), else staged through the
                // host by the driver.
                Direction::DeviceToDevice => sys::cuMemcpyAsync(
                    op.dst as sys::CUdeviceptr,
                    op.src as sys::CUdeviceptr,
                    op.len,
                    s,
                ),
            }
        }
    }

    /// One `cuMemcpyBatchAsync` for all of `ops`, in stream order.
    ///
    /// # Safety
    /// As [`CopyQueue::enqueue`]; the path must be [`CopyPath::Batched`] (the driver has the
    /// entry point).
    unsafe fn queue_batched(
        &self,
        direction: Direction,
        ops: &[&CopyOp],
    ) -> std::result::Result<(), CUresult> {
        let mut dsts: Vec<sys::CUdeviceptr> = ops.iter().map(|op| op.dst as u64).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = ops.iter().map(|op| op.src as u64).collect();
        let mut sizes: Vec<usize> = ops.iter().map(|op| op.len).collect();
        let ordinal = match self.device {
            Device::Cuda(i) => i as i32,
            _ => 0,
        };
        let location = |on_device: bool| sys::CUmemLocation {
            type_: if on_device {
                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
            } else {
                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
            },
            id: if on_device { ordinal } else { 0 },
        };
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: location(direction != Direction::HostToDevice),
            dstLocHint: location(direction != Direction::DeviceToHost),
            flags: 0,
        }];
        let mut attr_idxs = [0usize];
        let mut fail_idx = usize::MAX;
        // SAFETY: the arrays hold `ops.len()` and 1 elements and live across the call;
        // the ranges are valid (forwarded contract); the stream is ours, not the legacy
        // one, which batched copies refuse.
        let code = unsafe {
            sys::cuMemcpyBatchAsync(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                ops.len(),
                attrs.as_mut_ptr(),
                attr_idxs.as_mut_ptr(),
                1,
                &mut fail_idx,
                self.stream(lane_of(direction)),
            )
        };
        if code == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batched_only_where_the_driver_has_it() {
        assert_eq!(choose_path(12080, true, None).unwrap(), CopyPath::Batched);
        assert_eq!(choose_path(13000, true, None).unwrap(), CopyPath::Batched);
        assert_eq!(choose_path(12040, true, None).unwrap(), CopyPath::PerCopy);
        assert_eq!(choose_path(13000, false, None).unwrap(), CopyPath::PerCopy);
    }

    #[test]
    fn forcing_a_path_never_uses_a_missing_entry_point() {
        assert_eq!(
            choose_path(12080, true, Some("per-copy")).unwrap(),
            CopyPath::PerCopy
        );
        assert_eq!(
            choose_path(12020, true, Some("batched")).unwrap(),
            CopyPath::PerCopy
        );
        let err = choose_path(12080, true, Some("fast")).unwrap_err();
        assert!(err.to_string().contains(COPY_PATH_VAR), "{err}");
    }
}
