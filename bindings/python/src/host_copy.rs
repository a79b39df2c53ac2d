//! The bytes of many small host leaves copied by the core into rows of one buffer: the
//! bulk host copies of `tensorferry._host_copy` (`to_host(copy=True)` of thousands of small
//! PyTorch CPU tensors or NumPy arrays, and their stacks bound for a device). Python groups
//! the leaves by dtype and shape and views the buffer as their rows; here each leaf's
//! address is read with the fewest calls (a NumPy array's fields directly, a PyTorch
//! tensor's `data_ptr()` and the checks its raw bytes need), never through a DLPack
//! capsule, and `consolidate::copy_into` copies them.

use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyTuple};
use tensorferry::internal::consolidate::copy_into;

use crate::errors::{format_err, IntoPy};
use crate::numpy_interop::is_exact_ndarray;

/// NumPy's flag of a C-contiguous array.
const NPY_ARRAY_C_CONTIGUOUS: std::ffi::c_int = 0x0001;

/// The address of the `item` bytes of a C-contiguous NumPy array of exactly `item` bytes,
/// else None.
fn array_bytes(leaf: &Bound<'_, PyAny>, item: usize) -> Option<usize> {
    // SAFETY: the caller checked that `leaf` is exactly a numpy.ndarray.
    let arr = unsafe { leaf.cast_unchecked::<PyUntypedArray>() };
    let nbytes = arr.len() * arr.dtype().itemsize();
    // SAFETY: `arr` is a live NumPy array; its object struct is readable while we hold it.
    let fields = unsafe { &(*arr.as_array_ptr()).fields };
    let contiguous = fields.flags & NPY_ARRAY_C_CONTIGUOUS != 0;
    (contiguous && nbytes == item).then_some(fields.data as usize)
}

/// Where a leaf's bytes are, when they are its values as they lie.
struct Source {
    /// The address of its first (and lowest) byte.
    address: usize,
    /// Its strides in elements when it is not C-contiguous (a transposed or channels-last
    /// tensor, dense all the same: its bytes are one run).
    strides: Option<Vec<isize>>,
}

/// True when `strides` lay `shape` out densely without overlap, in some order of the
/// dimensions: the bytes of such a tensor are one run of exactly its size, from its first
/// element.
fn dense(shape: &[usize], strides: &[isize]) -> bool {
    let mut dims: Vec<(isize, usize)> = strides
        .iter()
        .zip(shape)
        .filter(|(_, &n)| n != 1)
        .map(|(&s, &n)| (s, n))
        .collect();
    dims.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
    let mut expected = 1isize;
    for &(stride, n) in dims.iter().rev() {
        if stride != expected {
            return false;
        }
        expected = expected.saturating_mul(n as isize);
    }
    true
}

/// Where the `item` bytes of a PyTorch tensor are when they are its values: in host
/// memory, dense (C-contiguous, or in another order of its dimensions), without a negative
/// (or, with `conj`, conjugate) bit, of exactly `item` bytes; else None (also when PyTorch
/// raises an ordinary exception, as it does for a sparse tensor's contiguity).
fn tensor_bytes(leaf: &Bound<'_, PyAny>, item: usize, conj: bool) -> PyResult<Option<Source>> {
    let py = leaf.py();
    let read = || -> PyResult<Option<Source>> {
        let plain = leaf.getattr(pyo3::intern!(py, "is_cpu"))?.is_truthy()?
            && !leaf
                .call_method0(pyo3::intern!(py, "is_neg"))?
                .is_truthy()?
            && !(conj
                && leaf
                    .call_method0(pyo3::intern!(py, "is_conj"))?
                    .is_truthy()?)
            && leaf
                .getattr(pyo3::intern!(py, "nbytes"))?
                .extract::<usize>()?
                == item;
        if !plain {
            return Ok(None);
        }
        let strides = match leaf
            .call_method0(pyo3::intern!(py, "is_contiguous"))?
            .is_truthy()?
        {
            true => None,
            false => {
                let shape: Vec<usize> = leaf.getattr(pyo3::intern!(py, "shape"))?.extract()?;
                let strides: Vec<isize> =
                    leaf.call_method0(pyo3::intern!(py, "stride"))?.extract()?;
                if !dense(&shape, &strides) {
                    return Ok(None);
                }
                Some(strides)
            }
        };
        let address = leaf
            .call_method0(pyo3::intern!(py, "data_ptr"))?
            .extract()?;
        Ok(Some(Source { address, strides }))
    };
    match read() {
        Err(e) if e.is_instance_of::<PyException>(py) => Ok(None),
        other => other,
    }
}

/// Copies each leaf of `leaves` (NumPy arrays and PyTorch tensors of one dtype and shape,
/// `item` bytes each, more than 0) into row `i` of `dest` (a writable NumPy `uint8` array
/// of at least `len(leaves) * item` bytes, else an error before any copy), the GIL held,
/// each as soon as its address is read; with `conj`, complex tensors'
/// conjugate bit is checked too. Returns, for each leaf, True when its row holds its
/// values in C order, its strides (a tuple) when the row holds its bytes as they lie (a
/// dense PyTorch tensor in another order: a transposed or channels-last one), and False
/// when it was not copied (a GPU tensor, an overlapping or negative view, a NumPy array
/// that is not C-contiguous, …): its row is left as it was.
#[pyfunction]
pub fn copy_rows<'py>(
    leaves: &Bound<'py, PyList>,
    dest: &Bound<'py, PyArray1<u8>>,
    item: usize,
    conj: bool,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let py = leaves.py();
    if item == 0 {
        return Err(format_err("copy_rows needs rows of at least one byte"));
    }
    let mut dest = dest.try_readwrite()?;
    let dst = dest.as_slice_mut()?;
    let need = leaves.len().saturating_mul(item);
    if dst.len() < need {
        return Err(format_err(format!(
            "copy_rows needs {need} bytes of destination for {} rows of {item}, not {}",
            leaves.len(),
            dst.len()
        )));
    }
    let mut copied = Vec::with_capacity(leaves.len());
    for (i, leaf) in leaves.iter().enumerate() {
        let found = match is_exact_ndarray(&leaf)? {
            true => array_bytes(&leaf, item).map(|address| Source {
                address,
                strides: None,
            }),
            false => tensor_bytes(&leaf, item, conj)?,
        };
        copied.push(match found {
            None => PyBool::new(py, false).to_owned().into_any(),
            Some(Source { address, strides }) => {
                // SAFETY: `address` is the lowest of `item` bytes of host memory that hold
                // the live leaf's values, read just now (a C-contiguous NumPy array, or a
                // dense PyTorch CPU tensor of `item` bytes), and no Python code has run
                // since that could free or resize it: `leaves` holds the leaf and the GIL is
                // held. `dst` is memory of its own (a NumPy array borrowed read-write, so
                // no other Rust borrow sees it), never a leaf's.
                let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, item) };
                copy_into(dst, &[(bytes, i * item)]).py_err()?;
                match strides {
                    None => PyBool::new(py, true).to_owned().into_any(),
                    Some(strides) => PyTuple::new(py, strides)?.into_any(),
                }
            }
        });
    }
    Ok(copied)
}
