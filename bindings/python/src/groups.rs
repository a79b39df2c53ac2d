//! Host copies of many small PyTorch tensors and NumPy arrays in bulk, by the core's packing
//! (`tensorferry::internal::consolidate::pack`): `tensorferry._host_copy` hands over a
//! whole list of leaves in one call, and gets back, for each group of leaves of one dtype,
//! shape and layout, their copies as the rows of one tensor, which a framework splits with
//! one call (`unbind(0)`). A crossing into native and
//! back per leaf (two DLPack capsules and two native tensors each) costs three times
//! PyTorch's own `{k: v.clone()}` loop; this costs one DLPack export a leaf.
//!
//! Copies share no memory with their sources. A run covers at most [`RUN_BYTES`] (what
//! `torch.save` of one row writes, as for every run tensorferry hands to PyTorch), and the
//! runs of one call are packed into buffers of at most [`BLOCK_BYTES`] (one result kept
//! alive keeps its buffer alive, as a consolidated dictionary's results keep theirs; a
//! buffer of that size is a few huge pages, not a page fault per 4 KiB).

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::exceptions::PyException;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple, PyType};
use tensorferry::internal::consolidate::pack;
use tensorferry::internal::memory::HOST_ALIGNMENT;
use tensorferry::{DType, Device, Tensor};

use crate::errors::{guard, IntoPy};
use crate::runs::RUN_BYTES;
use crate::tensor::PyTensor;
use crate::{dlpack, numpy_interop};

/// Leaves up to this many bytes are copied in bulk; larger ones go through the engine's
/// ordinary path, where their bytes, not the crossing, set the time.
pub const SMALL_BYTES: usize = 64 << 10;

/// The most bytes one buffer of a call's copies holds.
pub const BLOCK_BYTES: usize = 4 << 20;

/// One run of copies: a tensor whose rows are the copies (rows of the leaves' dtype, shape
/// and strides, 64-byte aligned), the indices of its leaves, and the bytes of the buffer it
/// lives in.
type Rows = (PyTensor, Vec<usize>, usize);

/// Copies of the small host leaves of `leaves` whose exact type is one of `types`, in runs
/// of two or more that share a dtype, a shape and strides (see the module's doc); the
/// other leaves (of other types, larger, on a device, alone, or that cannot be exported)
/// are in no run and left to the caller's ordinary path.
///
/// With `export` (PyTorch's `to_dlpack`), each leaf is read through its DLPack capsule, and
/// only dense layouts are taken, which the copies keep (channels-last stays channels-last,
/// as `clone` keeps it); leaves with their negation or conjugation unresolved are left out.
/// Without it, leaves are NumPy arrays, read as `from_numpy` reads them, and every copy is
/// C-contiguous.
///
/// With `row_align`, only leaves whose bytes are a multiple of it are taken (rows that
/// keep that alignment once a run is moved as one contiguous tensor).
#[pyfunction]
#[pyo3(signature = (leaves, types, export=None, row_align=1))]
pub fn copy_small(
    py: Python<'_>,
    leaves: &Bound<'_, PyList>,
    types: &Bound<'_, PyTuple>,
    export: Option<&Bound<'_, PyAny>>,
    row_align: usize,
) -> PyResult<Vec<Rows>> {
    guard(|| {
        let types: Vec<Bound<'_, PyType>> = types
            .iter()
            .map(|t| t.cast_into::<PyType>().map_err(PyErr::from))
            .collect::<PyResult<_>>()?;
        let mut taken: Vec<(usize, Tensor)> = Vec::new();
        for (i, leaf) in leaves.iter().enumerate() {
            let ty = leaf.get_type();
            if !types.iter().any(|t| t.is(&ty)) {
                continue;
            }
            let tensor = match export {
                Some(export) => exported(&leaf, export),
                None => numpy_interop::array_to_tensor(&leaf).map(|t| t.filter(is_c_order)),
            };
            match tensor {
                Ok(Some(t)) if takes(&t) && t.nbytes() % row_align.max(1) == 0 => {
                    taken.push((i, t))
                }
                Ok(_) => {}
                // Only an ordinary exception leaves the leaf out: KeyboardInterrupt still stops.
                Err(e) if e.is_instance_of::<PyException>(py) => {}
                Err(e) => return Err(e),
            }
        }
        let runs = plan_runs(&taken);
        let copies = py.detach(|| copy_runs(&taken, &runs)).py_err()?;
        copies
            .into_iter()
            .zip(runs)
            .map(|((rows, block), run)| {
                let at = run.iter().map(|&k| taken[k].0).collect();
                Ok((PyTensor::new(rows), at, block))
            })
            .collect()
    })
}

/// The PyTorch tensor `leaf` read through `export(leaf)`'s DLPack capsule; `None` when its
/// negation or (complex numbers only) conjugation is unresolved (DLPack would export the
/// stored values).
fn exported(leaf: &Bound<'_, PyAny>, export: &Bound<'_, PyAny>) -> PyResult<Option<Tensor>> {
    let py = leaf.py();
    if leaf.call_method0(intern!(py, "is_neg"))?.is_truthy()? {
        return Ok(None);
    }
    let t = dlpack::import_capsule(&export.call1((leaf,))?)?;
    let complex = matches!(t.dtype(), DType::Complex64 | DType::Complex128);
    if complex && leaf.call_method0(intern!(py, "is_conj"))?.is_truthy()? {
        return Ok(None);
    }
    Ok(Some(t))
}

/// True when `t` is C-contiguous (NumPy leaves: copies are C-contiguous, and the bulk path
/// only takes the arrays whose bytes are already in that order).
fn is_c_order(t: &Tensor) -> bool {
    t.is_contiguous()
}

/// True for a leaf the bulk path copies: on the host, not empty, at most [`SMALL_BYTES`],
/// and dense (its elements fill its byte span exactly, in some order of its dimensions).
fn takes(t: &Tensor) -> bool {
    t.device() == Device::Cpu && t.numel() > 0 && t.nbytes() <= SMALL_BYTES && is_dense(t)
}

/// True when the elements of `t` fill exactly `numel` slots with no overlap: its strides,
/// sorted, are those of a contiguous tensor of its dimensions in that order (dimensions of
/// one element, whose strides never matter, left out).
fn is_dense(t: &Tensor) -> bool {
    let mut dims: Vec<(isize, usize)> = t
        .shape()
        .iter()
        .zip(t.strides())
        .filter(|(&n, _)| n > 1)
        .map(|(&n, &s)| (s, n))
        .collect();
    dims.sort_unstable();
    let mut expected = 1isize;
    for (stride, n) in dims {
        if stride != expected {
            return false;
        }
        expected = expected.saturating_mul(n as isize);
    }
    true
}

/// The runs: indices into `taken`, two or more leaves each, of one dtype, shape and
/// strides, in the order their groups first appear, each within [`RUN_BYTES`].
fn plan_runs(taken: &[(usize, Tensor)]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut by_key: HashMap<(DType, &[usize], &[isize]), usize> = HashMap::new();
    for (k, (_, t)) in taken.iter().enumerate() {
        let g = *by_key
            .entry((t.dtype(), t.shape(), t.strides()))
            .or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
        groups[g].push(k);
    }
    let mut runs = Vec::new();
    for group in groups.into_iter().filter(|g| g.len() > 1) {
        let spacing = row_spacing(taken[group[0]].1.nbytes());
        let per_run = (RUN_BYTES / spacing).max(1);
        runs.extend(
            group
                .chunks(per_run)
                .filter(|run| run.len() > 1)
                .map(<[usize]>::to_vec),
        );
    }
    runs
}

/// Bytes from one row of a run to the next: a row's bytes, rounded up to the alignment the
/// core's packing gives every tensor.
fn row_spacing(nbytes: usize) -> usize {
    nbytes.next_multiple_of(HOST_ALIGNMENT)
}

/// Copies the leaves of each run into buffers of at most [`BLOCK_BYTES`] (a run never
/// split): for each run, the tensor whose rows are its copies, and its buffer's size.
fn copy_runs(
    taken: &[(usize, Tensor)],
    runs: &[Vec<usize>],
) -> tensorferry::Result<Vec<(Tensor, usize)>> {
    let mut out = Vec::with_capacity(runs.len());
    let mut start = 0;
    while start < runs.len() {
        // The runs of one buffer: at least one, then as many as fit.
        let mut end = start;
        let mut bytes = 0;
        while end < runs.len() {
            let spacing = row_spacing(taken[runs[end][0]].1.nbytes());
            let need = spacing * runs[end].len();
            if end > start && bytes + need > BLOCK_BYTES {
                break;
            }
            bytes += need;
            end += 1;
        }
        let sources: Vec<Tensor> = runs[start..end]
            .iter()
            .flatten()
            .filter(|&&k| !taken[k].1.is_contiguous())
            .map(|&k| byte_span(&taken[k].1))
            .collect::<tensorferry::Result<_>>()?;
        // Contiguous leaves are copied as they are; the others as the bytes they fill.
        let mut spans = sources.iter();
        let refs: Vec<&Tensor> = runs[start..end]
            .iter()
            .flatten()
            .map(|&k| match &taken[k].1 {
                t if t.is_contiguous() => t,
                _ => spans
                    .next()
                    .expect("one span a leaf that is not contiguous"),
            })
            .collect();
        let copies = pack(&refs)?;
        let block = copies.first().map_or(0, |c| c.storage().len());
        let mut at = 0;
        for run in &runs[start..end] {
            let leaf = &taken[run[0]].1;
            let first = &copies[at];
            // The core's packing lays equal sizes out evenly, each 64-byte aligned (a
            // multiple of every element size).
            let spacing = copies[at + 1].offset() - first.offset();
            let shape = [&[run.len()][..], leaf.shape()].concat();
            // A dimension of one element may carry any stride (a negative one, which not
            // every framework takes): its rows get 1 there.
            let strides = std::iter::once((spacing / leaf.dtype().size()) as isize)
                .chain(leaf.shape().iter().zip(leaf.strides()).map(|(&n, &s)| {
                    if n > 1 {
                        s
                    } else {
                        s.max(1)
                    }
                }))
                .collect();
            let rows = Tensor::from_storage(
                Arc::clone(first.storage()),
                first.offset(),
                leaf.dtype(),
                shape,
                strides,
            )?;
            out.push((rows, block));
            at += run.len();
        }
        start = end;
    }
    Ok(out)
}

/// The bytes a dense tensor's elements fill, as a flat uint8 tensor: copied as they lie,
/// they keep its layout.
fn byte_span(t: &Tensor) -> tensorferry::Result<Tensor> {
    let (below, _) =
        tensorferry::internal::tensor::byte_extent(t.shape(), t.strides(), t.dtype().size())
            .unwrap_or((0, 0));
    let first = (t.offset() as isize + below) as usize;
    Tensor::from_storage(
        Arc::clone(t.storage()),
        first,
        DType::U8,
        vec![t.nbytes()],
        vec![1],
    )
}

/// `{key(leaf): [index, …]}` (the stacks of small CUDA tensors that
/// `tensorferry._host_copy.cuda_stacks` has PyTorch make) for the leaves whose exact type is one of `types`, keys in
/// the order they first appear and indices in order; a leaf whose key cannot be read
/// (`key` raises, a nested tensor's shape, say) is left out, as are leaves of other types.
#[pyfunction]
pub fn group_leaves<'py>(
    leaves: &Bound<'py, PyList>,
    types: &Bound<'py, PyTuple>,
    key: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let py = leaves.py();
    let types: Vec<Bound<'py, PyType>> = types
        .iter()
        .map(|t| t.cast_into::<PyType>().map_err(PyErr::from))
        .collect::<PyResult<_>>()?;
    let groups = PyDict::new(py);
    // The last key seen and its list: runs of leaves with one key (the common case) skip
    // the dictionary lookup.
    let mut last: Option<(Bound<'py, PyAny>, Bound<'py, PyList>)> = None;
    for (i, leaf) in leaves.iter().enumerate() {
        let ty = leaf.get_type();
        if !types.iter().any(|t| t.is(&ty)) {
            continue;
        }
        let k = match key.call1((&leaf,)) {
            Ok(k) => k,
            // Only an ordinary exception leaves the leaf out: KeyboardInterrupt still stops.
            Err(e) if e.is_instance_of::<PyException>(py) => continue,
            Err(e) => return Err(e),
        };
        if let Some((lk, list)) = &last {
            if lk.is(&k) || lk.eq(&k)? {
                list.append(i)?;
                continue;
            }
        }
        let list = match groups.get_item(&k)? {
            Some(list) => list.cast_into::<PyList>()?,
            None => {
                let list = PyList::empty(py);
                groups.set_item(&k, &list)?;
                list
            }
        };
        list.append(i)?;
        last = Some((k, list));
    }
    Ok(groups)
}
