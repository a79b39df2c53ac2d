//! The bytes of many small host leaves copied by the core into rows of one buffer: the
//! bulk host copies of `tensorferry._host_copy` (`to_host(copy=True)` of thousands of small
//! NumPy arrays or PyTorch CPU tensors, and PyTorch stacks bound for a device). NumPy arrays
//! are grouped, copied and handed out as rows here, in one call ([`copy_arrays`]); PyTorch
//! tensors are grouped by Python, which views the buffer as their rows ([`copy_rows`]).
//! Each leaf's address is read with the fewest calls (a NumPy array's fields directly, a
//! PyTorch tensor's `data_ptr()` and the checks its raw bytes need), never through a DLPack
//! capsule, and `consolidate::copy_into` copies them.

use std::collections::HashMap;
use std::ffi::c_int;

use numpy::npyffi::{self, npy_intp, NPY_TYPES};
use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyTuple};
use tensorferry::internal::consolidate::copy_into;

use crate::errors::{format_err, IntoPy};
use crate::numpy_interop::{array_over, is_exact_ndarray, NPY_ARRAY_WRITEABLE};

/// NumPy's flag of a C-contiguous array.
const NPY_ARRAY_C_CONTIGUOUS: c_int = 0x0001;

/// The NumPy dtypes copied in bulk (by number): booleans, integers, floats and complex
/// numbers but long doubles, all of which the engine also takes.
const PLAIN: [NPY_TYPES; 16] = [
    NPY_TYPES::NPY_BOOL,
    NPY_TYPES::NPY_BYTE,
    NPY_TYPES::NPY_UBYTE,
    NPY_TYPES::NPY_SHORT,
    NPY_TYPES::NPY_USHORT,
    NPY_TYPES::NPY_INT,
    NPY_TYPES::NPY_UINT,
    NPY_TYPES::NPY_LONG,
    NPY_TYPES::NPY_ULONG,
    NPY_TYPES::NPY_LONGLONG,
    NPY_TYPES::NPY_ULONGLONG,
    NPY_TYPES::NPY_HALF,
    NPY_TYPES::NPY_FLOAT,
    NPY_TYPES::NPY_DOUBLE,
    NPY_TYPES::NPY_CFLOAT,
    NPY_TYPES::NPY_CDOUBLE,
];

/// The fields of a NumPy array: its dimensions and its object struct.
fn array_fields<'a>(
    arr: &'a Bound<'_, PyUntypedArray>,
) -> (&'a npyffi::PyArrayObject_fields, &'a [npy_intp]) {
    // SAFETY: `arr` is a live NumPy array; its object struct, and the `nd` dimensions
    // behind its pointer, are readable while we hold it (the borrow of `arr` bounds 'a).
    unsafe {
        let fields = &(*arr.as_array_ptr()).fields;
        let dims = match fields.nd {
            0 => &[][..],
            nd => std::slice::from_raw_parts(fields.dimensions, nd as usize),
        };
        (fields, dims)
    }
}

/// The address of the `item` bytes of a C-contiguous NumPy array of exactly `item` bytes,
/// else None.
fn array_bytes(arr: &Bound<'_, PyUntypedArray>, item: usize) -> Option<usize> {
    let nbytes = arr.len() * arr.dtype().itemsize();
    let (fields, _) = array_fields(arr);
    let contiguous = fields.flags & NPY_ARRAY_C_CONTIGUOUS != 0;
    (contiguous && nbytes == item).then_some(fields.data as usize)
}

/// A group of NumPy arrays of one dtype number and shape, `item` bytes each.
struct Group<'py> {
    num: c_int,
    shape: Vec<npy_intp>,
    item: usize,
    /// Each array with its index among the leaves.
    members: Vec<(usize, Bound<'py, PyUntypedArray>)>,
}

/// A new C-contiguous, writeable NumPy array of `arr`'s dtype and shape over the `item`
/// bytes at `data`, which lie inside `raw` (its base); None when `arr` no longer holds
/// `item` bytes.
fn row<'py>(
    arr: &Bound<'py, PyUntypedArray>,
    data: *mut u8,
    item: usize,
    raw: &Bound<'py, PyArray1<u8>>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let descr = arr.dtype();
    let (_, shape) = array_fields(arr);
    let nd = shape.len();
    // NumPy's arrays have at most 64 dimensions (32 before NumPy 2).
    let (mut dims, mut strides) = ([0 as npy_intp; 64], [0 as npy_intp; 64]);
    if nd > dims.len() {
        return Ok(None);
    }
    dims[..nd].copy_from_slice(shape);
    let mut size = descr.itemsize() as npy_intp;
    for (stride, &n) in strides[..nd].iter_mut().zip(shape).rev() {
        *stride = size;
        size *= n;
    }
    if size as usize != item {
        return Ok(None);
    }
    // SAFETY: `dims` and `strides` hold `nd` entries (C order) that lay out exactly `item`
    // bytes (checked just above) from `data`, which the caller guarantees lie inside `raw`'s
    // writable memory; `raw`, the row's base, keeps that memory alive for the row's lifetime.
    let made = unsafe {
        array_over(
            descr,
            &mut dims[..nd],
            &mut strides[..nd],
            data as *mut std::ffi::c_void,
            NPY_ARRAY_WRITEABLE,
            raw.clone().into_any(),
        )
    }?;
    Ok(Some(made))
}

/// Copies into `raw` (new memory, a NumPy `uint8` array of at least `item` bytes a member)
/// the members of `part` that still are C-contiguous arrays of `item` bytes, row after
/// row, and puts each one's row in `out` under its `id`; marks them in `taken`.
fn copy_part<'py>(
    part: &[(usize, Bound<'py, PyUntypedArray>)],
    raw: &Bound<'py, PyArray1<u8>>,
    item: usize,
    out: &Bound<'py, PyDict>,
    taken: &mut [bool],
) -> PyResult<()> {
    let mut dest = raw.try_readwrite()?;
    let dst = dest.as_slice_mut()?;
    if dst.len() < part.len().saturating_mul(item) {
        return Err(format_err(
            "copy_arrays was given too little memory for a chunk",
        ));
    }
    let start = dst.as_mut_ptr();
    let mut sources = Vec::with_capacity(part.len());
    let mut copied = Vec::with_capacity(part.len());
    for (i, (j, arr)) in part.iter().enumerate() {
        if let Some(address) = array_bytes(arr, item) {
            // SAFETY: `address` is the first of the `item` bytes of the live, C-contiguous
            // array `arr` (read just now), and no Python code runs until `copy_into` below
            // has read them: `part` holds the array and the GIL is held. `dst` is memory of
            // its own (a NumPy array borrowed read-write), never a leaf's.
            let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, item) };
            sources.push((bytes, i * item));
            copied.push((i, *j, arr));
        }
    }
    copy_into(dst, &sources).py_err()?;
    drop(dest);
    for (i, j, arr) in copied {
        // `start + i * item` and the `item` bytes after it lie inside `raw` (checked above).
        if let Some(made) = row(arr, start.wrapping_add(i * item), item, raw)? {
            out.set_item(arr.as_ptr() as usize, made)?;
            taken[j] = true;
        }
    }
    Ok(())
}

/// Copies in bulk the NumPy leaves of `[(path, leaf)]` (`leaves`) that are exactly
/// `numpy.ndarray`, C-contiguous, of a plain dtype of the machine's byte order (booleans,
/// integers, floats, complex numbers) and at least one dimension, and whose bytes are a
/// whole multiple of `align` and at most `max_bytes`, in groups of at least two of one
/// dtype and shape: each group chunk by chunk (at most `chunk_bytes`, at least one leaf),
/// each chunk into the memory `raw(nbytes)` gives (a NumPy `uint8` array, or None when there
/// is none left: the rest of the leaves are not copied), where `raw = blocks(need)` and
/// `need` is the bytes of all the groups. Puts the copy of each such leaf in `out` under
/// its `id`: a new C-contiguous, writeable array of the leaf's dtype and shape, whose base
/// is its chunk's memory. Returns the other items of `leaves`, in order.
#[pyfunction]
pub fn copy_arrays<'py>(
    leaves: &Bound<'py, PyList>,
    out: &Bound<'py, PyDict>,
    blocks: &Bound<'py, PyAny>,
    align: usize,
    max_bytes: usize,
    chunk_bytes: usize,
) -> PyResult<Bound<'py, PyList>> {
    let py = leaves.py();
    let mut groups: Vec<Group<'py>> = Vec::new();
    let mut index: HashMap<(c_int, Vec<npy_intp>), usize> = HashMap::new();
    let mut last = usize::MAX;
    for (j, pair) in leaves.iter().enumerate() {
        let leaf = pair.cast::<PyTuple>()?.get_item(1)?;
        if !is_exact_ndarray(&leaf)? {
            continue;
        }
        // SAFETY: checked just above that `leaf` is exactly a numpy.ndarray.
        let arr = unsafe { leaf.cast_into_unchecked::<PyUntypedArray>() };
        let descr = arr.dtype();
        let num = descr.num();
        let (fields, dims) = array_fields(&arr);
        let item = dims.iter().fold(descr.itemsize(), |n, &d| n * d as usize);
        let bulk = PLAIN.iter().any(|&t| t as c_int == num)
            && descr.is_native_byteorder() != Some(false)
            && fields.flags & NPY_ARRAY_C_CONTIGUOUS != 0
            && !dims.is_empty()
            && (1..=max_bytes).contains(&item)
            && item % align.max(1) == 0;
        if !bulk {
            continue;
        }
        let found = match groups.get(last) {
            Some(g) if g.num == num && g.shape == dims => Some(last),
            _ => index.get(&(num, dims.to_vec())).copied(),
        };
        last = match found {
            Some(at) => at,
            None => {
                let shape = dims.to_vec();
                index.insert((num, shape.clone()), groups.len());
                let members = Vec::new();
                groups.push(Group {
                    num,
                    shape,
                    item,
                    members,
                });
                groups.len() - 1
            }
        };
        groups[last].members.push((j, arr));
    }
    groups.retain(|g| g.members.len() >= 2);
    let mut taken = vec![false; leaves.len()];
    if !groups.is_empty() {
        let need: usize = groups.iter().map(|g| g.item * g.members.len()).sum();
        let raw = blocks.call1((need,))?;
        'groups: for g in &groups {
            for part in g.members.chunks((chunk_bytes / g.item).max(1)) {
                let memory = raw.call1((g.item * part.len(),))?;
                if memory.is_none() {
                    break 'groups;
                }
                copy_part(
                    part,
                    memory.cast::<PyArray1<u8>>()?,
                    g.item,
                    out,
                    &mut taken,
                )?;
            }
        }
    }
    let rest = PyList::empty(py);
    for (pair, done) in leaves.iter().zip(taken) {
        if !done {
            rest.append(pair)?;
        }
    }
    Ok(rest)
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

/// Copies each leaf of `leaves` (PyTorch tensors of one dtype and shape,
/// `item` bytes each, more than 0) into row `i` of `dest` (a writable NumPy `uint8` array
/// of at least `len(leaves) * item` bytes, else an error before any copy), the GIL held,
/// each as soon as its address is read; with `conj`, complex tensors'
/// conjugate bit is checked too. Returns, for each leaf, True when its row holds its
/// values in C order, its strides (a tuple) when the row holds its bytes as they lie (a
/// dense PyTorch tensor in another order: a transposed or channels-last one), and False
/// when it was not copied (a GPU tensor, an overlapping or negative view, anything but a
/// PyTorch tensor, …): its row is left as it was.
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
        copied.push(match tensor_bytes(&leaf, item, conj)? {
            None => PyBool::new(py, false).to_owned().into_any(),
            Some(Source { address, strides }) => {
                // SAFETY: `address` is the lowest of `item` bytes of host memory that hold
                // the live leaf's values, read just now (a dense PyTorch CPU tensor of
                // `item` bytes), and no Python code has run
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
