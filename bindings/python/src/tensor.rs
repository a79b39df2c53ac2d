//! `tensorferry.Tensor`: a native tensor seen from Python, with NumPy and DLPack exchange.

use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};
use tensorferry::{DType, Device, Tensor};

use crate::dlpack;
use crate::errors::{format_err, IntoPy};

/// A tensor in host or device memory, shared with its views.
///
/// >>> import numpy as np, tensorferry as tf
/// >>> t = tf.Tensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
/// >>> t.shape, t.dtype, t.device
/// ((2, 3), 'float32', 'cpu')
#[pyclass(name = "Tensor", module = "tensorferry", frozen)]
pub struct PyTensor {
    /// The native tensor.
    pub inner: Tensor,
}

impl PyTensor {
    /// Wraps a native tensor.
    pub fn new(inner: Tensor) -> Self {
        PyTensor { inner }
    }
}

fn numpy_helper(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static F: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    F.import(py, "tensorferry._numpy", "tensor_to_numpy")
}

#[pymethods]
impl PyTensor {
    /// The shape, as a tuple of ints.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.shape())
    }

    /// The element type's name ("float32", "bfloat16", …).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name()
    }

    /// Where the memory lives ("cpu", "cuda:0").
    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    /// Bytes of the elements.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// Number of dimensions.
    #[getter]
    fn ndim(&self) -> usize {
        self.inner.shape().len()
    }

    /// Strides in elements.
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.strides())
    }

    /// True when the elements lie in C order without gaps.
    #[getter]
    fn is_contiguous(&self) -> bool {
        self.inner.is_contiguous()
    }

    /// True when the memory must not be written (e.g. a memory-mapped file).
    #[getter]
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }

    /// The address of element 0 (for debugging and zero-copy checks).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.inner.data_ptr() as usize
    }

    /// A NumPy array of the tensor: zero-copy for host memory (read-only when the memory
    /// is); bfloat16 and float8 come as `ml_dtypes` arrays.
    ///
    /// >>> import numpy as np, tensorferry as tf
    /// >>> tf.Tensor.from_numpy(np.ones(2, np.int64)).numpy()
    /// array([1, 1])
    fn numpy(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(numpy_helper(slf.py())?.call1((slf,))?.unbind())
    }

    /// NumPy's array protocol: `np.asarray(tensor)`.
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__(
        slf: &Bound<'_, Self>,
        dtype: Option<Bound<'_, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let mut arr = numpy_helper(slf.py())?.call1((slf,))?;
        if let Some(dt) = dtype {
            arr = arr.call_method1("astype", (dt,))?;
        } else if copy == Some(true) {
            arr = arr.call_method0("copy")?;
        }
        Ok(arr.unbind())
    }

    /// The NumPy array-interface dict of a host tensor (raw bits for bfloat16/float8).
    fn _array_interface<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if !self.inner.device().is_host() {
            return Err(PyBufferError::new_err(format!(
                "the tensor is on {}: move it to the host first (tensorferry.to_host)",
                self.inner.device()
            )));
        }
        let size = self.inner.dtype().size() as isize;
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", PyTuple::new(py, self.inner.shape())?)?;
        d.set_item("typestr", self.inner.dtype().numpy_typestr())?;
        d.set_item(
            "data",
            (self.inner.data_ptr() as usize, self.inner.is_read_only()),
        )?;
        if self.inner.is_contiguous() {
            d.set_item("strides", py.None())?;
        } else {
            let bytes: Vec<isize> = self.inner.strides().iter().map(|s| s * size).collect();
            d.set_item("strides", PyTuple::new(py, bytes)?)?;
        }
        Ok(d)
    }

    /// The DLPack protocol: a capsule viewing this tensor's memory.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = stream; // Host memory needs no stream ordering.
        if let Some(dev) = dl_device {
            if dev != self.__dlpack_device__() {
                return Err(PyBufferError::new_err(format!(
                    "cannot export a tensor on {} to DLPack device {dev:?}",
                    self.inner.device()
                )));
            }
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        let source = if copy == Some(true) {
            py.detach(|| self.inner.deep_copy()).py_err()?
        } else {
            self.inner.clone()
        };
        dlpack::export_capsule(py, &source, versioned, copy != Some(false))
    }

    /// The DLPack device: (1, 0) for the host, (2, N) for CUDA device N.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let d = tensorferry::dlpack::dl_device(self.inner.device());
        (d.device_type, d.device_id)
    }

    /// A copy that shares no memory with this tensor (contiguous).
    fn copy(&self, py: Python<'_>) -> PyResult<PyTensor> {
        py.detach(|| self.inner.deep_copy())
            .py_err()
            .map(PyTensor::new)
    }

    /// This tensor on `device` (returned as is when already there, unless `copy`).
    #[pyo3(signature = (device, *, copy=false))]
    fn to(&self, py: Python<'_>, device: &str, copy: bool) -> PyResult<PyTensor> {
        let device: Device = device.parse().py_err()?;
        py.detach(|| self.inner.to(device, copy))
            .py_err()
            .map(PyTensor::new)
    }

    /// Imports any object exporting DLPack (PyTorch, JAX, CuPy, NumPy) without copying.
    #[staticmethod]
    fn from_dlpack(obj: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        dlpack::import_object(obj).map(PyTensor::new)
    }

    /// Imports a NumPy array (or anything with `__array_interface__`) without copying;
    /// `dtype` names the element type where the type string cannot (ml_dtypes' bfloat16).
    #[staticmethod]
    #[pyo3(signature = (array, dtype=None))]
    fn from_numpy(array: &Bound<'_, PyAny>, dtype: Option<&str>) -> PyResult<PyTensor> {
        from_array_interface(array, dtype).map(PyTensor::new)
    }

    fn __len__(&self) -> PyResult<usize> {
        self.inner
            .shape()
            .first()
            .copied()
            .ok_or_else(|| PyTypeError::new_err("len() of a 0-d tensor"))
    }

    fn __repr__(&self) -> String {
        format!(
            "tensorferry.Tensor(shape={:?}, dtype={}, device={})",
            self.inner.shape(),
            self.inner.dtype(),
            self.inner.device()
        )
    }
}

fn dtype_of_typestr(typestr: &str) -> Option<DType> {
    let t = typestr.replace(['=', '|'], "<");
    Some(match t.as_str() {
        "<b1" => DType::Bool,
        "<u1" => DType::U8,
        "<i1" => DType::I8,
        "<u2" => DType::U16,
        "<i2" => DType::I16,
        "<u4" => DType::U32,
        "<i4" => DType::I32,
        "<u8" => DType::U64,
        "<i8" => DType::I64,
        "<f2" => DType::F16,
        "<f4" => DType::F32,
        "<f8" => DType::F64,
        "<c8" => DType::Complex64,
        "<c16" => DType::Complex128,
        _ => return None,
    })
}

/// Views the memory of an object with `__array_interface__` (kept alive by the tensor).
fn from_array_interface(array: &Bound<'_, PyAny>, dtype: Option<&str>) -> PyResult<Tensor> {
    let iface = array.getattr("__array_interface__")?;
    let iface = iface.cast::<PyDict>()?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        iface
            .get_item(k)?
            .ok_or_else(|| PyValueError::new_err(format!("__array_interface__ lacks {k:?}")))
    };
    let typestr: String = get("typestr")?.extract()?;
    let dtype = match dtype {
        Some(name) => name.parse::<DType>().py_err()?,
        None => dtype_of_typestr(&typestr)
            .ok_or_else(|| format_err(format!("unsupported array type {typestr:?}")))?,
    };
    let (ptr, read_only): (usize, bool) = get("data")?.extract()?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let size = dtype.size() as isize;
    let strides: Vec<isize> = match iface.get_item("strides")? {
        Some(s) if !s.is_none() => {
            let bytes: Vec<isize> = s.extract()?;
            if bytes.iter().any(|b| b % size != 0) {
                return Err(format_err(format!(
                    "strides {bytes:?} are not multiples of the element size {size}"
                )));
            }
            bytes.into_iter().map(|b| b / size).collect()
        }
        _ => tensorferry::tensor::contiguous_strides(&shape),
    };
    let owner: Py<PyAny> = array.clone().unbind();
    // The span of the elements, from the lowest byte touched.
    let numel: usize = shape.iter().product();
    let (mut below, mut above) = (0isize, size);
    if numel > 0 {
        for (&n, &s) in shape.iter().zip(&strides) {
            let reach = (n as isize - 1) * s * size;
            if reach < 0 {
                below += reach;
            } else {
                above += reach;
            }
        }
    } else {
        above = 0;
    }
    let lowest = (ptr as *mut u8).wrapping_offset(below);
    // SAFETY: NumPy's array interface promises `ptr` addresses the described elements for as
    // long as the exporting object lives; `owner` keeps it alive, and the span covers exactly
    // the elements. Read-only arrays are flagged read-only.
    let memory = unsafe {
        tensorferry::storage::ForeignMemory::new(
            lowest,
            (above - below) as usize,
            Device::Cpu,
            read_only,
            Box::new(owner),
        )
    };
    Tensor::from_storage(
        std::sync::Arc::new(tensorferry::Storage::Foreign(memory)),
        (-below) as usize,
        dtype,
        shape,
        strides,
    )
    .py_err()
}
