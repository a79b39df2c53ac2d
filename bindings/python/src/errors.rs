//! Mapping tensorferry errors to the Python exception classes of `tensorferry._errors`,
//! one class per kind, defined once in Python so that they can inherit from both
//! `TensorferryError` and the built-in they refine (`ValueError`, `MemoryError`, …).

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use tensorferry::internal::io::object;
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
exception_class!(overflow_error, "TensorferryOverflowError");
exception_class!(type_error, "TensorferryTypeError");
exception_class!(runtime_error, "TensorferryRuntimeError");
exception_class!(buffer_error, "TensorferryBufferError");
exception_class!(copy_error, "CopyError");

/// An exception of `class` (looked up once) with `message`; if the class cannot be
/// imported, that import error.
fn raised(
    class: for<'py> fn(Python<'py>) -> PyResult<&'py Bound<'py, PyType>>,
    message: String,
) -> PyErr {
    Python::attach(|py| match class(py) {
        Ok(cls) => PyErr::from_type(cls.clone(), message),
        Err(e) => e,
    })
}

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
            Error::Copy { device, reason } => {
                return copy_error(py)
                    .and_then(|cls| cls.call1((device, reason)))
                    .map_or_else(|e| e, PyErr::from_value);
            }
            Error::Io { op, source, path } => {
                return io_err(py, op, source, path).unwrap_or_else(|e| e);
            }
            _ => base_error(py),
        };
        let raised = match class {
            Ok(cls) => PyErr::from_type(cls.clone(), message),
            Err(e) => return e,
        };
        // The key path the error is about, as an attribute (`None` where there is none).
        match raised.value(py).setattr("key", err.key()) {
            Ok(()) => raised,
            Err(e) => e,
        }
    })
}

/// The `OSError` subclass Python picks for the errno (`FileNotFoundError`, …), made a
/// `TensorferryIOError` too by `tensorferry._errors.io_error`, with `errno` (an int, or
/// `None` for a failure the OS did not number: a FIFO refused, a NUL in a name, a short
/// read), `strerror` (what was done and what went wrong) and `filename` (the path).
fn io_err(
    py: Python<'_>,
    op: &str,
    source: &std::io::Error,
    path: &std::path::Path,
) -> PyResult<PyErr> {
    static MAKE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let make = MAKE.import(py, "tensorferry._errors", "io_error")?;
    // Object-storage failures name the errno of their cause (a missing object is
    // `FileNotFoundError`, access refused `PermissionError`, …).
    let object = source
        .get_ref()
        .and_then(|e| e.downcast_ref::<object::ObjectFailure>());
    let errno = source
        .raw_os_error()
        .or(object.and_then(|f| f.cause.errno()));
    let text = source.to_string();
    let text = match errno {
        // Python shows the number itself: "[Errno 2] open: No such file or directory".
        Some(n) => text
            .strip_suffix(&format!(" (os error {n})"))
            .unwrap_or(&text),
        None => &text,
    };
    let exc = make.call1((errno, format!("{op}: {text}"), path.as_os_str()))?;
    Ok(PyErr::from_value(exc))
}

/// A `TensorferryOverflowError` (also an `OverflowError`) with a message.
pub fn overflow_err(message: impl Into<String>) -> PyErr {
    raised(overflow_error, message.into())
}

/// A `FormatError` (also a `ValueError`) with a message: bad data or a bad argument
/// value found on the Python side.
pub fn format_err(message: impl Into<String>) -> PyErr {
    raised(format_error, message.into())
}

/// A `TensorferryTypeError` (also a `TypeError`) with a message: an argument of the
/// wrong type.
pub fn type_err(message: impl Into<String>) -> PyErr {
    raised(type_error, message.into())
}

/// A `TensorferryRuntimeError` (also a `RuntimeError`) with a message: a failure of the
/// run, not of its inputs (a thread that would not start, a structure changed meanwhile).
pub fn runtime_err(message: impl Into<String>) -> PyErr {
    raised(runtime_error, message.into())
}

/// A `TensorferryBufferError` (also a `BufferError`) with a message: memory that cannot
/// be lent or read as asked.
pub fn buffer_err(message: impl Into<String>) -> PyErr {
    raised(buffer_error, message.into())
}

/// `err` with `index` set on it when it is a `CopyError`: the position, among the tensors
/// a caller waited for, of the one whose copy failed (see `tensorferry._errors.naming_key`).
pub fn at_index(py: Python<'_>, err: PyErr, index: usize) -> PyErr {
    if let Ok(cls) = copy_error(py) {
        if err.is_instance(py, cls) {
            // Setting an attribute on an exception instance does not fail.
            let _ = err.value(py).setattr("index", index);
        }
    }
    err
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
            Err(runtime_err(format!(
                "internal error in tensorferry (please report): {what}"
            )))
        }
    }
}

/// A key path for messages, "a/b/0", shortened in the middle when very deep; "<root>" for
/// the root.
pub fn shown_path(path: &[Bound<'_, PyAny>]) -> String {
    let part = |p: &Bound<'_, PyAny>| p.str().map(|s| s.to_string()).unwrap_or_default();
    if path.is_empty() {
        return "<root>".into();
    }
    if path.len() <= 12 {
        return path.iter().map(part).collect::<Vec<_>>().join("/");
    }
    let head: Vec<String> = path[..5].iter().map(part).collect();
    let tail: Vec<String> = path[path.len() - 5..].iter().map(part).collect();
    format!(
        "{}/…({} more)…/{}",
        head.join("/"),
        path.len() - 10,
        tail.join("/")
    )
}
