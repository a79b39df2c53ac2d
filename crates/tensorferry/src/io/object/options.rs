//! How to talk to object storage: part sizes, concurrency and retries, with overrides
//! from the environment.

use std::time::Duration;

/// How to talk to object storage. [`ObjectOptions::from_env`] reads overrides of the
/// defaults from `TENSORFERRY_OBJECT_*` variables; credentials, regions and endpoints
/// come from each store's usual variables (`AWS_*`, …).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectOptions {
    /// Bytes per ranged GET and per uploaded part (default 8 MiB; uploads use at least
    /// S3's 5 MiB minimum). `TENSORFERRY_OBJECT_PART_BYTES`.
    pub part_bytes: usize,
    /// Requests in flight at once for one object (default 16).
    /// `TENSORFERRY_OBJECT_CONCURRENCY`.
    pub concurrency: usize,
    /// Bytes of the first GET, which brings the header (default 1 MiB: a second GET only
    /// for longer headers). `TENSORFERRY_OBJECT_HEADER_BYTES`.
    pub header_bytes: usize,
    /// Retries of a failed request, with exponential backoff (default 5).
    /// `TENSORFERRY_OBJECT_RETRIES`.
    pub max_retries: usize,
    /// No retry starts later than this after a request's first try (default 60 s).
    /// `TENSORFERRY_OBJECT_RETRY_TIMEOUT` (seconds).
    pub retry_timeout: Duration,
    /// What an earlier read found of the one object a load reads (its version and
    /// header): a load that finds another version is an error saying it was replaced, and
    /// a subset load asks for no header. `None` (the default): the version the load's
    /// first GET finds, which every later GET must find.
    pub pinned: Option<Pinned>,
}

/// One version of an object, as an earlier read found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pinned {
    /// Its ETag, where the store gives one.
    pub etag: Option<String>,
    /// Its size in bytes.
    pub size: u64,
    /// Its header as stored: the 8-byte length, then the JSON.
    pub header: Vec<u8>,
}

impl Default for ObjectOptions {
    fn default() -> Self {
        ObjectOptions {
            part_bytes: 8 << 20,
            concurrency: 16,
            header_bytes: 1 << 20,
            max_retries: 5,
            retry_timeout: Duration::from_secs(60),
            pinned: None,
        }
    }
}

impl ObjectOptions {
    /// The defaults, with the `TENSORFERRY_OBJECT_*` variables that are set (and are
    /// positive numbers) taking their place.
    pub fn from_env() -> Self {
        let number = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let mut o = ObjectOptions::default();
        if let Some(n) = number("TENSORFERRY_OBJECT_PART_BYTES").filter(|&n| n > 0) {
            o.part_bytes = n as usize;
        }
        if let Some(n) = number("TENSORFERRY_OBJECT_CONCURRENCY").filter(|&n| n > 0) {
            o.concurrency = n as usize;
        }
        if let Some(n) = number("TENSORFERRY_OBJECT_HEADER_BYTES").filter(|&n| n >= 8) {
            o.header_bytes = n as usize;
        }
        if let Some(n) = number("TENSORFERRY_OBJECT_RETRIES") {
            o.max_retries = n as usize;
        }
        if let Some(n) = number("TENSORFERRY_OBJECT_RETRY_TIMEOUT") {
            o.retry_timeout = Duration::from_secs(n);
        }
        o
    }
}
