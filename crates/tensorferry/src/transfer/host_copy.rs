//! Host → host copies for the transfer engine. Sources whose memory is complete are
//! packed at once ([`crate::consolidate::pack`]); sources that a queued copy still fills
//! (the results of a non-blocking move, or a device span fetched for a gather) are packed
//! on a worker thread once that copy has run, so that a non-blocking move never blocks
//! its caller, and a failed copy fails the results that depend on it.

use std::sync::Arc;

use super::runs;
use crate::backend::event::Failure;
use crate::backend::worker::spawn_worker;
use crate::backend::Event;
use crate::consolidate::{pack, views, PackedLayout};
use crate::device::Device;
use crate::error::Result;
use crate::memory::{AlignedBuffer, HostBuffer};
use crate::storage::Storage;
use crate::tensor::Tensor;

/// Packed host copies of `sources` (host tensors), in order, and the event of the copy
/// still filling them, if one is (`None`: they are complete).
pub(crate) fn pack_when_ready(sources: Vec<Tensor>) -> Result<(Vec<Tensor>, Option<Event>)> {
    if sources.iter().all(Tensor::is_ready) {
        let refs: Vec<&Tensor> = sources.iter().collect();
        return Ok((pack(&refs)?, None));
    }
    let layout = PackedLayout::plan(sources.iter().map(Tensor::nbytes));
    let (runs, waits) = runs(&sources, &layout)?;
    let mut buffer = AlignedBuffer::zeroed(layout.total)?;
    let base = Address(buffer.as_mut_slice().as_mut_ptr());
    let event = Event::pending();
    let storage = Arc::new(Storage::incoming(
        HostBuffer::Pageable(buffer),
        event.clone(),
    ));
    let results = views(&storage, &sources, &layout)?;
    let runs: Vec<(Address, usize, usize)> = runs
        .iter()
        .map(|r| (Address(r.src as *mut u8), r.dst_offset, r.len))
        .collect();
    spawn_worker(
        "tensorferry-host-copy",
        Device::Cpu,
        event.clone(),
        move || {
            // Held until the copy is done: the sources' memory and the destination.
            let _held = (&sources, &storage);
            for w in &waits {
                w.wait_outcome()?;
            }
            for &(src, at, len) in &runs {
                // SAFETY: `src` addresses `len` bytes of a source's host memory (by
                // `run_offsets`, inside its storage, which `sources` holds), complete now
                // (its copy's event has succeeded); the destination range lies inside the
                // new buffer (by the layout), which `storage` holds and nobody reads before
                // `event` completes; the buffer is new, so the ranges do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(src.at(0), base.at(at), len) };
            }
            Ok::<(), Failure>(())
        },
    )?;
    Ok((results, Some(event)))
}

/// A host address handed to the worker thread that copies through it.
#[derive(Clone, Copy)]
struct Address(*mut u8);
// SAFETY: plain addresses; the memory they name is held by the same worker (see the
// copy's SAFETY comment).
unsafe impl Send for Address {}

impl Address {
    /// The address `offset` bytes further (taking `self` whole, so that closures capture
    /// the `Send` wrapper, not its pointer).
    fn at(self, offset: usize) -> *mut u8 {
        self.0.wrapping_add(offset)
    }
}
