//! The transfer engine: one plan per dictionary, not one copy per tensor.
//!
//! Every tensor that must move to or from a device gets a 64-byte-aligned slot in one
//! destination buffer (the plan), and the copies of a whole group (one source device to
//! one target) are submitted as one batch to a device's stream: the target's, or the
//! source's for copies to the host. Each destination carries the event of that batch,
//! so any read waits for it: reading too early is impossible, not just documented. The
//! batch holds its sources and its destination, so neither is freed before it has run.
//!
//! Between a device and ordinary (pageable) host memory, large transfers go through a
//! ring of pinned staging buffers ([`staging`]) where the device benefits from it.
//!
//! A non-blocking move never blocks its caller: copies from sources that earlier copies
//! still fill are queued after them, on the device or on a host worker thread
//! (`host_copy`). A blocking move is a non-blocking one followed by a wait for its
//! copies; a caller that must stay responsive can do the same with
//! [`crate::Tensor::wait_timeout`] on every result. A copy that fails fails every result that
//! depends on it, with an error naming the device whose copy failed.
//!
//! The engine knows devices only through [`crate::backend::Backend`]: the emulated device and CUDA, with
//! the same plans.

mod batch;
mod consumer;
mod engine;
pub(crate) mod fragmented;
mod host_copy;
mod ring;
mod ring_memory;
pub mod staging;
pub(crate) mod stream_in;
mod stream_out;

#[cfg(test)]
pub(crate) use consumer::order_stream_after;
pub use consumer::{wait_queued_timeout, Readable};
pub use engine::{move_tensors, MoveOptions};
pub use staging::Staging;
#[cfg(test)]
pub(crate) use staging::MAX_AUTO_RINGS;
pub(crate) use stream_out::stream_to_sink;
