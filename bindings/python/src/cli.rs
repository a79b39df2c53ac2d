//! The `tensorferry` command inside the Python package: the console script
//! (`tensorferry._cli:main`) runs [`tensorferry_cli::run`], the very code of the binary,
//! and draws `convert`'s progress with the command's own bars.

use std::ffi::OsString;

use pyo3::prelude::*;
use tensorferry_cli::progress::{self, ProgressBar};

/// Runs the command line `argv` (the program's name first, as `sys.argv`) with the GIL
/// released and returns its exit status (0, 1 or 2), as the binary would end: output
/// goes to the process's stdout and stderr (file descriptors 1 and 2), a closed pipe ends
/// it quietly with 0, any other failure is one `tensorferry: …` line on stderr and 1.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<OsString>) -> u8 {
    py.detach(|| tensorferry_cli::run(argv))
}

/// `n` bytes in decimal units, as `tensorferry inspect` prints them: `497.8 MB`.
#[pyfunction]
fn human_bytes(n: u64) -> String {
    tensorferry_cli::human(n)
}

/// A progress bar of the command's style on stderr, drawn only when stderr is a
/// terminal: `kind` "bytes" (a total of bytes, with rate and time left) or "steps".
#[pyclass(name = "CliProgress", frozen, module = "tensorferry._native")]
struct CliProgress(ProgressBar);

#[pymethods]
impl CliProgress {
    #[new]
    #[pyo3(signature = (total, kind = "bytes"))]
    fn new(total: u64, kind: &str) -> PyResult<Self> {
        match kind {
            "bytes" => Ok(CliProgress(progress::bytes(total))),
            "steps" => Ok(CliProgress(progress::steps(total))),
            _ => Err(crate::errors::format_err(format!(
                "kind={kind:?}: \"bytes\" or \"steps\""
            ))),
        }
    }

    /// Sets how much there is to do.
    fn set_length(&self, total: u64) {
        self.0.set_length(total);
    }

    /// Sets how much is done.
    fn set_position(&self, done: u64) {
        self.0.set_position(done);
    }

    /// Sets what is being done.
    fn set_message(&self, message: String) {
        self.0.set_message(message);
    }

    /// Removes the bar from the terminal.
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// Adds the command's functions to the native module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(human_bytes, m)?)?;
    m.add_class::<CliProgress>()
}
