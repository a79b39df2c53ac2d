//! Moving tensors: [`move_tensors`] groups them by source device, plans one layout per
//! group and fills it with one batch of copies (or through a staging ring), as the
//! module's documentation ([`super`]) describes.

use std::sync::Arc;

use super::batch::copy_direct;
use super::staging::{self, Staging};
use super::{fragmented, host_copy};
use crate::backend::{backend_for, Backend, DeviceMemory, Direction, Event};
use crate::consolidate::{views, PackedLayout};
use crate::device::Device;
use crate::error::Result;
use crate::memory::{AlignedBuffer, HostBuffer};
use crate::storage::Storage;
use crate::tensor::Tensor;

/// How to move.
///
/// ```
/// use tensorferry::{MoveOptions, Staging};
///
/// let options = MoveOptions { non_blocking: true, staging: Staging::Off, ..Default::default() };
/// assert!(!options.copy);
/// ```
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
    /// Whether copies between a device and ordinary host memory go through pinned
    /// staging buffers.
    pub staging: Staging,
    /// With `non_blocking`: the caller waits for the results at once anyway (a blocking
    /// call that waits in slices to stay interruptible, as the Python package does), so
    /// the copies may hold the submitting thread: [`Staging::Auto`] then keeps small
    /// transfers direct, as for a blocking move, instead of taking the ring that lets a
    /// non-blocking call return without waiting for the GPU.
    pub waits_at_once: bool,
}

/// Moves `tensors` to `target`, returning them in order. Tensors already there are
/// shared unless `copy`. On error nothing is returned, the sources are untouched, and
/// the memory allocated for the results is released (once the copies already queued
/// have run).
///
/// With `non_blocking`, returns once the copies are queued; every read of a result waits
/// for them and fails with the error of a copy that failed. Without it, waits for the
/// copies before returning (uninterruptibly: a caller that must react to Ctrl-C moves
/// non-blocking and waits with [`Tensor::wait_timeout`] on each result instead, which is
/// equivalent).
///
/// ```
/// use tensorferry::{move_tensors, Device, MoveOptions, Tensor};
///
/// let a = Tensor::from_slice(&[1.0f32, 2.0], &[2])?;
/// let moved = move_tensors(&[&a], Device::Emulated(0), MoveOptions::default())?;
/// assert_eq!(moved[0].device(), Device::Emulated(0));
/// let back = move_tensors(&[&moved[0]], Device::Cpu, MoveOptions::default())?;
/// assert_eq!(back[0].to_vec::<f32>()?, [1.0, 2.0]);
/// # Ok::<(), tensorferry::Error>(())
/// ```
pub fn move_tensors(
    tensors: &[&Tensor],
    target: Device,
    options: MoveOptions,
) -> Result<Vec<Tensor>> {
    options.staging.validate()?;
    target.ensure_available()?;
    let mut results: Vec<Option<Tensor>> = vec![None; tensors.len()];
    let mut moving = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        if t.device() == target && !options.copy {
            results[i] = Some((*t).clone());
            continue;
        }
        t.device().ensure_available()?;
        moving.push(i);
    }
    let groups = group_by(moving, |i| tensors[i].device());
    let events = if target.is_host() {
        to_host_groups(tensors, groups, options, &mut results)?
    } else {
        to_device_groups(tensors, groups, target, options, &mut results)?
    };
    if !options.non_blocking {
        for e in &events {
            e.wait()?;
        }
    }
    Ok(results
        .into_iter()
        .map(|t| t.expect("every tensor placed"))
        .collect())
}

/// `indices` grouped by `device_of` each, groups in order of first appearance and indices
/// in order within each.
fn group_by(
    indices: impl IntoIterator<Item = usize>,
    device_of: impl Fn(usize) -> Device,
) -> Vec<(Device, Vec<usize>)> {
    let mut groups: Vec<(Device, Vec<usize>)> = Vec::new();
    for i in indices {
        let device = device_of(i);
        match groups.iter_mut().find(|(d, _)| *d == device) {
            Some((_, idx)) => idx.push(i),
            None => groups.push((device, vec![i])),
        }
    }
    groups
}

/// Moves each group (indices into `tensors`, by source device) to the host, into
/// `results`: the events of the copies.
fn to_host_groups(
    tensors: &[&Tensor],
    groups: Vec<(Device, Vec<usize>)>,
    options: MoveOptions,
    results: &mut [Option<Tensor>],
) -> Result<Vec<Event>> {
    // Fragmented sources on a device are gathered from a host copy of their span: they
    // change group.
    let mut prepared: Vec<Option<Tensor>> = vec![None; tensors.len()];
    for (_, idx) in &groups {
        for &i in idx {
            prepared[i] = fragmented::prepare(tensors[i], Device::Cpu, fetch_span)?;
        }
    }
    let regrouped = group_by(groups.into_iter().flat_map(|(_, idx)| idx), |i| {
        prepared[i].as_ref().unwrap_or(tensors[i]).device()
    });
    let mut events = Vec::new();
    for (from, idx) in regrouped {
        let sources: Vec<Tensor> = idx
            .iter()
            .map(|&i| prepared[i].clone().unwrap_or_else(|| tensors[i].clone()))
            .collect();
        let moved = if from.is_host() {
            let (moved, event) = host_copy::pack_when_ready(sources)?;
            events.extend(event);
            moved
        } else {
            let (moved, event) = to_host(&backend_for(from)?, sources, options)?;
            events.push(event);
            moved
        };
        for (i, t) in idx.into_iter().zip(moved) {
            results[i] = Some(t);
        }
    }
    Ok(events)
}

/// The host copy of `span`, a contiguous stretch of device memory holding a fragmented
/// tensor's elements ([`fragmented::prepare`]). Its bytes are waited for before the gather
/// (as for a blocking move): the span is copied direct, not through a staging ring of its
/// own.
pub(super) fn fetch_span(span: &Tensor) -> Result<Tensor> {
    let options = MoveOptions {
        copy: true,
        non_blocking: true,
        waits_at_once: true,
        ..Default::default()
    };
    Ok(move_tensors(&[span], Device::Cpu, options)?.remove(0))
}

/// Moves each group (indices into `tensors`, by source device) to the device `target`,
/// into `results`: the events of the copies. The device memory of every group is taken
/// first, so that a target too small fails at once, before any fragmented host source is
/// gathered (a broadcast view's packed copy may be far larger than its memory).
fn to_device_groups(
    tensors: &[&Tensor],
    groups: Vec<(Device, Vec<usize>)>,
    target: Device,
    options: MoveOptions,
    results: &mut [Option<Tensor>],
) -> Result<Vec<Event>> {
    let backend = backend_for(target)?;
    let mut reserved = Vec::with_capacity(groups.len());
    for (_, idx) in &groups {
        let layout = PackedLayout::plan(idx.iter().map(|&i| tensors[i].nbytes()));
        let memory = backend.alloc(layout.total)?;
        reserved.push((layout, memory));
    }
    let mut events = Vec::new();
    for ((from, idx), (layout, memory)) in groups.into_iter().zip(reserved) {
        // Fragmented host sources are packed on the host first (same group).
        let sources = idx
            .iter()
            .map(|&i| {
                Ok(fragmented::prepare(tensors[i], target, fetch_span)?
                    .unwrap_or_else(|| tensors[i].clone()))
            })
            .collect::<Result<Vec<Tensor>>>()?;
        let direction = if from.is_host() {
            Direction::HostToDevice
        } else {
            Direction::DeviceToDevice
        };
        if direction == Direction::DeviceToDevice && from != target {
            // The copies run on the target's stream: ordered after the source's, which
            // the sources' producers were ordered before.
            backend.order_after_device(from)?;
        }
        let (moved, event) = to_device(&backend, direction, sources, (layout, memory), options)?;
        events.push(event);
        for (i, t) in idx.into_iter().zip(moved) {
            results[i] = Some(t);
        }
    }
    Ok(events)
}

/// The staging ring `options` ask for a transfer of `total` bytes between `backend`'s
/// device and ordinary host memory, if any.
fn ring_of(
    backend: &Arc<dyn Backend>,
    options: &MoveOptions,
    total: usize,
) -> Option<staging::Ring> {
    let non_blocking = options.non_blocking && !options.waits_at_once;
    options.staging.ring_for(&**backend, total, non_blocking)
}

/// Queues the copies of `sources` into `storage` (by `layout`): through the staging ring
/// when there is one (one `Auto` chose goes direct when it cannot be set up), else as one
/// batch; `event` completes when done.
fn fill(
    backend: &Arc<dyn Backend>,
    ring: Option<staging::Ring>,
    direction: Direction,
    sources: Vec<Tensor>,
    layout: &PackedLayout,
    storage: Arc<Storage>,
    event: &Event,
) -> Result<()> {
    match ring {
        Some(ring) => staging::start(
            backend.clone(),
            ring,
            direction,
            sources,
            layout,
            storage,
            event,
        ),
        None => copy_direct(backend, direction, sources, layout, storage, event),
    }
}

/// Device → host: one host buffer for the group (ordinary memory, or a buffer of the
/// device's pinned pool), filled by one batch on the source's stream — or through the
/// staging ring when the buffer is ordinary memory and staging pays; the results wait for
/// it when read.
fn to_host(
    backend: &Arc<dyn Backend>,
    sources: Vec<Tensor>,
    options: MoveOptions,
) -> Result<(Vec<Tensor>, Event)> {
    let layout = PackedLayout::plan(sources.iter().map(Tensor::nbytes));
    let event = Event::pending();
    let ring = (!options.pinned)
        .then(|| ring_of(backend, &options, layout.total))
        .flatten();
    let buffer = if options.pinned {
        HostBuffer::Pinned(backend.pinned_pool()?.take(layout.total)?)
    } else {
        HostBuffer::Pageable(AlignedBuffer::zeroed(layout.total)?)
    };
    let storage = Arc::new(Storage::incoming(buffer, event.clone()));
    let results = views(&storage, &sources, &layout)?;
    fill(
        backend,
        ring,
        Direction::DeviceToHost,
        sources,
        &layout,
        storage,
        &event,
    )?;
    Ok((results, event))
}

/// Host or device → a device: `memory`, one allocation for the group by `layout`, filled
/// by one batch on the target's stream (or, from host memory, through the staging ring
/// when it pays).
fn to_device(
    backend: &Arc<dyn Backend>,
    direction: Direction,
    sources: Vec<Tensor>,
    (layout, mut memory): (PackedLayout, DeviceMemory),
    options: MoveOptions,
) -> Result<(Vec<Tensor>, Event)> {
    // Sources already in pinned memory (the pool's, or page-locked by another library, as
    // PyTorch's `pin_memory()` tensors are) go straight to the device: the driver is asked
    // only when a ring would be used.
    let ring = (direction == Direction::HostToDevice)
        .then(|| ring_of(backend, &options, layout.total))
        .flatten()
        .filter(|_| {
            sources
                .iter()
                .any(|t| !t.storage().is_pinned() && !backend.is_page_locked(t.data_ptr()))
        });
    let event = Event::pending();
    memory.set_written(event.clone());
    let storage = Arc::new(Storage::device_memory(memory));
    let results = views(&storage, &sources, &layout)?;
    fill(backend, ring, direction, sources, &layout, storage, &event)?;
    Ok((results, event))
}

impl Tensor {
    /// The tensor on `device`: the same tensor when it is already there (unless `copy`),
    /// else a copy, finished before returning. A copy never shares memory with `self`.
    /// (Defined with the engine that makes the copy, which tensors know nothing of.)
    pub fn to(&self, device: Device, copy: bool) -> Result<Tensor> {
        let options = MoveOptions {
            copy,
            ..Default::default()
        };
        let mut moved = move_tensors(&[self], device, options)?;
        Ok(moved.pop().expect("one tensor in, one out"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::worker;
    use crate::transfer::{move_tensors, MoveOptions};

    #[test]
    fn chained_staged_transfers_beyond_the_pools_size_all_complete() {
        // Each transfer's copies wait for the one before, and there are three times as
        // many as the pool has threads: the pool runs them oldest first, so none waits for
        // one that cannot start.
        let staged = MoveOptions {
            non_blocking: true,
            staging: Staging::Ring {
                chunk_bytes: 4096,
                depth: 2,
            },
            ..Default::default()
        };
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        let mut t = Tensor::from_slice(&data, &[data.len()]).unwrap();
        let mut all = Vec::new();
        for i in 0..3 * worker::max_workers() {
            let to = if i % 2 == 0 {
                Device::Emulated(0)
            } else {
                Device::Cpu
            };
            t = move_tensors(&[&t], to, staged).unwrap().pop().unwrap();
            all.push(t.clone());
        }
        for t in &all {
            t.wait().unwrap();
        }
        let home = t.to(Device::Cpu, false).unwrap();
        assert_eq!(home.to_vec::<u8>().unwrap(), data);
    }
}
