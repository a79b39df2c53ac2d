//! The transfer engine: one plan per dictionary, not one copy per tensor.
//!
//! Every tensor that must move to or from a device gets a 64-byte-aligned slot in one
//! destination buffer (the plan), and the copies of a whole group (one source device to
//! one target) are submitted as one batch to a device's stream: the target's, or the
//! source's for copies to the host. Each destination carries the event of that batch,
//! so any read waits for it: reading too early is impossible, not just documented. The
//! batch holds its sources and its destination, so neither is freed before it has run.
//!
//! The engine knows devices only through [`Backend`]: the emulated device today, CUDA
//! next, with the same plans.

use std::any::Any;
use std::sync::Arc;

use crate::backend::{backend_for, Backend, CopyBatch, CopyOp, Direction, Event};
use crate::consolidate::{pack, views, PackedLayout};
use crate::device::Device;
use crate::error::Result;
use crate::memory::{AlignedBuffer, HostBuffer};
use crate::storage::Storage;
use crate::tensor::Tensor;

/// How to move.
#[derive(Clone, Copy, Debug, Default)]
pub struct MoveOptions {
    /// Copy even tensors already on the target, so that no result shares memory with
    /// its source.
    pub copy: bool,
    /// Return as soon as the copies are queued; results wait for them when read.
    pub non_blocking: bool,
    /// Results on the host live in the device's pinned pool (reused between transfers)
    /// instead of ordinary memory.
    pub pinned: bool,
}

/// Moves `tensors` to `target`, returning them in order. Tensors already there are
/// shared unless `copy`. On error nothing is returned, the sources are untouched, and
/// the memory allocated for the results is released.
pub fn move_tensors(
    tensors: &[&Tensor],
    target: Device,
    options: MoveOptions,
) -> Result<Vec<Tensor>> {
    target.ensure_available()?;
    let mut results: Vec<Option<Tensor>> = vec![None; tensors.len()];
    // Group what must move by source device, keeping order within each group.
    let mut groups: Vec<(Device, Vec<usize>)> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let from = t.device();
        if from == target && !options.copy {
            results[i] = Some((*t).clone());
            continue;
        }
        from.ensure_available()?;
        match groups.iter_mut().find(|(d, _)| *d == from) {
            Some((_, idx)) => idx.push(i),
            None => groups.push((from, vec![i])),
        }
    }
    let mut events = Vec::new();
    for (from, idx) in groups {
        let sources: Vec<Tensor> = idx.iter().map(|&i| tensors[i].clone()).collect();
        let moved = if from.is_host() && target.is_host() {
            let refs: Vec<&Tensor> = sources.iter().collect();
            pack(&refs)?
        } else if target.is_host() {
            let (moved, event) = to_host(&*backend_for(from)?, sources, options.pinned)?;
            events.push(event);
            moved
        } else {
            let direction = if from.is_host() {
                Direction::HostToDevice
            } else {
                Direction::DeviceToDevice
            };
            let (moved, event) = to_device(&*backend_for(target)?, direction, sources)?;
            events.push(event);
            moved
        };
        for (i, t) in idx.into_iter().zip(moved) {
            results[i] = Some(t);
        }
    }
    if !options.non_blocking {
        for e in &events {
            e.wait(&target.to_string())?;
        }
    }
    Ok(results
        .into_iter()
        .map(|t| t.expect("every tensor placed"))
        .collect())
}

/// The batch copying each source's runs (C order) to `dst_base` at the plan's offsets,
/// waiting first for the copies that still fill any source.
fn plan(
    direction: Direction,
    sources: &[Tensor],
    layout: &PackedLayout,
    dst_base: *mut u8,
) -> Result<CopyBatch> {
    let mut batch = CopyBatch {
        direction,
        ops: Vec::with_capacity(sources.len()),
        waits: Vec::new(),
    };
    for (t, &at) in sources.iter().zip(&layout.offsets) {
        if let Some(e) = t.storage().pending() {
            if !e.is_ready() {
                batch.waits.push(e.clone());
            }
        }
        let base = t.storage().as_ptr();
        let mut i = at;
        t.run_offsets(|offset, len| {
            batch.ops.push(CopyOp {
                src: base.wrapping_add(offset),
                dst: dst_base.wrapping_add(i),
                len,
            });
            i += len;
            Ok(())
        })?;
    }
    Ok(batch)
}

/// Submits `batch` with everything it touches held until it completes.
fn submit(
    backend: &dyn Backend,
    batch: CopyBatch,
    sources: Vec<Tensor>,
    dst: Arc<Storage>,
    event: &Event,
) {
    let keep: Box<dyn Any + Send> = Box::new((sources, dst));
    // SAFETY: the ops address the sources' elements (inside their storages, by
    // `run_offsets`) and the new destination storage (inside its length, by the plan);
    // `keep` holds all of them until the event completes. The destination is new: nothing
    // else writes it, and every reader waits for its event, which is `event`.
    unsafe { backend.submit(batch, keep, event) };
}

/// Device → host: one host buffer for the group (ordinary memory, or a buffer of the
/// device's pinned pool), filled by one batch on the source's stream; the results wait for
/// it when read.
fn to_host(
    backend: &dyn Backend,
    sources: Vec<Tensor>,
    pinned: bool,
) -> Result<(Vec<Tensor>, Event)> {
    let layout = PackedLayout::plan(sources.iter().map(Tensor::nbytes));
    let event = Event::pending();
    let mut buffer = if pinned {
        HostBuffer::Pinned(backend.pinned_pool()?.take(layout.total)?)
    } else {
        HostBuffer::Pageable(AlignedBuffer::zeroed(layout.total)?)
    };
    let dst_base = buffer.as_mut_ptr();
    let batch = plan(Direction::DeviceToHost, &sources, &layout, dst_base)?;
    let storage = Arc::new(Storage::Incoming {
        buffer,
        ready: event.clone(),
    });
    let results = views(&storage, &sources, &layout)?;
    submit(backend, batch, sources, storage, &event);
    Ok((results, event))
}

/// Host or device → a device: one allocation for the group, filled by one batch on the
/// target's stream.
fn to_device(
    backend: &dyn Backend,
    direction: Direction,
    sources: Vec<Tensor>,
) -> Result<(Vec<Tensor>, Event)> {
    let layout = PackedLayout::plan(sources.iter().map(Tensor::nbytes));
    let mut memory = backend.alloc(layout.total)?;
    let event = Event::pending();
    memory.set_written(event.clone());
    let batch = plan(direction, &sources, &layout, memory.as_ptr() as *mut u8)?;
    let storage = Arc::new(Storage::Device(memory));
    let results = views(&storage, &sources, &layout)?;
    submit(backend, batch, sources, storage, &event);
    Ok((results, event))
}
