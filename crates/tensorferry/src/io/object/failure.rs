//! What went wrong talking to an object store, as one typed cause per kind of failure a
//! user acts on differently, carried inside [`Error::Io`] so that callers (and Python,
//! through the errno each cause names) tell them apart without parsing messages.

use std::fmt;
use std::io;

use crate::error::Error;

/// Why an operation on an object failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cause {
    /// No credentials were found (environment, instance metadata, …).
    NoCredentials,
    /// The credentials were refused (unknown key, bad signature).
    BadCredentials,
    /// The credentials are valid but may not do this (HTTP 403).
    AccessDenied,
    /// The bucket (or container) does not exist.
    NoBucket,
    /// The object does not exist (HTTP 404).
    NotFound,
    /// The object was replaced while it was read: its ETag changed (HTTP 412, or a
    /// different ETag on a later ranged read).
    Changed,
    /// The server could not be reached, or stopped answering, within the retries.
    Unreachable,
    /// Connections dropped in the middle of a transfer (reset, or a body cut short), more
    /// often than the retries allow.
    Dropped,
    /// The URL or the store's configuration is not usable.
    BadConfig,
    /// The server's TLS certificate is not one the client trusts (its CA is not among the
    /// roots: the system's, or those `SSL_CERT_FILE` / `SSL_CERT_DIR` name).
    Untrusted,
    /// Anything else the store reported.
    Other,
}

impl Cause {
    /// The errno a caller that speaks POSIX (Python's `OSError` subclasses) would use.
    #[cfg(unix)]
    pub fn errno(self) -> Option<i32> {
        Some(match self {
            Cause::NotFound | Cause::NoBucket => libc::ENOENT,
            Cause::AccessDenied | Cause::NoCredentials | Cause::BadCredentials => libc::EACCES,
            Cause::Unreachable => libc::ECONNREFUSED,
            Cause::Dropped => libc::ECONNRESET,
            Cause::Changed | Cause::BadConfig | Cause::Untrusted | Cause::Other => return None,
        })
    }

    /// The errno a caller that speaks POSIX would use (none off Unix).
    #[cfg(not(unix))]
    pub fn errno(self) -> Option<i32> {
        None
    }

    fn kind(self) -> io::ErrorKind {
        match self {
            Cause::NotFound | Cause::NoBucket => io::ErrorKind::NotFound,
            Cause::AccessDenied | Cause::NoCredentials | Cause::BadCredentials => {
                io::ErrorKind::PermissionDenied
            }
            Cause::Unreachable => io::ErrorKind::ConnectionRefused,
            Cause::Dropped => io::ErrorKind::ConnectionReset,
            Cause::BadConfig => io::ErrorKind::InvalidInput,
            Cause::Changed | Cause::Untrusted | Cause::Other => io::ErrorKind::Other,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Cause::NoCredentials => "no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the store's equivalents)",
            Cause::BadCredentials => "the credentials were refused",
            Cause::AccessDenied => "access denied",
            Cause::NoBucket => "no such bucket",
            Cause::NotFound => "no such object",
            Cause::Changed => "the object was replaced while it was read (its ETag changed): nothing was loaded, load it again",
            Cause::Unreachable => "the server could not be reached",
            Cause::Dropped => "the connection dropped in the middle of a transfer, more often than the retries allow (TENSORFERRY_OBJECT_RETRIES)",
            Cause::BadConfig => "the URL or the store's settings are not usable",
            Cause::Untrusted => "the server's TLS certificate is not trusted (a private CA is trusted with SSL_CERT_FILE=<its PEM file>)",
            Cause::Other => "the store reported an error",
        }
    }
}

/// A failed operation on an object: its cause and the store's own words.
#[derive(Debug)]
pub struct ObjectFailure {
    /// Why it failed.
    pub cause: Cause,
    /// What the store or the client said.
    pub detail: String,
}

impl fmt::Display for ObjectFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.cause.describe())?;
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for ObjectFailure {}

/// An [`Error::Io`] for `op` on the object at `url`, with its cause.
pub(crate) fn failed(
    op: &'static str,
    url: &str,
    cause: Cause,
    detail: impl Into<String>,
) -> Error {
    let failure = ObjectFailure {
        cause,
        detail: detail.into(),
    };
    Error::io(op, url, io::Error::new(cause.kind(), failure))
}

/// The tensorferry error for a failure of `object_store` during `op` on `url`.
pub(crate) fn from_store(op: &'static str, url: &str, e: object_store::Error) -> Error {
    let detail = chain(&e);
    failed(op, url, classify(&e, &detail), detail)
}

/// The cause of a store error: its variant first, the S3 error code in its text where
/// the variant alone is ambiguous (a 404 is a missing object or a missing bucket).
fn classify(e: &object_store::Error, text: &str) -> Cause {
    use object_store::Error as E;
    let has = |s: &str| text.contains(s);
    if has("NoSuchBucket") || has("ContainerNotFound") {
        return Cause::NoBucket;
    }
    if has("InvalidAccessKeyId") || has("SignatureDoesNotMatch") || has("InvalidToken") {
        return Cause::BadCredentials;
    }
    match e {
        E::NotFound { .. } => Cause::NotFound,
        E::Precondition { .. } => Cause::Changed,
        E::PermissionDenied { .. } => Cause::AccessDenied,
        E::Unauthenticated { .. } => Cause::BadCredentials,
        E::InvalidPath { .. } | E::UnknownConfigurationKey { .. } | E::NotSupported { .. } => {
            Cause::BadConfig
        }
        // Without keys the clients ask the cloud's metadata service for some: a failure
        // there means no credentials were found.
        _ if has("credential")
            || has("Credential")
            || has("/latest/api/token")
            || has("/latest/meta-data/")
            || has("computeMetadata")
            || has("metadata/identity") =>
        {
            Cause::NoCredentials
        }
        _ if has("invalid peer certificate") => Cause::Untrusted,
        _ if has("onnection reset")
            || has("error reading a body")
            || has("body error")
            || has("roken pipe") =>
        {
            Cause::Dropped
        }
        _ if has("error sending request")
            || has("onnection refused")
            || has("timed out")
            || has("connection closed")
            || has("HTTP error") =>
        {
            Cause::Unreachable
        }
        _ => Cause::Other,
    }
}

/// An error and its sources, joined: the store's errors keep the HTTP status and the
/// server's code in their sources.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// The typed cause inside a tensorferry error, when it came from an object store.
pub fn cause_of(e: &Error) -> Option<Cause> {
    match e {
        Error::Io { source, .. } => source
            .get_ref()
            .and_then(|s| s.downcast_ref::<ObjectFailure>())
            .map(|f| f.cause),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store_error(text: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: text.to_string().into(),
        }
    }

    #[test]
    fn the_server_s_error_code_names_the_cause_the_status_alone_cannot() {
        let not_found = |text: &str| object_store::Error::NotFound {
            path: "k".into(),
            source: text.to_string().into(),
        };
        let cause = |e: &object_store::Error| classify(e, &chain(e));
        assert_eq!(cause(&not_found("<Code>NoSuchKey</Code>")), Cause::NotFound);
        assert_eq!(
            cause(&not_found("<Code>NoSuchBucket</Code>")),
            Cause::NoBucket
        );
        let denied = |text: &str| object_store::Error::PermissionDenied {
            path: "k".into(),
            source: text.to_string().into(),
        };
        assert_eq!(
            cause(&denied("<Code>AccessDenied</Code>")),
            Cause::AccessDenied
        );
        assert_eq!(
            cause(&denied("<Code>SignatureDoesNotMatch</Code>")),
            Cause::BadCredentials
        );
        assert_eq!(
            cause(&denied("<Code>InvalidAccessKeyId</Code>")),
            Cause::BadCredentials
        );
    }

    #[test]
    fn connection_failures_and_missing_credentials_are_told_apart() {
        let cause = |text: &str| {
            let e = store_error(text);
            classify(&e, &chain(&e))
        };
        assert_eq!(
            cause("HTTP error: error sending request: tcp connect error: Connection refused"),
            Cause::Unreachable
        );
        assert_eq!(
            cause("Error performing PUT http://169.254.169.254/latest/api/token: HTTP error: error sending request"),
            Cause::NoCredentials
        );
        assert_eq!(
            cause("HTTP error: request or response body error: error reading a body from connection: Connection reset by peer (os error 104)"),
            Cause::Dropped
        );
        assert_eq!(cause("something else"), Cause::Other);
    }

    #[test]
    fn a_failure_carries_its_cause_to_the_caller_and_the_object_to_the_message() {
        let e = failed("read", "s3://b/k", Cause::Changed, "ETag \"a\" then \"b\"");
        assert_eq!(cause_of(&e), Some(Cause::Changed));
        let text = e.to_string();
        assert!(
            text.contains("s3://b/k") && text.contains("replaced"),
            "{text}"
        );
        assert_eq!(
            cause_of(&Error::io("read", "/x", io::Error::other("plain"))),
            None
        );
    }
}
