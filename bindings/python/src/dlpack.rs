//! DLPack capsules: importing a producer's `__dlpack__` capsule without copying, and
//! exporting tensorferry tensors as capsules. The C structures live in the core crate.

use std::ffi::{c_void, CStr};

use pyo3::ffi;
use pyo3::prelude::*;
use tensorferry::internal::dlpack::{
    self, DLManagedTensor, DLManagedTensorVersioned, ManagedTensor,
};
use tensorferry::internal::transfer::Readable;
use tensorferry::Tensor;

use crate::errors::IntoPy;

const VERSIONED: &CStr = c"dltensor_versioned";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";
const LEGACY: &CStr = c"dltensor";
const USED_LEGACY: &CStr = c"used_dltensor";

/// Owns an imported managed tensor and releases it with the interpreter attached, since
/// some producers' deleters (NumPy's) touch Python objects — never making one of
/// tensorferry's own threads wait for it ([`crate::release`]).
struct ReleaseAttached(Option<ManagedTensor>);

impl Drop for ReleaseAttached {
    fn drop(&mut self) {
        if let Some(managed) = self.0.take() {
            crate::release::attached(move || drop(managed));
        }
    }
}

/// Imports a `dltensor_versioned` or `dltensor` capsule, marking it used.
pub fn import_capsule(capsule: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let cap = capsule.as_ptr();
    // SAFETY: `cap` is a live object (borrowed from `capsule`); `PyCapsule_IsValid` accepts
    // any object and never raises.
    let managed = unsafe {
        if ffi::PyCapsule_IsValid(cap, VERSIONED.as_ptr()) == 1 {
            let p =
                ffi::PyCapsule_GetPointer(cap, VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
            if p.is_null() || ffi::PyCapsule_SetName(cap, USED_VERSIONED.as_ptr()) != 0 {
                return Err(PyErr::fetch(capsule.py()));
            }
            // The capsule held an unconsumed managed tensor and renaming it "used_…"
            // transferred its ownership to us (the DLPack protocol).
            ManagedTensor::versioned(p)
        } else if ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr()) as *mut DLManagedTensor;
            if p.is_null() || ffi::PyCapsule_SetName(cap, USED_LEGACY.as_ptr()) != 0 {
                return Err(PyErr::fetch(capsule.py()));
            }
            // As above, for a legacy capsule.
            ManagedTensor::legacy(p)
        } else {
            return Err(crate::errors::type_err(
                "expected an unused DLPack capsule (\"dltensor\" or \"dltensor_versioned\")",
            ));
        }
    };
    // SAFETY: the capsule held an unconsumed managed tensor from a DLPack producer, and
    // renaming it to "used_…" transferred ownership to us (the DLPack protocol).
    unsafe { dlpack::import(managed, |m| Box::new(ReleaseAttached(Some(m)))) }.py_err()
}

/// Calls `obj.__dlpack__()`, asking for a versioned capsule first and retrying without
/// `max_version` for producers that predate it (NumPy < 2, older PyTorch). For CUDA
/// memory it passes the stream tensorferry's copies on that GPU run on, so the producer
/// orders its queued work before them (on the GPU, without blocking the host).
pub fn import_object(obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let py = obj.py();
    let kwargs = pyo3::types::PyDict::new(py);
    if let Some(stream) = consumer_stream(obj) {
        kwargs.set_item("stream", stream)?;
    }
    kwargs.set_item("max_version", (1, 1))?;
    let capsule = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => {
            kwargs.del_item("max_version")?;
            obj.call_method("__dlpack__", (), Some(&kwargs))?
        }
        Err(e) => return Err(e),
    };
    import_capsule(&capsule)
}

/// The stream to pass to a producer of CUDA memory (DLPack device types 2 and 13), when
/// tensorferry can drive that GPU; `None` otherwise (host memory needs none).
fn consumer_stream(obj: &Bound<'_, PyAny>) -> Option<usize> {
    let (kind, id): (i32, i32) = obj.call_method0("__dlpack_device__").ok()?.extract().ok()?;
    if !matches!(kind, 2 | 13) || id < 0 {
        return None;
    }
    tensorferry::internal::backend::backend_for(tensorferry::Device::Cuda(id as usize))
        .ok()?
        .producer_stream()
        .map(|s| s.handle())
}

unsafe extern "C" fn destroy_versioned(cap: *mut ffi::PyObject) {
    // SAFETY: called by Python once, when the capsule dies. Only an unconsumed capsule
    // (still named "dltensor_versioned") owns its tensor; a consumer renamed it otherwise.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, VERSIONED.as_ptr()) == 1 {
            let p =
                ffi::PyCapsule_GetPointer(cap, VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
            if let Some(d) = (*p).deleter {
                d(p);
            }
        }
    }
}

unsafe extern "C" fn destroy_legacy(cap: *mut ffi::PyObject) {
    // SAFETY: as in `destroy_versioned`, for "dltensor".
    unsafe {
        if ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*p).deleter {
                d(p);
            }
        }
    }
}

/// Wraps a readable tensor in a DLPack capsule: versioned when the consumer asked for version ≥ 1,
/// else the legacy form. Read-only memory cannot be flagged in the legacy form, so it
/// is copied for such consumers unless `allow_copy` is false, which is an error.
pub fn export_capsule(
    py: Python<'_>,
    ready: Readable<'_>,
    versioned: bool,
    allow_copy: bool,
) -> PyResult<Py<PyAny>> {
    // SAFETY (both branches): the pointer comes from `export_*` and is owned by the new
    // capsule, whose destructor releases it unless a consumer took it over.
    unsafe {
        let raw = if versioned {
            let p = dlpack::export_versioned(ready);
            ffi::PyCapsule_New(
                p as *mut c_void,
                VERSIONED.as_ptr(),
                Some(destroy_versioned),
            )
        } else {
            let owned;
            let src = if ready.tensor().is_read_only() {
                if !allow_copy {
                    return Err(crate::errors::buffer_err(
                        "read-only memory cannot be exported through DLPack < 1.0 without a copy",
                    ));
                }
                owned = py.detach(|| ready.tensor().deep_copy()).py_err()?;
                crate::wait::readable(py, &owned)?
            } else {
                ready
            };
            let p = dlpack::export_legacy(src);
            ffi::PyCapsule_New(p as *mut c_void, LEGACY.as_ptr(), Some(destroy_legacy))
        };
        Bound::from_owned_ptr_or_err(py, raw).map(Bound::unbind)
    }
}
