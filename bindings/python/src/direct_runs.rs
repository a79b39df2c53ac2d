//! Byte runs of one file read past the page cache, for the part of a checkpoint one rank
//! of a process group reads (`tensorferry._fanout` with `direct=True`).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use tensorferry::internal::io::Run;
use tensorferry::{DType, Storage, Tensor};

use crate::errors::{guard, IntoPy};
use crate::tensor::PyTensor;

/// `(buffers, bytes_read, fallback)`: runs `(file offset, bytes, destination, offset in
/// it)` of the file at `path` read with `O_DIRECT` (`tensorferry::internal::io::read_runs`) into
/// fresh uint8 tensors of `sizes` bytes; the bytes read from the file (whole blocks); why
/// the reads went through the page cache, if they did.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn read_runs(
    py: Python<'_>,
    path: PathBuf,
    sizes: Vec<usize>,
    runs: Vec<(u64, usize, usize, usize)>,
) -> PyResult<(Vec<PyTensor>, u64, Option<String>)> {
    guard(|| {
        let runs: Vec<Run> = runs
            .into_iter()
            .map(|(at, len, dest, to)| Run { at, len, dest, to })
            .collect();
        let read = py
            .detach(|| tensorferry::internal::io::read_runs(&path, &sizes, &runs))
            .py_err()?;
        let tensors = read
            .buffers
            .into_iter()
            .map(|b| {
                let n = b.len();
                Tensor::contiguous_view(Arc::new(Storage::owned(b)), 0, DType::U8, vec![n])
                    .map(PyTensor::new)
            })
            .collect::<tensorferry::Result<Vec<_>>>()
            .py_err()?;
        Ok((tensors, read.bytes_read, read.fallback))
    })
}
