//! One error type for the whole library.
//!
//! Every variant carries what a user needs to act on it: the key path, the
//! dtype, the bytes asked and free, the file offset, the device.

use std::path::PathBuf;

/// Everything that can go wrong in tensorferry.
///
/// ```
/// use tensorferry::{Device, Error};
///
/// let err = "gpu:0".parse::<Device>().unwrap_err();
/// assert!(matches!(err, Error::InvalidDevice { ref input, .. } if input == "gpu:0"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A device string that is not one of the accepted forms.
    #[error("invalid device {input:?}: expected one of {accepted}")]
    InvalidDevice {
        /// What was given.
        input: String,
        /// The forms that are accepted, for the message.
        accepted: &'static str,
    },

    /// The device exists as a name but is not usable on this machine.
    #[error("device {device} is unavailable: {reason}")]
    DeviceUnavailable {
        /// The device asked for, e.g. `cuda:0`.
        device: String,
        /// Why it cannot be used (no driver, index out of range, …).
        reason: String,
    },

    /// A queued copy that failed on a device that is there: an injected fault, a driver
    /// error on the copy, a panic on the thread that ran it. Not
    /// [`Error::DeviceUnavailable`]: the device exists and other copies may well succeed.
    #[error("a copy on {device} failed: {reason}")]
    Copy {
        /// The device whose work failed, e.g. `cuda:1` or `emu:0` (never the host a
        /// result was meant for).
        device: String,
        /// What went wrong.
        reason: String,
    },

    /// An allocation failed on a device or on the host.
    #[error(
        "out of memory on {device}: asked for {requested} bytes, {free} free of {total}{}",
        out_of_memory_hint(device)
    )]
    OutOfMemory {
        /// Where the allocation was attempted.
        device: String,
        /// Bytes requested.
        requested: usize,
        /// Bytes free at the time, as far as known (0 when unknown).
        free: usize,
        /// Total bytes of that memory, as far as known (0 when unknown).
        total: usize,
    },

    /// A file or byte buffer that breaks the safetensors format rules.
    #[error("invalid safetensors data at {at}: {reason}")]
    Format {
        /// Where the fault is: a byte offset or a tensor name.
        at: String,
        /// What is wrong.
        reason: String,
    },

    /// A value that cannot be stored or converted (e.g. an unsupported leaf type).
    #[error("cannot handle the value at {key:?}: {reason}")]
    InvalidValue {
        /// The key path of the value, joined with '/'.
        key: String,
        /// Why it cannot be handled.
        reason: String,
    },

    /// A dtype that the requested operation cannot handle.
    #[error("dtype {dtype} at {key:?} is not supported here: {reason}")]
    UnsupportedDType {
        /// The key path of the tensor.
        key: String,
        /// The dtype name.
        dtype: String,
        /// Why it is unsupported and what to do instead.
        reason: String,
    },

    /// Two key paths that map to the same flat tensor name in a file.
    #[error("key paths {first:?} and {second:?} both map to the tensor name {name:?}")]
    NameCollision {
        /// The name both paths give.
        name: String,
        /// The first path.
        first: String,
        /// The second path.
        second: String,
    },

    /// Shape, strides and byte span of a tensor disagree.
    #[error("inconsistent tensor layout: {reason}")]
    Layout {
        /// What disagrees.
        reason: String,
    },

    /// A key path that does not exist in the dictionary.
    #[error("no entry at key path {path:?}")]
    KeyNotFound {
        /// The path asked for, joined with '/'.
        path: String,
    },

    /// An operating-system I/O error, with the file and the operation.
    #[error("{op} {path:?}: {source}")]
    Io {
        /// What was being done (open, write, rename, …).
        op: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The key path of the value an error is about, where it names one: the `key` of
    /// [`Error::InvalidValue`] and [`Error::UnsupportedDType`] when not empty (an error
    /// raised where no key is known has an empty one). Callers that know the key re-raise
    /// a keyless error with theirs, and pass a keyed one on as it is.
    ///
    /// ```
    /// use tensorferry::Error;
    ///
    /// let keyed = Error::InvalidValue { key: "model/w".into(), reason: "no".into() };
    /// assert_eq!(keyed.key(), Some("model/w"));
    /// let keyless = Error::InvalidValue { key: String::new(), reason: "no".into() };
    /// assert_eq!(keyless.key(), None);
    /// ```
    pub fn key(&self) -> Option<&str> {
        match self {
            Error::InvalidValue { key, .. } | Error::UnsupportedDType { key, .. } => {
                Some(key.as_str()).filter(|k| !k.is_empty())
            }
            _ => None,
        }
    }

    /// A [`Error::Format`] at a byte offset.
    pub(crate) fn format_at(offset: u64, reason: impl Into<String>) -> Self {
        Error::Format {
            at: format!("byte {offset}"),
            reason: reason.into(),
        }
    }

    /// A [`Error::Format`] about a named tensor.
    pub(crate) fn format_in(name: &str, reason: impl Into<String>) -> Self {
        Error::Format {
            at: format!("tensor {name:?}"),
            reason: reason.into(),
        }
    }

    /// A [`Error::Format`] located in the file it came from (the reader names byte
    /// offsets and tensors; a user needs the file too); other errors, and format errors
    /// that name the file already, as they are.
    pub(crate) fn in_file(self, path: &std::path::Path) -> Self {
        match self {
            Error::Format { at, reason } if !at.contains(&*path.to_string_lossy()) => {
                Error::Format {
                    at: format!("{} ({at})", path.display()),
                    reason,
                }
            }
            other => other,
        }
    }

    /// An [`Error::Io`] for `op` on `path`.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// What a GPU's free count leaves out: memory another library keeps cached for itself.
fn out_of_memory_hint(device: &str) -> &'static str {
    if device.starts_with("cuda") {
        " (the driver's count: memory another library caches, such as PyTorch's allocator, \
         is not free; `torch.cuda.empty_cache()` gives it back)"
    } else {
        ""
    }
}
