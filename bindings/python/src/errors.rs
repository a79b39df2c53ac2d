//! Mapping tensorferry errors to the Python exception classes of `tensorferry._errors`,
//! one class per kind, defined once in Python so that they can inherit from both
//! `TensorferryError` and the built-in they refine (`ValueError`, `MemoryError`, …).

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use tensorferry::Error;

macro_rules! exception_class {
    ($fn:ident, $name:literal) => {
        fn $fn(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
            static CLASS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
            CLASS.import(py, "tensorferry._errors", $name)
        }
    };
}

exception_class!(base_error, "TensorferryError");
exception_class!(format_error, "FormatError");
exception_class!(device_error, "DeviceUnavailableError");
exception_class!(oom_error, "OutOfMemoryError");
exception_class!(invalid_device_error, "InvalidDeviceError");
exception_class!(key_error, "TensorferryKeyError");
exception_class!(io_error, "TensorferryIOError");

/// Converts a library error into the matching Python exception.
pub fn to_py(err: Error) -> PyErr {
    Python::attach(|py| {
        let message = err.to_string();
        let class = match &err {
            Error::Format { .. }
            | Error::InvalidValue { .. }
            | Error::UnsupportedDType { .. }
            | Error::NameCollision { .. }
            | Error::Layout { .. } => format_error(py),
            Error::DeviceUnavailable { .. } => device_error(py),
            Error::OutOfMemory { .. } => oom_error(py),
            Error::InvalidDevice { .. } => invalid_device_error(py),
            Error::KeyNotFound { .. } => key_error(py),
            Error::Io { source, path, .. } => {
                let errno = source.raw_os_error().unwrap_or(0);
                return match io_error(py) {
                    Ok(cls) => PyErr::from_type(
                        cls.clone(),
                        (errno, message, path.to_string_lossy().into_owned()),
                    ),
                    Err(e) => e,
                };
            }
            _ => base_error(py),
        };
        match class {
            Ok(cls) => PyErr::from_type(cls.clone(), message),
            Err(e) => e,
        }
    })
}

/// A `FormatError` with a message (bad data found on the Python side).
pub fn format_err(message: String) -> PyErr {
    to_py(Error::InvalidValue {
        key: String::new(),
        reason: message,
    })
}

/// Result alias for library calls.
pub trait IntoPy<T> {
    /// Converts the error side into a Python exception.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for tensorferry::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// Runs `f`, turning a Rust panic into a `TensorferryError` instead of letting it reach
/// Python as `PanicException`.
pub fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Python::attach(|py| match base_error(py) {
                Ok(cls) => Err(PyErr::from_type(
                    cls.clone(),
                    format!("internal error in tensorferry (please report): {what}"),
                )),
                Err(e) => Err(e),
            })
        }
    }
}
