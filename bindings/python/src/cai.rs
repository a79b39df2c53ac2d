//! The CUDA Array Interface (`__cuda_array_interface__`, version 3): importing device
//! memory from producers such as Numba and CuPy without a copy, and exposing tensorferry's
//! CUDA tensors to consumers (a Numba kernel can take them as they are).
//!
//! Import follows the interface's stream rule: when the producer names a stream, tensorferry
//! synchronises on it before reading. Export waits for tensorferry's own pending copies
//! first, so it names no stream and any consumer may read at once.

// `AttributeError` is the protocol's answer for "no interface here" (`hasattr` says no):
// the one bare built-in the binding raises.
use pyo3::exceptions::PyAttributeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tensorferry::internal::backend::StreamHandle;
use tensorferry::{DType, Device, Tensor};

use crate::errors::IntoPy;

/// Keeps the producer object alive while tensorferry views its memory; released with the
/// interpreter attached (or leaked if it is gone, the only safe choice then), never making
/// one of tensorferry's own threads wait for it ([`crate::release`]).
struct Producer(Option<Py<PyAny>>);

impl Drop for Producer {
    fn drop(&mut self) {
        if let Some(obj) = self.0.take() {
            crate::release::attached(move || drop(obj));
        }
    }
}

/// The element type of a typestr such as `"<f4"`, `"|b1"` or `"<c8"`.
fn dtype_of(typestr: &str) -> PyResult<DType> {
    let bad = || {
        crate::errors::type_err(format!(
            "unsupported CUDA Array Interface typestr {typestr:?}"
        ))
    };
    let mut chars = typestr.chars();
    let order = chars.next().ok_or_else(bad)?;
    let kind = chars.next().ok_or_else(bad)?;
    let size: usize = chars.as_str().parse().map_err(|_| bad())?;
    let native = cfg!(target_endian = "little");
    match order {
        '<' | '=' if native => {}
        '|' => {}
        '>' if size == 1 => {}
        _ => {
            return Err(crate::errors::type_err(format!(
                "typestr {typestr:?}: byte-swapped device data is not supported"
            )))
        }
    }
    crate::numpy_interop::dtype_of_kind(kind, size).ok_or_else(bad)
}

/// The typestr of an element type; `None` for types the interface cannot name (bfloat16,
/// float8).
fn typestr_of(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Bool => "|b1",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::U8 => "|u1",
        DType::U16 => "<u2",
        DType::U32 => "<u4",
        DType::U64 => "<u8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::Complex64 => "<c8",
        DType::Complex128 => "<c16",
        _ => return None,
    })
}

fn invalid(what: impl std::fmt::Display) -> PyErr {
    crate::errors::format_err(format!("invalid __cuda_array_interface__: {what}"))
}

/// Imports the memory an object describes with `__cuda_array_interface__` (no copy),
/// after synchronising on the producer's stream when it names one.
pub fn import(obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let py = obj.py();
    let iface = obj.getattr("__cuda_array_interface__")?;
    let iface = iface.cast::<PyDict>().map_err(|_| invalid("not a dict"))?;
    let get = |key: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        Ok(iface.get_item(key)?.filter(|v| !v.is_none()))
    };
    if get("mask")?.is_some() {
        return Err(invalid("masked arrays are not supported"));
    }
    let shape: Vec<usize> = get("shape")?
        .ok_or_else(|| invalid("no shape"))?
        .extract()
        .map_err(|_| invalid("shape must be a tuple of non-negative ints"))?;
    let typestr: String = get("typestr")?
        .ok_or_else(|| invalid("no typestr"))?
        .extract()
        .map_err(|_| invalid("typestr must be a str"))?;
    let dtype = dtype_of(&typestr)?;
    let (address, read_only): (usize, bool) = get("data")?
        .ok_or_else(|| invalid("no data"))?
        .extract()
        .map_err(|_| invalid("data must be (pointer, read_only)"))?;
    let size = dtype.size();
    let strides: Vec<isize> = match get("strides")? {
        None => tensorferry::internal::tensor::contiguous_strides(&shape),
        Some(s) => {
            let bytes: Vec<isize> = s
                .extract()
                .map_err(|_| invalid("strides must be a tuple of ints"))?;
            if bytes.len() != shape.len() {
                return Err(invalid(format!(
                    "{} strides for {} dimensions",
                    bytes.len(),
                    shape.len()
                )));
            }
            bytes
                .iter()
                .map(|&b| {
                    if b % size as isize == 0 {
                        Ok(b / size as isize)
                    } else {
                        Err(invalid(format!(
                            "stride {b} is not a multiple of the element size {size}"
                        )))
                    }
                })
                .collect::<PyResult<_>>()?
        }
    };
    let nbytes = tensorferry::internal::tensor::checked_nbytes(dtype, &shape)
        .ok_or_else(|| invalid("shape overflows"))?;
    if address == 0 && nbytes > 0 {
        return Err(invalid("null data pointer for a non-empty array"));
    }
    // Version 3: the consumer synchronises on the producer's stream before reading.
    let stream: Option<usize> = match get("stream")? {
        None => None,
        Some(s) => {
            let handle: usize = s.extract().map_err(|_| invalid("stream must be an int"))?;
            if handle == 0 {
                return Err(invalid("stream 0 is disallowed (ambiguous); use 1 or 2"));
            }
            Some(handle)
        }
    };
    let device = if address == 0 {
        Device::Cuda(0)
    } else {
        tensorferry::internal::backend::pointer_device(address).py_err()?
    };
    match stream {
        Some(handle) => {
            // SAFETY: the handle comes from the producer's `__cuda_array_interface__`
            // (version 3 "stream"), which the protocol defines as a CUstream of this process
            // or 1/2 for the default streams; 0 is refused above. We cannot check it: the
            // driver validates handles it knows of, so a producer lying with an arbitrary
            // integer is only as safe as that validation. It runs in the context of the
            // memory's GPU, whose default stream the handles 1 and 2 name.
            let stream = unsafe { StreamHandle::new(handle) };
            let gpu = tensorferry::internal::backend::backend_for(device).py_err()?;
            py.detach(|| gpu.synchronize_stream(stream)).py_err()?;
        }
        // Without a stream, no synchronisation is required by the protocol, but producers
        // that run on the legacy default stream (Numba's default) name none: tensorferry's
        // streams are non-blocking, so its copies from this memory wait for that stream on
        // the GPU.
        None if address != 0 => {
            // SAFETY: 1 is `CU_STREAM_LEGACY`, the default stream of GPU `device`'s context.
            let legacy = unsafe { StreamHandle::new(1) };
            tensorferry::internal::backend::backend_for(device)
                .and_then(|gpu| gpu.order_after_stream(legacy))
                .py_err()?
        }
        None => {}
    }
    let owner = Box::new(Producer(Some(obj.clone().unbind())));
    // SAFETY: the producer promises, by the interface, that the elements it describes from
    // `address` are device memory valid while the object lives; `owner` keeps it alive for
    // as long as the storage (`from_foreign` checks the extent for overflow).
    unsafe {
        Tensor::from_foreign(
            address as *mut u8,
            device,
            read_only,
            owner,
            dtype,
            shape,
            strides,
        )
    }
    .py_err()
}

/// The `__cuda_array_interface__` of a tensor in CUDA memory, after its pending copies;
/// an `AttributeError` for any other tensor (so that `hasattr` says no).
pub fn export<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyDict>> {
    if !matches!(t.device(), Device::Cuda(_)) {
        return Err(PyAttributeError::new_err(format!(
            "__cuda_array_interface__: the tensor lives on {}, not on a CUDA device",
            t.device()
        )));
    }
    let typestr = typestr_of(t.dtype()).ok_or_else(|| {
        PyAttributeError::new_err(format!(
            "__cuda_array_interface__: {} has no typestr in the interface",
            t.dtype()
        ))
    })?;
    crate::wait::wait_all(py, [t])?;
    // The consumer names no stream: its work on the memory is fenced on the GPU's legacy
    // default stream before the memory is freed.
    t.storage().lend(None);
    let d = PyDict::new(py);
    d.set_item("shape", PyTuple::new(py, t.shape())?)?;
    d.set_item("typestr", typestr)?;
    d.set_item("data", (t.data_ptr() as usize, t.is_read_only()))?;
    let strides = if t.is_contiguous() {
        py.None()
    } else {
        let size = t.dtype().size() as isize;
        PyTuple::new(py, t.strides().iter().map(|s| s * size))?
            .into_any()
            .unbind()
    };
    d.set_item("strides", strides)?;
    // Every copy into the memory has finished: the consumer need not wait on any stream.
    d.set_item("stream", py.None())?;
    d.set_item("version", 3)?;
    Ok(d)
}
