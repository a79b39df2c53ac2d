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
//! [`Tensor::wait_timeout`] on every result. A copy that fails fails every result that
//! depends on it, with an error naming the device whose copy failed.
//!
//! The engine knows devices only through [`Backend`]: the emulated device and CUDA, with
//! the same plans.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crate::backend::{
    backend_for, Backend, CopyBatch, CopyOp, DeviceMemory, Direction, Event, Failure,
};
use crate::consolidate::{views, PackedLayout};
use crate::device::Device;
use crate::error::Result;
use crate::memory::{AlignedBuffer, HostBuffer};
use crate::storage::Storage;
use crate::tensor::Tensor;

mod consumer;
pub(crate) mod fragmented;
mod host_copy;
mod ring;
mod ring_memory;
pub mod staging;
pub(crate) mod stream_in;
mod stream_out;

pub use consumer::{order_stream_after, wait_queued_timeout, Readable};
pub use staging::Staging;
#[cfg(test)]
pub(crate) use staging::MAX_AUTO_RINGS;
pub(crate) use stream_out::stream_to_sink;

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
            prepared[i] = fragmented::prepare(tensors[i], Device::Cpu)?;
        }
    }
    let mut regrouped: Vec<(Device, Vec<usize>)> = Vec::new();
    for (_, idx) in groups {
        for i in idx {
            let from = prepared[i].as_ref().unwrap_or(tensors[i]).device();
            match regrouped.iter_mut().find(|(d, _)| *d == from) {
                Some((_, v)) => v.push(i),
                None => regrouped.push((from, vec![i])),
            }
        }
    }
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
                Ok(fragmented::prepare(tensors[i], target)?.unwrap_or_else(|| tensors[i].clone()))
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

/// One contiguous run of a source, and where it goes in the packed layout: a source by
/// its index and an offset in its storage, not an address, so that the run is plain data
/// on any thread and its address is taken only where a copy is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    /// Which source (an index into the transfer's sources).
    pub source: usize,
    /// Where the run begins in that source's storage.
    pub src_offset: usize,
    /// Where it goes in the packed layout.
    pub dst_offset: usize,
    /// Bytes.
    pub len: usize,
}

impl Run {
    /// The run's address in `sources` (a host or device address, for a copy).
    pub(crate) fn src_address(&self, sources: &[Tensor]) -> *const u8 {
        sources[self.source]
            .storage()
            .as_ptr()
            .wrapping_add(self.src_offset)
    }
}

/// Every source's runs in C order with their offsets in `layout`, and the events of the
/// copies filling any source that are still running or have failed (a copy from a
/// source whose copy failed must fail too, not copy what the failed copy left).
pub(crate) fn runs(sources: &[Tensor], layout: &PackedLayout) -> Result<(Vec<Run>, Vec<Event>)> {
    let mut out = Vec::with_capacity(sources.len());
    let mut waits = Vec::new();
    for (source, (t, &at)) in sources.iter().zip(&layout.offsets).enumerate() {
        if let Some(e) = t.storage().pending() {
            if e.peek() != Some(Ok(())) {
                waits.push(e.clone());
            }
        }
        let mut i = at;
        t.run_offsets(|offset, len| {
            out.push(Run {
                source,
                src_offset: offset,
                dst_offset: i,
                len,
            });
            i += len;
            Ok(())
        })?;
    }
    Ok((out, waits))
}

/// The batch copying each source's runs (C order) into `dest` at the plan's offsets,
/// waiting first for the copies that still fill any source.
fn plan(
    direction: Direction,
    sources: &[Tensor],
    layout: &PackedLayout,
    dest: &Storage,
) -> Result<CopyBatch> {
    let (runs, waits) = runs(sources, layout)?;
    let dst_base = dest.as_ptr().cast_mut();
    Ok(CopyBatch {
        direction,
        ops: runs
            .iter()
            .map(|r| CopyOp {
                src: r.src_address(sources),
                dst: dst_base.wrapping_add(r.dst_offset),
                len: r.len,
            })
            .collect(),
        waits,
    })
}

/// Queues `batch` after the events it waits for, without blocking: the backend honours
/// waits on GPU work on the GPU and chains waits on host work ([`Backend::submit`]), so no
/// thread ever blocks on another transfer, and chained non-blocking transfers (and staging
/// rings, which feed a stream over time) cannot deadlock a stream. A panic in the backend
/// fails `event` instead of reaching the caller. Not `ordered`: a staging ring's chunk
/// ([`Backend::submit_unordered`]).
///
/// # Safety
/// As [`Backend::submit`]: `keep` must hold everything the ops address until `event`
/// completes.
pub(crate) unsafe fn submit_when_ready(
    backend: Arc<dyn Backend>,
    batch: CopyBatch,
    keep: Box<dyn Any + Send>,
    event: Event,
    ordered: bool,
) {
    let device = backend.device();
    // SAFETY: forwarded contract.
    let submitted = catch_unwind(AssertUnwindSafe(|| unsafe {
        if ordered {
            backend.submit(batch, keep, &event)
        } else {
            backend.submit_unordered(batch, keep, &event)
        }
    }));
    if let Err(panic) = submitted {
        event.complete(Err(Failure::internal(device, &*panic)));
    }
}

/// Submits `batch` with everything it touches held until it completes.
fn submit(
    backend: &Arc<dyn Backend>,
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
    unsafe { submit_when_ready(backend.clone(), batch, keep, event.clone(), true) };
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
        None => {
            let batch = plan(direction, &sources, layout, &storage)?;
            submit(backend, batch, sources, storage, event);
            Ok(())
        }
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
            non_blocking: false,
            ..Default::default()
        };
        let mut moved = move_tensors(&[self], device, options)?;
        Ok(moved.pop().expect("one tensor in, one out"))
    }
}
