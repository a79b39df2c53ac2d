//! Byte runs of one file: read past the page cache, for the part of a checkpoint one rank
//! of a process group reads (`tensorferry._fanout` with `direct=True`), or through it
//! straight into the caller's buffers from a [`PyRunFile`] (`tensorferry._dcp_io`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use pyo3::prelude::*;
use tensorferry::internal::io::{read_run_file_header, Run, RunFile};
use tensorferry::{DType, Storage, Tensor};

use crate::errors::{guard, IntoPy};
use crate::tensor::PyTensor;
use crate::{entries_of, IndexEntry};

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

/// A regular file open for reads of its byte runs into Python buffers
/// (`tensorferry._dcp_io.open_read`): `tensorferry::internal::io::RunFile`, kept open from
/// a rank file's header to its last run so that every read finds the same file.
#[pyclass(name = "RunFile", module = "tensorferry._native", frozen)]
pub struct PyRunFile {
    /// The open file; `None` once closed.
    file: RwLock<Option<RunFile>>,
}

#[pymethods]
impl PyRunFile {
    /// Opens the regular file at `path`; anything else (a folder, a FIFO, a file of
    /// `/proc`) is refused before a read could block, as an `OSError` naming the path.
    #[new]
    fn open(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        guard(|| {
            let file = py.detach(|| RunFile::open(&path)).py_err()?;
            Ok(PyRunFile {
                file: RwLock::new(Some(file)),
            })
        })
    }

    /// The file's size in bytes when it was opened.
    #[getter]
    fn size(&self) -> PyResult<u64> {
        self.with_file(|f| Ok(f.len()))
    }

    /// `(st_dev, st_ino)` of the open file (what `os.stat` gives), or `None` on a
    /// platform without them.
    #[getter]
    fn identity(&self) -> PyResult<Option<(u64, u64)>> {
        self.with_file(|f| {
            #[cfg(unix)]
            {
                use std::os::unix::fs::MetadataExt;
                Ok(Some((f.metadata().dev(), f.metadata().ino())))
            }
            #[cfg(not(unix))]
            {
                let _ = f;
                Ok(None)
            }
        })
    }

    /// Fills each span `(file offset, address, bytes)` with the file's bytes from that
    /// offset, up to `threads` reads at once, the GIL released. A span past the file's
    /// end (or a file cut meanwhile) is a `FormatError` naming the file.
    ///
    /// Private to the package: `tensorferry._dcp_io` passes the addresses of writable
    /// buffers it keeps exported for the call (see `spans_as_slices`).
    fn read_into(
        &self,
        py: Python<'_>,
        spans: Vec<(u64, usize, usize)>,
        threads: usize,
    ) -> PyResult<()> {
        guard(|| {
            // SAFETY: the caller keeps each span's buffer exported (neither freed nor
            // resized) until this call returns.
            let mut targets = unsafe { spans_as_slices(&spans) }?;
            self.with_file(|f| py.detach(|| f.read_into(&mut targets, threads)).py_err())
        })
    }

    /// `(data_start, entries, metadata)` of the file's safetensors header, read from this
    /// open file and validated as `load` validates it (a malformed or truncated file is a
    /// `FormatError` naming it): the data section's offset, each tensor's `(name, dtype
    /// code, shape, begin, end)` in header order (offsets absolute in the file), and the
    /// header's `__metadata__`.
    #[allow(clippy::type_complexity)]
    fn read_header(
        &self,
        py: Python<'_>,
    ) -> PyResult<(u64, Vec<IndexEntry>, BTreeMap<String, String>)> {
        guard(|| {
            let mut header = self.with_file(|f| py.detach(|| read_run_file_header(f)).py_err())?;
            let metadata = std::mem::take(&mut header.metadata);
            Ok((header.data_start, entries_of(header), metadata))
        })
    }

    /// Closes the file (reads after this are refused); closing twice is harmless.
    fn close(&self) {
        *self.file.write().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl PyRunFile {
    /// `f` of the open file, or an error once it is closed.
    fn with_file<T>(&self, f: impl FnOnce(&RunFile) -> PyResult<T>) -> PyResult<T> {
        match &*self.file.read().unwrap_or_else(|p| p.into_inner()) {
            Some(file) => f(file),
            None => Err(crate::errors::runtime_err("read of a closed RunFile")),
        }
    }
}

/// `(offset, bytes)` for each span `(offset, address, len)` of a Python buffer, spans of
/// no bytes left out; a null address or spans that overlap are refused.
///
/// # Safety
/// Each span must be the writable memory of a Python buffer of `len` bytes that the caller
/// keeps exported — neither freed nor resized — for as long as the slices are used
/// (Python buffers hold initialised bytes).
pub unsafe fn spans_as_slices<'a>(
    spans: &[(u64, usize, usize)],
) -> PyResult<Vec<(u64, &'a mut [u8])>> {
    let mut by_address: Vec<(usize, usize)> = spans
        .iter()
        .filter(|s| s.2 > 0)
        .map(|s| (s.1, s.1.saturating_add(s.2)))
        .collect();
    by_address.sort_unstable();
    if by_address.iter().any(|s| s.0 == 0) || by_address.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(crate::errors::buffer_err(
            "a read into Python buffers was given a null address or spans that overlap",
        ));
    }
    Ok(spans
        .iter()
        .filter(|s| s.2 > 0)
        // SAFETY: the caller's contract; no two spans overlap (checked above), so the
        // slices are disjoint.
        .map(|&(o, address, len)| {
            (o, unsafe {
                std::slice::from_raw_parts_mut(address as *mut u8, len)
            })
        })
        .collect())
}
