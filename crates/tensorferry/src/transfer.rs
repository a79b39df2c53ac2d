//! The transfer engine: one plan per dictionary, not one copy per tensor.
//!
//! Every tensor that must move to a device is given a 64-byte-aligned slot in one
//! destination buffer (the plan), and the copies of a whole group (one source device
//! to one target) run as one queued operation on the target's stream — or the source's,
//! for copies to the host. Each destination carries the event of that operation, so any
//! host read waits for it: reading too early is impossible, not just documented. The
//! queued operation holds the sources, so they stay alive until they have been read.

use std::sync::Arc;

use crate::backend::emulated::{self, DeviceBuffer};
use crate::backend::Event;
use crate::consolidate::{pack, PackedLayout};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::AlignedBuffer;
use crate::storage::Storage;
use crate::tensor::{contiguous_strides, Tensor};

/// How to move.
#[derive(Clone, Copy, Debug, Default)]
pub struct MoveOptions {
    /// Copy even tensors already on the target, so that no result shares memory with
    /// its source.
    pub copy: bool,
    /// Return as soon as the copies are queued; results wait for them when read.
    pub non_blocking: bool,
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
        let (moved, event) = match (from, target) {
            (Device::Cpu, Device::Cpu) => {
                let refs: Vec<&Tensor> = sources.iter().collect();
                (pack(&refs)?, None)
            }
            (Device::Emulated(d), Device::Cpu) => to_host(emulated::device(d)?, sources)?,
            (_, Device::Emulated(d)) => to_emulated(&emulated::device(d)?, sources)?,
            (from, to) => {
                return Err(Error::DeviceUnavailable {
                    device: if from == Device::Cpu { to } else { from }.to_string(),
                    reason: "CUDA transfers are not built into this version yet".into(),
                })
            }
        };
        events.extend(event);
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

/// Views of one destination storage, one per source, at the plan's offsets.
fn views(storage: &Arc<Storage>, sources: &[Tensor], layout: &PackedLayout) -> Result<Vec<Tensor>> {
    sources
        .iter()
        .zip(&layout.offsets)
        .map(|(t, &offset)| {
            let shape = t.shape().to_vec();
            let strides = contiguous_strides(&shape);
            Tensor::from_storage(storage.clone(), offset, t.dtype(), shape, strides)
        })
        .collect()
}

/// Copies every source's bytes (C order) into `dst` at the plan's offsets. Runs on a
/// stream: waits for each source's own pending copy first.
fn gather(sources: &[Tensor], layout: &PackedLayout, dst: &mut [u8]) -> Result<()> {
    for (t, &at) in sources.iter().zip(&layout.offsets) {
        t.wait()?;
        let mut i = at;
        let mut copy_run = |run: &[u8]| {
            dst[i..i + run.len()].copy_from_slice(run);
            i += run.len();
            Ok(())
        };
        match t.storage().as_ref() {
            // SAFETY: waited for the copy that wrote this device memory just above, and
            // the slice is used only within this copy.
            Storage::Emulated(b) => t.runs_in(unsafe { b.bytes() }, &mut copy_run)?,
            _ => t.for_each_run(&mut copy_run)?,
        }
    }
    Ok(())
}

/// Device → host: one host buffer for the group, filled by one operation on the source's
/// stream; the results wait for it when read.
fn to_host(
    device: Arc<emulated::EmulatedDevice>,
    sources: Vec<Tensor>,
) -> Result<(Vec<Tensor>, Option<Event>)> {
    let layout = PackedLayout::plan(sources.iter().map(Tensor::nbytes));
    let event = Event::pending();
    let storage = Arc::new(Storage::Incoming {
        buffer: AlignedBuffer::zeroed(layout.total)?,
        ready: event.clone(),
    });
    queue_gather(&device, &event, &storage, &sources, &layout);
    Ok((views(&storage, &sources, &layout)?, Some(event)))
}

/// Anything (host or device) → an emulated device: one device allocation for the group,
/// filled by one operation on the target's stream.
fn to_emulated(
    device: &Arc<emulated::EmulatedDevice>,
    sources: Vec<Tensor>,
) -> Result<(Vec<Tensor>, Option<Event>)> {
    let layout = PackedLayout::plan(sources.iter().map(Tensor::nbytes));
    let mut buffer: DeviceBuffer = device.alloc(layout.total)?;
    let event = Event::pending();
    buffer.set_written(event.clone());
    let storage = Arc::new(Storage::Emulated(buffer));
    queue_gather(device, &event, &storage, &sources, &layout);
    Ok((views(&storage, &sources, &layout)?, Some(event)))
}

/// Queues, on `device`'s stream, the copy of every source into `storage` at the plan's
/// offsets, completing `event`. The queued copy holds the sources and the destination,
/// so neither can be freed before it has run, whatever the caller drops.
fn queue_gather(
    device: &emulated::EmulatedDevice,
    event: &Event,
    storage: &Arc<Storage>,
    sources: &[Tensor],
    layout: &PackedLayout,
) {
    let held = sources.to_vec();
    let plan = layout.clone();
    let dst = storage.clone();
    device.enqueue(event, layout.total, move || {
        let len = dst.len();
        let out: &mut [u8] = if len == 0 {
            &mut []
        } else {
            // SAFETY: `dst` is a new storage owning `len` bytes at `as_ptr()` (a buffer
            // tensorferry allocated), kept alive by this closure. Its event is the one this
            // copy completes and every reader waits for it, so this copy is the only one
            // touching the memory while the slice lives.
            unsafe { std::slice::from_raw_parts_mut(dst.as_ptr() as *mut u8, len) }
        };
        gather(&held, &plan, out)
    });
}
