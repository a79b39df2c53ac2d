//! The CUDA backend, in a folder of its own: every driver call, every CUDA type and every
//! `unsafe` block that touches the driver lives here, and nothing above `backend/cuda/`
//! names a CUDA type (checked by `tests/layering.rs`); code above reaches a GPU through
//! [`crate::backend::Backend`], [`crate::backend::Fence`] and
//! [`crate::backend::StreamHandle`]. The driver is loaded at run time by cudarc, which
//! panics when `libcuda` cannot be loaded: every use starts with [`status`], which probes
//! once and turns absence into a reason.
//!
//! Each handle is an owner with private fields and a `Drop` (the context guard, events,
//! device and pinned allocations, the last two freed on the freeing thread); the streams
//! live as long as the process. cudarc's safe types are not used: they make their context
//! current with `cuCtxSetCurrent` on creation and in each `Drop`, on whatever thread drops
//! them, which would change the current context of another library's thread (PyTorch's),
//! and `CudaSlice` frees on the dropping thread; this folder pushes and pops contexts and
//! frees on its own thread.

pub(crate) mod copy;
pub mod device;
pub(crate) mod driver;
pub(crate) mod event;
pub(crate) mod freer;
pub(crate) mod pinned;

use std::ffi::{c_char, c_int};
use std::sync::OnceLock;

use cudarc::driver::sys;

/// What the CUDA driver on this machine offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaStatus {
    /// The driver loaded and initialised.
    Available {
        /// Driver version as CUDA encodes it (e.g. 12080 for 12.8).
        driver_version: i32,
        /// The GPUs' names, in device order.
        gpus: Vec<String>,
    },
    /// No usable driver, and why.
    Unavailable {
        /// The exact reason (library not found, init failed with code …, no device).
        reason: String,
    },
}

/// The cached result of probing the driver; the probe runs on first call only.
pub fn status() -> &'static CudaStatus {
    static STATUS: OnceLock<CudaStatus> = OnceLock::new();
    STATUS.get_or_init(probe)
}

/// The driver's version and how many GPUs it reports, when `cuda:ordinal` is one of them;
/// else why the device is unavailable.
pub(crate) fn gpu_present(ordinal: usize) -> crate::error::Result<(i32, usize)> {
    let unavailable = |reason| crate::error::Error::DeviceUnavailable {
        device: crate::device::Device::Cuda(ordinal).to_string(),
        reason,
    };
    match status() {
        CudaStatus::Unavailable { reason } => Err(unavailable(reason.clone())),
        CudaStatus::Available { gpus, .. } if ordinal >= gpus.len() => Err(unavailable(format!(
            "only {} CUDA device(s) present",
            gpus.len()
        ))),
        CudaStatus::Available {
            driver_version,
            gpus,
        } => Ok((*driver_version, gpus.len())),
    }
}

/// Formats a CUDA driver version (12080 → "12.8").
pub fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

fn probe() -> CudaStatus {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names and
    // drops what it opened; it calls no CUDA function.
    if !unsafe { sys::is_culib_present() } {
        return CudaStatus::Unavailable {
            reason: "no CUDA driver found (libcuda.so could not be loaded)".into(),
        };
    }
    let guarded = std::panic::catch_unwind(probe_loaded_driver);
    guarded.unwrap_or_else(|_| CudaStatus::Unavailable {
        reason: "the CUDA driver library is present but lacks an entry point tensorferry needs"
            .into(),
    })
}

fn probe_loaded_driver() -> CudaStatus {
    let unavailable = |what: &str, code: sys::CUresult| CudaStatus::Unavailable {
        reason: format!("{what} failed: {code:?}"),
    };
    // SAFETY: the library is present (checked by the caller); each call below passes
    // pointers to live, correctly typed locals, as the driver API requires.
    unsafe {
        let code = sys::cuInit(0);
        if code == sys::CUresult::CUDA_ERROR_STUB_LIBRARY {
            return CudaStatus::Unavailable {
                reason: "the libcuda.so loaded is the CUDA toolkit's stub, not the driver (a \
                         `stubs` directory on LD_LIBRARY_PATH?): put the driver's directory \
                         first"
                    .into(),
            };
        }
        if code != sys::CUresult::CUDA_SUCCESS {
            return unavailable("cuInit", code);
        }
        let mut driver_version: c_int = 0;
        let code = sys::cuDriverGetVersion(&mut driver_version);
        if code != sys::CUresult::CUDA_SUCCESS {
            return unavailable("cuDriverGetVersion", code);
        }
        let mut count: c_int = 0;
        let code = sys::cuDeviceGetCount(&mut count);
        if code != sys::CUresult::CUDA_SUCCESS {
            return unavailable("cuDeviceGetCount", code);
        }
        if count == 0 {
            return CudaStatus::Unavailable {
                reason: format!(
                    "CUDA driver {} found, but no CUDA device",
                    version_string(driver_version)
                ),
            };
        }
        let mut gpus = Vec::with_capacity(count as usize);
        for ordinal in 0..count {
            let mut dev: sys::CUdevice = 0;
            let mut name = [0 as c_char; 256];
            let ok = sys::cuDeviceGet(&mut dev, ordinal) == sys::CUresult::CUDA_SUCCESS
                && sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)
                    == sys::CUresult::CUDA_SUCCESS;
            gpus.push(if ok {
                std::ffi::CStr::from_ptr(name.as_ptr())
                    .to_string_lossy()
                    .into_owned()
            } else {
                format!("CUDA device {ordinal}")
            });
        }
        CudaStatus::Available {
            driver_version,
            gpus,
        }
    }
}
