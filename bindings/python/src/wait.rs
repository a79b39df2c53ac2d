//! Waiting for copies from Python: in short slices with the GIL released, checking for
//! signals between them, so that Ctrl-C interrupts any wait and reaches the user as
//! `KeyboardInterrupt` (the copies themselves go on in the background, holding what they
//! read and write until they finish).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tensorferry::internal::backend::StreamHandle;
use tensorferry::internal::transfer::Readable;
use tensorferry::Tensor;

use crate::errors::IntoPy;

/// How long one slice of a wait lasts before signals are checked.
const SLICE: Duration = Duration::from_millis(50);

/// Waits until every copy into `tensors` has finished; the first failure as its error (a
/// `CopyError` carries the position of the tensor in `tensors` as `index`, so that a caller
/// that knows their key paths can name one); an interruption (a signal handler that
/// raises) as that exception.
pub fn wait_all<'a>(py: Python<'_>, tensors: impl IntoIterator<Item = &'a Tensor>) -> PyResult<()> {
    wait_until(py, tensors, None).map(|_| ())
}

/// Like [`wait_all`], giving up at `deadline` if there is one: `Ok(false)` when some copy
/// is still running then (nothing is cancelled).
pub fn wait_until<'a>(
    py: Python<'_>,
    tensors: impl IntoIterator<Item = &'a Tensor>,
    deadline: Option<Instant>,
) -> PyResult<bool> {
    for (index, t) in tensors.into_iter().enumerate() {
        loop {
            let left = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()));
            // A failed copy is ready too: `wait_timeout` reports its error either way.
            let ready = py
                .detach(|| t.wait_timeout(left.min(SLICE)))
                .py_err()
                .map_err(|e| crate::errors::at_index(py, e, index))?;
            if ready {
                break;
            }
            if deadline.is_some() && left <= SLICE {
                return Ok(false);
            }
            py.check_signals()?;
        }
    }
    Ok(true)
}

/// `tensor`, readable by the consumer whose CUDA stream is `stream`: that stream made to
/// wait on the GPU for the copy filling it (no host wait); a copy not on a GPU yet is
/// waited for here, in slices, until it is.
pub fn ordered<'a>(
    py: Python<'_>,
    tensor: &'a Tensor,
    stream: StreamHandle,
) -> PyResult<Readable<'a>> {
    loop {
        if let Some(ready) = Readable::ordered(tensor, stream).py_err()? {
            return Ok(ready);
        }
        // Not on a GPU yet (a staging thread is still queuing it): wait until it is, or
        // done, and ask again.
        if !py.detach(|| tensorferry::internal::transfer::wait_queued_timeout(tensor, SLICE)) {
            py.check_signals()?;
        }
    }
}

/// `tensor`, readable by any consumer: the copy filling it waited for in slices (see
/// [`wait_all`]).
pub fn readable<'a>(py: Python<'_>, tensor: &'a Tensor) -> PyResult<Readable<'a>> {
    wait_all(py, [tensor])?;
    Readable::wait(tensor).py_err()
}

/// Moves `tensors` to `target` and waits for the copies in slices (see [`wait_all`]): a
/// blocking move that Ctrl-C can interrupt. With `non_blocking` it returns at once.
pub fn move_tensors(
    py: Python<'_>,
    tensors: &[&Tensor],
    target: tensorferry::Device,
    mut options: tensorferry::MoveOptions,
) -> PyResult<Vec<Tensor>> {
    let blocking = !options.non_blocking;
    options.non_blocking = true;
    options.waits_at_once = blocking;
    let moved = py
        .detach(|| tensorferry::move_tensors(tensors, target, options))
        .py_err()?;
    if blocking {
        wait_all(py, &moved)?;
    }
    Ok(moved)
}

/// Runs `work` on a new thread named `name` and waits for it in slices (see [`wait_all`]),
/// handing it a flag that is set when the wait is interrupted: `work` checks it between
/// steps and gives up. The interruption reaches the caller at once; the thread ends on its
/// own after its current step, releasing what it holds. A panic in `work` is an internal
/// error, not a crash.
pub fn run_interruptibly<T: Send + 'static>(
    py: Python<'_>,
    name: &str,
    work: impl FnOnce(&AtomicBool) -> T + Send + 'static,
) -> PyResult<T> {
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::sync_channel(1);
    let flag = stop.clone();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            // The receiver may have gone (interrupted): then the result is dropped here.
            let _ = tx.send(work(&flag));
        })
        .map_err(|e| crate::errors::runtime_err(format!("cannot start a {name} thread: {e}")))?;
    let mut rx = rx;
    loop {
        // The receiver goes with the detached closure and comes back (it is `Send`, not
        // `Sync`).
        let (received, back) = py.detach(move || (rx.recv_timeout(SLICE), rx));
        rx = back;
        match received {
            Ok(value) => return Ok(value),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Err(interrupted) = py.check_signals() {
                    stop.store(true, Ordering::Relaxed);
                    return Err(interrupted);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(crate::errors::runtime_err(format!(
                    "internal error in tensorferry (please report): the {name} thread stopped"
                )))
            }
        }
    }
}

/// The bytes of a load from object storage still arriving into the memory of the tensors
/// it handed over (`_native.load(…, early=True)`): nothing of them may be read, or handed
/// out, before `wait()` returns.
#[pyclass(name = "Arrival", module = "tensorferry._native", frozen)]
pub struct PyArrival(pub tensorferry::internal::io::object::Arrival);

#[pymethods]
impl PyArrival {
    /// Waits until every byte is in, in slices: Ctrl-C stops the GETs, waits until
    /// nothing writes the memory any more, and raises `KeyboardInterrupt`. The load's
    /// error when the GETs failed.
    pub fn wait(&self, py: Python<'_>) -> PyResult<()> {
        while !py.detach(|| self.0.wait_timeout(SLICE)) {
            if let Err(interrupted) = py.check_signals() {
                py.detach(|| self.0.cancel());
                return Err(interrupted);
            }
        }
        py.detach(|| self.0.wait()).py_err()
    }

    /// Stops the GETs still in flight and waits until nothing writes the memory any more.
    fn cancel(&self, py: Python<'_>) {
        py.detach(|| self.0.cancel())
    }
}
