//! NumPy arrays in and out without copying, through NumPy's C API (the `numpy` crate):
//! reading an array's fields directly and making arrays whose base is the tensor.

use std::ffi::c_int;

use numpy::npyffi::{self, npy_intp, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use tensorferry::{DType, Device, Tensor};

use crate::errors::{format_err, IntoPy};

pub const NPY_ARRAY_WRITEABLE: c_int = 0x0400;

/// The tensorferry dtype of a NumPy dtype, or `None` (byte-swapped, object, strings…).
fn dtype_of(descr: &Bound<'_, PyArrayDescr>) -> PyResult<Option<DType>> {
    if descr.is_native_byteorder() == Some(false) {
        return Ok(None);
    }
    let size = descr.itemsize();
    if matches!(descr.kind(), b'V' | b'f') && size <= 2 {
        // ml_dtypes' types say who they are by name (float8_e5m2 even claims kind 'f').
        let name = descr.typeobj().name()?;
        let name = name.to_cow()?;
        if let Some(d) = DType::ALL
            .into_iter()
            .find(|d| d.is_ml_dtypes() && d.name() == name.as_ref())
        {
            return Ok(Some(d));
        }
    }
    Ok(dtype_of_kind(char::from(descr.kind()), size))
}

/// The element type of an array-protocol kind character and item size (`('f', 4)` is
/// float32), as NumPy's dtypes and the CUDA Array Interface's typestrs name them.
pub(crate) fn dtype_of_kind(kind: char, size: usize) -> Option<DType> {
    Some(match (kind, size) {
        ('b', 1) => DType::Bool,
        ('u', 1) => DType::U8,
        ('u', 2) => DType::U16,
        ('u', 4) => DType::U32,
        ('u', 8) => DType::U64,
        ('i', 1) => DType::I8,
        ('i', 2) => DType::I16,
        ('i', 4) => DType::I32,
        ('i', 8) => DType::I64,
        ('f', 2) => DType::F16,
        ('f', 4) => DType::F32,
        ('f', 8) => DType::F64,
        ('c', 8) => DType::Complex64,
        ('c', 16) => DType::Complex128,
        _ => return None,
    })
}

/// A tensor viewing the array's memory (kept alive by the tensor), or `None` when the
/// array's layout or dtype cannot be viewed (the caller converts it first).
pub fn array_to_tensor(obj: &Bound<'_, PyAny>) -> PyResult<Option<Tensor>> {
    if !is_ndarray(obj)? {
        return Err(crate::errors::type_err("expected a numpy.ndarray"));
    }
    // SAFETY: checked just above that `obj` is a numpy.ndarray (or a subclass).
    let arr = unsafe { obj.cast_unchecked::<PyUntypedArray>() };
    let Some(dtype) = dtype_of(&arr.dtype())? else {
        return Ok(None);
    };
    // SAFETY: `arr` is a live NumPy array; its object struct is readable while we hold it.
    let fields = unsafe { &(*arr.as_array_ptr()).fields };
    let ndim = fields.nd as usize;
    let (dims, byte_strides): (&[npy_intp], &[npy_intp]) = if ndim == 0 {
        (&[], &[])
    } else {
        // SAFETY: NumPy keeps `nd` dimensions and strides behind these pointers.
        unsafe {
            (
                std::slice::from_raw_parts(fields.dimensions, ndim),
                std::slice::from_raw_parts(fields.strides, ndim),
            )
        }
    };
    let size = dtype.size() as isize;
    if byte_strides.iter().any(|s| s % size != 0) {
        return Ok(None);
    }
    let shape: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
    let strides: Vec<isize> = byte_strides.iter().map(|&s| s / size).collect();
    let read_only = fields.flags & NPY_ARRAY_WRITEABLE == 0;
    let owner: Py<PyAny> = obj.clone().unbind();
    // SAFETY: the array's data holds the described elements while the array lives, which
    // `owner` ensures; read-only arrays stay read-only.
    unsafe {
        Tensor::from_foreign(
            fields.data as *mut u8,
            Device::Cpu,
            read_only,
            Box::new(owner),
            dtype,
            shape,
            strides,
        )
    }
    .py_err()
    .map(Some)
}

/// The error for a dtype NumPy cannot hold even with ml_dtypes (the packed 4- and 6-bit
/// floats: ml_dtypes holds one value a byte).
pub fn no_numpy_dtype(dtype: DType, key: &str) -> PyErr {
    let at = if key.is_empty() {
        String::new()
    } else {
        format!(" at {key:?}")
    };
    crate::errors::to_py(tensorferry::Error::UnsupportedDType {
        key: key.to_string(),
        dtype: dtype.to_string(),
        reason: format!(
            "the tensor{at} holds {} values packed in each element, which no NumPy dtype \
             holds (ml_dtypes keeps one value a byte): keep it a tensorferry.Tensor or a \
             PyTorch tensor, or view its bytes as uint8 (.view(\"uint8\") in PyTorch)",
            dtype.lanes()
        ),
    })
}

/// NumPy dtypes by tensorferry dtype, made once; bfloat16/float8 need ml_dtypes.
fn descr_for<'py>(py: Python<'py>, dtype: DType) -> PyResult<Bound<'py, PyArrayDescr>> {
    const N: usize = DType::ALL.len();
    static CACHE: [PyOnceLock<Py<PyArrayDescr>>; N] = [const { PyOnceLock::new() }; N];
    if !dtype.is_numpy_native() && !dtype.is_ml_dtypes() {
        return Err(no_numpy_dtype(dtype, ""));
    }
    let index = DType::ALL.iter().position(|d| *d == dtype).expect("listed");
    let descr = CACHE[index].get_or_try_init(py, || -> PyResult<Py<PyArrayDescr>> {
        let spec: Bound<'py, PyAny> = if dtype.is_numpy_native() {
            dtype.name().into_pyobject(py)?.into_any()
        } else {
            let ml = py.import("ml_dtypes").map_err(|_| {
                format_err(format!(
                    "the {dtype} tensor needs ml_dtypes to become a NumPy array: pip install ml_dtypes \
                     (or read its raw bits with .view() on a uint array)"
                ))
            })?;
            ml.getattr(dtype.name())?
        };
        Ok(PyArrayDescr::new(py, &spec)?.unbind())
    })?;
    Ok(descr.bind(py).clone())
}

pub fn ndarray_type(py: Python<'_>) -> PyResult<*mut pyo3::ffi::PyTypeObject> {
    static T: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    Ok(T.import(py, "numpy", "ndarray")?.as_type_ptr())
}

/// True when `obj` is exactly a `numpy.ndarray` (one pointer comparison; the numpy crate's
/// own type check looks the type up each time, which costs microseconds).
pub fn is_exact_ndarray(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(obj.get_type().as_type_ptr() == ndarray_type(obj.py())?)
}

/// True when `obj` is a `numpy.ndarray` or a subclass of it.
pub fn is_ndarray(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let ty = obj.get_type();
    if ty.as_type_ptr() == ndarray_type(obj.py())? {
        return Ok(true);
    }
    static T: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    obj.is_instance(T.import(obj.py(), "numpy", "ndarray")?)
}

/// A NumPy array viewing `t`, a host tensor, whose base is `base`. Read-only memory gives
/// a read-only array.
///
/// # Safety
/// `t` is in host memory, every copy into it has ended, and `base` keeps its storage
/// alive for as long as `base` lives.
pub unsafe fn host_array<'py>(t: &Tensor, base: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let descr = descr_for(base.py(), t.dtype())?;
    let size = t.dtype().size() as isize;
    let mut dims: Vec<npy_intp> = t.shape().iter().map(|&d| d as npy_intp).collect();
    let mut strides: Vec<npy_intp> = t
        .strides()
        .iter()
        .map(|&s| (s * size) as npy_intp)
        .collect();
    // NumPy arrays of a file map are read-only, also of a copy-on-write map (which only
    // frameworks that need writable memory are given).
    let flags = if t.is_read_only() || t.storage().is_mapped() {
        0
    } else {
        NPY_ARRAY_WRITEABLE
    };
    // SAFETY: dims and strides have one entry per dimension and describe memory inside the
    // tensor's storage (read-only memory flagged so), which the array's base keeps alive for
    // the array's lifetime (this function's contract).
    unsafe {
        array_over(
            descr,
            &mut dims,
            &mut strides,
            t.data_ptr() as *mut std::ffi::c_void,
            flags,
            base,
        )
    }
}

/// A new `numpy.ndarray` of `descr` over the memory at `data`, of dimensions `dims` and
/// byte strides `strides`, with NumPy's `flags`, whose base is `base`.
///
/// # Safety
/// `dims` and `strides` have one entry per dimension (as many each), and describe memory
/// from `data` that `base` keeps alive, readable (and writable when `flags` say so), for
/// as long as `base` lives.
pub unsafe fn array_over<'py>(
    descr: Bound<'py, PyArrayDescr>,
    dims: &mut [npy_intp],
    strides: &mut [npy_intp],
    data: *mut std::ffi::c_void,
    flags: c_int,
    base: Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = descr.py();
    debug_assert_eq!(dims.len(), strides.len());
    // SAFETY: NewFromDescr steals the reference `into_ptr` gives to `descr`; `dims` and
    // `strides` and the memory they describe are as the caller guarantees. SetBaseObject
    // steals the reference `into_ptr` gives to `base`, which from then on keeps that memory
    // alive as long as the array.
    unsafe {
        let raw = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            ndarray_type(py)?,
            descr.into_ptr() as *mut npyffi::PyArray_Descr,
            dims.len() as c_int,
            dims.as_mut_ptr(),
            strides.as_mut_ptr(),
            data,
            flags,
            std::ptr::null_mut(),
        );
        let arr = Bound::from_owned_ptr_or_err(py, raw)?;
        let base = base.into_ptr();
        if PY_ARRAY_API.PyArray_SetBaseObject(py, arr.as_ptr() as *mut npyffi::PyArrayObject, base)
            != 0
        {
            return Err(PyErr::fetch(py));
        }
        Ok(arr)
    }
}

/// A tensor viewing `array`; arrays that cannot be viewed as they are (byte-swapped,
/// strides splitting elements) are converted to a native contiguous array first.
pub fn import_or_convert(array: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    if let Some(t) = array_to_tensor(array)? {
        return Ok(t);
    }
    let py = array.py();
    let np = py.import("numpy")?;
    let dtype = array.getattr("dtype")?;
    let native = dtype.call_method1("newbyteorder", ("=",))?;
    let converted = np.call_method1("ascontiguousarray", (array, native))?;
    array_to_tensor(&converted)?.ok_or_else(|| {
        format_err(format!(
            "arrays of dtype {} cannot be tensors",
            dtype.str().map(|s| s.to_string()).unwrap_or_default()
        ))
    })
}
