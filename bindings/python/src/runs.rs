//! Host tensors that lie evenly spaced in one storage, with one dtype and shape, grouped into
//! runs: a framework takes a whole run as one strided view of a single capsule (PyTorch:
//! `as_strided(...).unbind(0)`, one call for the run) instead of one DLPack capsule per
//! tensor, which costs PyTorch over a microsecond each.
//!
//! Each run's capsule covers only the run's bytes, and runs stop at [`RUN_BYTES`]: a
//! result kept (or pickled, which writes a tensor's whole storage) holds at most that much
//! beside its own bytes.

use std::sync::Arc;

use pyo3::prelude::*;
use tensorferry::{DType, Device, Tensor};

use crate::errors::{guard, IntoPy};
use crate::tensor::PyTensor;
use crate::wait;

/// The most bytes one run's capsule covers.
pub const RUN_BYTES: usize = 1 << 20;

/// One run: the bytes it spans (a uint8 tensor), the dtype's name, the shape of each
/// tensor, the bytes from one tensor to the next, and the indices of its tensors.
type Run = (PyTensor, &'static str, Vec<usize>, usize, Vec<usize>);

/// `(runs, rest)`: the runs of two or more of `tensors` (after their pending copies), and
/// the indices of the tensors in no run (on a device, read-only, empty, not contiguous, or
/// alone), which take the ordinary path.
///
/// With `promised`, the copies are not waited for (no byte is read here): the caller
/// exports the runs with `to_dlpack_capsules(…, promised=True)`, whose contract it keeps.
#[pyfunction]
#[pyo3(signature = (tensors, promised=false))]
pub fn host_runs(
    py: Python<'_>,
    tensors: Vec<Py<PyTensor>>,
    promised: bool,
) -> PyResult<(Vec<Run>, Vec<usize>)> {
    guard(|| {
        let inner: Vec<&Tensor> = tensors.iter().map(|t| &t.get().inner).collect();
        if !promised {
            wait::wait_all(py, inner.iter().copied())?;
        }
        let mut rest = Vec::new();
        // (storage address, byte offset, index) of every candidate, sorted into storage order.
        let mut placed: Vec<(usize, usize, usize)> = Vec::new();
        for (i, t) in inner.iter().enumerate() {
            if t.device() != Device::Cpu
                || t.is_read_only()
                || t.numel() == 0
                || !t.is_contiguous()
                || t.offset() % t.dtype().size() != 0
            {
                rest.push(i);
            } else {
                placed.push((Arc::as_ptr(t.storage()) as usize, t.offset(), i));
            }
        }
        placed.sort_unstable();
        let mut runs = Vec::new();
        let mut j = 0;
        while j < placed.len() {
            let (_, first, i) = placed[j];
            let t = inner[i];
            let len = run_length(&placed[j..], &inner);
            let at: Vec<usize> = placed[j..j + len].iter().map(|p| p.2).collect();
            j += len;
            if len == 1 {
                rest.push(i);
                continue;
            }
            let spacing = placed[j - len + 1].1 - first;
            let span = spacing * (len - 1) + t.nbytes();
            let region = Tensor::from_storage(
                Arc::clone(t.storage()),
                first,
                DType::U8,
                vec![span],
                vec![1],
            )
            .py_err()?;
            runs.push((
                PyTensor::new(region),
                t.dtype().name(),
                t.shape().to_vec(),
                spacing,
                at,
            ));
        }
        rest.sort_unstable();
        Ok((runs, rest))
    })
}

/// How many of `placed` (sorted, starting at a run's first tensor) form one run: the same
/// storage, dtype and shape, a constant spacing of at least one tensor's bytes (a multiple
/// of its element size), within [`RUN_BYTES`].
fn run_length(placed: &[(usize, usize, usize)], tensors: &[&Tensor]) -> usize {
    let (storage, _, at) = placed[0];
    let first = tensors[at];
    let nbytes = first.nbytes();
    let mut spacing = None;
    let mut len = 1;
    while len < placed.len() {
        let (s, offset, i) = placed[len];
        let t = tensors[i];
        if s != storage {
            break;
        }
        // Sorted by (storage, offset): within one storage the offsets only grow.
        let gap = offset - placed[len - 1].1;
        let fits = t.dtype() == first.dtype()
            && t.shape() == first.shape()
            && gap >= nbytes
            && gap % first.dtype().size() == 0
            && spacing.is_none_or(|s| s == gap)
            && gap.saturating_mul(len).saturating_add(nbytes) <= RUN_BYTES.max(nbytes);
        if !fits {
            break;
        }
        spacing = Some(gap);
        len += 1;
    }
    len
}
