//! `tensorferry.Tensor`: a native tensor seen from Python, with NumPy and DLPack exchange.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use tensorferry::internal::backend::StreamHandle;
use tensorferry::{Device, Tensor};

use crate::errors::IntoPy;
use crate::{dlpack, numpy_interop};

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

    /// Waits until every copy into this tensor's memory has finished (non-blocking moves
    /// return before); raises the copy's error if it failed. Returns the tensor.
    fn wait(slf: &Bound<'_, Self>) -> PyResult<Py<PyTensor>> {
        crate::wait::wait_all(slf.py(), [&slf.get().inner])?;
        Ok(slf.clone().unbind())
    }

    /// True when no copy into this tensor's memory is still running.
    #[getter]
    fn is_ready(&self) -> bool {
        self.inner.is_ready()
    }

    /// A NumPy array of the tensor: zero-copy for host memory (read-only when the memory
    /// is), a copy for device memory; bfloat16 and float8 come as `ml_dtypes` arrays.
    ///
    /// >>> import numpy as np, tensorferry as tf
    /// >>> tf.Tensor.from_numpy(np.ones(2, np.int64)).numpy()
    /// array([1, 1])
    fn numpy(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(to_array(slf)?.unbind())
    }

    /// NumPy's array protocol: `np.asarray(tensor)`.
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__(
        slf: &Bound<'_, Self>,
        dtype: Option<Bound<'_, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let mut arr = to_array(slf)?;
        if let Some(dt) = dtype {
            arr = arr.call_method1("astype", (dt,))?;
        } else if copy == Some(true) {
            arr = arr.call_method0("copy")?;
        }
        Ok(arr.unbind())
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
        if matches!(self.inner.device(), Device::Emulated(_)) {
            return Err(crate::errors::buffer_err(format!(
                "{} memory has no DLPack device: move it to the host first",
                self.inner.device()
            )));
        }
        if let Some(dev) = dl_device {
            if dev != self.__dlpack_device__() {
                return Err(crate::errors::buffer_err(format!(
                    "cannot export a tensor on {} to DLPack device {dev:?}",
                    self.inner.device()
                )));
            }
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        // A consumer that names its CUDA stream gets the tensor at once, its stream made to
        // wait on the GPU for the copy filling it; otherwise the host waits for that copy.
        let ready = match consumer_stream(&self.inner, stream.as_ref())? {
            // SAFETY: the handle is the stream the DLPack consumer named for this tensor's
            // GPU (the protocol's contract: a live stream of the process, or 1/2 for the
            // default streams).
            Some(handle) => {
                crate::wait::ordered(py, &self.inner, unsafe { StreamHandle::new(handle) })?
            }
            None => crate::wait::readable(py, &self.inner)?,
        };
        if copy == Some(true) {
            let copied = py.detach(|| self.inner.deep_copy()).py_err()?;
            let ready = crate::wait::readable(py, &copied)?;
            return dlpack::export_capsule(py, ready, versioned, true);
        }
        dlpack::export_capsule(py, ready, versioned, copy != Some(false))
    }

    /// The CUDA Array Interface (version 3) of a tensor in CUDA memory, for consumers such
    /// as Numba (`numba.cuda.as_cuda_array(t)`), after every pending copy into it has
    /// finished. Tensors elsewhere have none (`hasattr` is false).
    #[getter]
    fn __cuda_array_interface__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        crate::cai::export(py, &self.inner)
    }

    /// The DLPack device: (1, 0) for the host, (2, N) for CUDA device N.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let d = tensorferry::internal::dlpack::dl_device(self.inner.device());
        (d.device_type, d.device_id)
    }

    /// A copy that shares no memory with this tensor (contiguous).
    fn copy(&self, py: Python<'_>) -> PyResult<PyTensor> {
        crate::wait::wait_all(py, [&self.inner])?;
        py.detach(|| self.inner.deep_copy())
            .py_err()
            .map(PyTensor::new)
    }

    /// This tensor on `device` (returned as is when already there, unless `copy`): a
    /// string, a GPU index, a `torch.device`, a JAX or a CuPy device, as every function of
    /// the package takes one.
    #[pyo3(signature = (device, *, copy=false))]
    fn to(&self, py: Python<'_>, device: &Bound<'_, PyAny>, copy: bool) -> PyResult<PyTensor> {
        let name: String = match device.extract::<String>() {
            Ok(name) => name,
            // The package's one reading of device objects (tensorferry._devices).
            Err(_) => py
                .import("tensorferry._devices")?
                .call_method1("name_of", (device,))?
                .extract()?,
        };
        let device: Device = name.parse().py_err()?;
        let options = tensorferry::MoveOptions {
            copy,
            ..Default::default()
        };
        let moved = crate::wait::move_tensors(py, &[&self.inner], device, options)?;
        Ok(PyTensor::new(
            moved.into_iter().next().expect("one result per source"),
        ))
    }

    /// Imports any object exporting DLPack (PyTorch, JAX, CuPy, NumPy) without copying.
    #[staticmethod]
    fn from_dlpack(obj: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        dlpack::import_object(obj).map(PyTensor::new)
    }

    /// Imports a NumPy array without copying (bfloat16/float8 ml_dtypes arrays too);
    /// byte-swapped arrays and strides that split elements are converted first.
    #[staticmethod]
    fn from_numpy(array: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        numpy_interop::import_or_convert(array).map(PyTensor::new)
    }

    fn __len__(&self) -> PyResult<usize> {
        self.inner
            .shape()
            .first()
            .copied()
            .ok_or_else(|| crate::errors::type_err("len() of a 0-d tensor"))
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

/// The CUDA stream a DLPack consumer named for a CUDA tensor (an integer handle; 1 and 2
/// are the legacy and per-thread default streams), or None: no stream, -1 ("do not
/// synchronise", where tensorferry still waits for its own copies), or host memory.
pub fn consumer_stream(
    tensor: &Tensor,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<usize>> {
    let Some(stream) = stream.filter(|s| !s.is_none()) else {
        return Ok(None);
    };
    if !matches!(tensor.device(), Device::Cuda(_)) {
        return Ok(None);
    }
    let handle: i128 = stream.extract().map_err(|_| {
        crate::errors::type_err("__dlpack__(stream=…) takes an integer CUDA stream handle")
    })?;
    match handle {
        -1 => Ok(None),
        0 => Err(crate::errors::buffer_err(
            "stream 0 is ambiguous in DLPack: pass 1 (legacy default) or 2 (per-thread default)",
        )),
        h if h > 0 && h <= usize::MAX as i128 => Ok(Some(h as usize)),
        h => Err(crate::errors::buffer_err(format!(
            "{h} is not a CUDA stream handle"
        ))),
    }
}

/// A NumPy array of `tensor`: a view of host memory (its base is the tensor object, which
/// keeps the memory alive), or a view of a host copy of device memory.
pub fn to_array<'py>(tensor: &Bound<'py, PyTensor>) -> PyResult<Bound<'py, PyAny>> {
    let py = tensor.py();
    let t = &tensor.get().inner;
    if !t.device().is_host() {
        // Device memory: copy to the host (after the copies queued into it), then view that.
        let host = crate::wait::move_tensors(py, &[t], Device::Cpu, Default::default())?;
        let host = host.into_iter().next().expect("one result per source");
        return to_array(&Bound::new(py, PyTensor::new(host))?);
    }
    // Always: a failed copy is "ready" too, and must raise, never show its buffer.
    crate::wait::wait_all(py, [t])?;
    // SAFETY: `t` is on the host, every copy into it has ended (above), and the base, the
    // tensor object, holds `t` and with it its storage.
    unsafe { numpy_interop::host_array(t, tensor.clone().into_any()) }
}

/// The `tensorferry.Tensor` leaves of `[(path, leaf)]` as NumPy arrays, in one pass:
/// `({id(leaf): array}, [(path, leaf)] of every other leaf)`. Tensors in device memory
/// come to the host first, all in one planned transfer; host tensors are viewed
/// (zero-copy). A dtype NumPy needs ml_dtypes for, without it, is an error naming the key.
pub fn native_leaves_to_numpy<'py>(
    py: Python<'py>,
    leaves: &Bound<'py, PyList>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>)> {
    let arrays = PyDict::new(py);
    let rest = PyList::empty(py);
    let mut natives: Vec<(Bound<'py, PyTuple>, Bound<'py, PyAny>, Bound<'py, PyTensor>)> =
        Vec::with_capacity(leaves.len());
    let mut on_device = Vec::new();
    for item in leaves.iter() {
        let (path, leaf): (Bound<'py, PyTuple>, Bound<'py, PyAny>) = item.extract()?;
        let Ok(tensor) = leaf.cast_exact::<PyTensor>() else {
            rest.append((path, leaf))?;
            continue;
        };
        let tensor = tensor.clone();
        if !tensor.get().inner.device().is_host() {
            on_device.push(natives.len());
        }
        natives.push((path, leaf, tensor));
    }
    if !on_device.is_empty() {
        let sources: Vec<&Tensor> = on_device
            .iter()
            .map(|&i| &natives[i].2.get().inner)
            .collect();
        let hosted = crate::wait::move_tensors(py, &sources, Device::Cpu, Default::default())?;
        for (i, host) in on_device.into_iter().zip(hosted) {
            natives[i].2 = Bound::new(py, PyTensor::new(host))?;
        }
    }
    let mut ml_dtypes_found = false;
    for (path, leaf, tensor) in natives {
        let dtype = tensor.get().inner.dtype();
        let key = || crate::errors::shown_path(&path.iter().collect::<Vec<_>>());
        if !dtype.is_numpy_native() && !dtype.is_ml_dtypes() {
            return Err(numpy_interop::no_numpy_dtype(dtype, &key()));
        }
        if !dtype.is_numpy_native() && !ml_dtypes_found {
            // Raises the error naming the key (as the Python rules show paths) when
            // ml_dtypes is missing.
            let key = key();
            py.import("tensorferry._numpy")?
                .call_method1("require_ml_dtypes", (dtype.name(), key))?;
            ml_dtypes_found = true;
        }
        arrays.set_item(leaf.as_ptr() as usize, to_array(&tensor)?)?;
    }
    Ok((arrays, rest))
}
