//! Checkpoints in object storage: `s3://` (AWS and S3-compatible servers), `gs://`,
//! `az://` and `http(s)://` URLs, loaded into host memory and saved, through Apache
//! Arrow's `object_store` client (its signing, retries with backoff, and timeouts; no
//! HTTP code of tensorferry's own).
//!
//! Loads fetch the header with one small ranged GET and the data with parallel ranged
//! GETs into one aligned buffer (a whole load asks for the data as soon as the first
//! answer begins), which becomes the tree exactly as a local file's bytes do
//! ([`load_url`]); a subset fetches only its byte ranges. Onto a device, the GETs
//! write into the staging ring's buffers, each copied to the device while the next is
//! fetched, so host memory stays bounded by the ring ([`load_url_to_until`]).
//! [`read_header_url`] and [`read_ranges`] read a header and chosen byte ranges of one
//! version of an object, for callers that plan their own reads. Saves are multipart uploads
//! straight from the tensors' memory, committed whole ([`save_url`]). Every failure is an
//! [`crate::Error::Io`] naming the object, whose source is an [`ObjectFailure`] with a
//! typed [`Cause`] ([`cause_of`]): never a hang (every request has a timeout, retries a
//! limit) and never partial data.

mod failure;
mod into_device;
mod load;
mod location;
mod plan;
mod runtime;
mod save;
mod upload;

use std::time::Duration;

pub use failure::{cause_of, Cause, ObjectFailure};
pub use into_device::load_url_to_until;
pub use load::{
    head_url, load_url, read_header_url, read_into, read_metadata_url, read_ranges, resolve_url,
    tensor_names,
};
pub use location::is_url;
pub(crate) use location::url_of;
pub use save::{delete_url, put_url, save_url};

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
}

impl Default for ObjectOptions {
    fn default() -> Self {
        ObjectOptions {
            part_bytes: 8 << 20,
            concurrency: 16,
            header_bytes: 1 << 20,
            max_retries: 5,
            retry_timeout: Duration::from_secs(60),
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
