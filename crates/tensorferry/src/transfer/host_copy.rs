//! Host → host copies for the transfer engine. Sources whose memory is complete are
//! packed at once ([`crate::consolidate::pack`]); sources that a queued copy still fills
//! (the results of a non-blocking move, or a device span fetched for a gather) are packed
//! on a worker of the pool once that copy has run, so that a non-blocking move never blocks
//! its caller, and a failed copy fails the results that depend on it.

use std::sync::Arc;

use super::batch::runs;
use crate::backend::event::Failure;
use crate::backend::worker::run_on_pool;
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
    let buffer = AlignedBuffer::zeroed(layout.total)?;
    let event = Event::pending();
    let storage = Arc::new(Storage::incoming(
        HostBuffer::Pageable(buffer),
        event.clone(),
    ));
    let results = views(&storage, &sources, &layout)?;
    run_on_pool(Device::Cpu, event.clone(), move || {
        for w in &waits {
            w.wait_outcome()?;
        }
        let dst = storage.as_ptr().cast_mut();
        for r in &runs {
            let from = sources[r.source]
                .storage()
                .host_bytes()
                .expect("host sources, filled (their copies have succeeded)");
            let from = &from[r.src_offset..r.src_offset + r.len];
            // SAFETY: the destination range lies inside the new buffer (by the layout),
            // which `storage` holds and nobody reads before `event` completes; the buffer is
            // new, so it overlaps no source, and the runs land on disjoint ranges of it.
            unsafe {
                std::ptr::copy_nonoverlapping(from.as_ptr(), dst.wrapping_add(r.dst_offset), r.len)
            };
        }
        Ok::<(), Failure>(())
    })?;
    Ok((results, Some(event)))
}
