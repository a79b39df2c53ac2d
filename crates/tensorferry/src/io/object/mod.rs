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
//! [`read_header_url`] and [`read_into`] read a header and chosen byte ranges of one
//! version of an object, for callers that plan their own reads. Saves are multipart uploads
//! straight from the tensors' memory, committed whole ([`save_url`]). Every failure is an
//! [`crate::Error::Io`] naming the object, whose source is an [`ObjectFailure`] with a
//! typed [`Cause`] ([`cause_of`]): never a hang (every request has a timeout, retries a
//! limit) and never partial data.

mod arrival;
mod failure;
mod get;
mod into_device;
mod lanes;
mod load;
mod location;
mod options;
mod plan;
mod runtime;
mod save;
mod upload;

pub use arrival::Arrival;
pub use failure::{cause_of, Cause, ObjectFailure};
pub use into_device::load_url_to_until;
pub use load::{
    head_url, load_url, load_url_arriving, read_header_url, read_into, read_metadata_url,
    resolve_url, tensor_names,
};
pub use location::is_url;
pub(crate) use location::url_of;
pub use options::{ObjectOptions, Pinned};
pub use save::{delete_url, put_url, save_url};
