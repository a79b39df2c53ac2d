//! Device tensors streamed out to a consumer (a file being written) through a ring of
//! pinned buffers, so that host memory stays bounded by the ring whatever the tensors'
//! size, and the device copies the next chunks while the consumer takes this one.
//!
//! The tensors' bytes, each in C order and back to back (as a safetensors data section
//! holds them), are cut into chunks of `chunk_bytes`; chunk `j` is copied into pinned
//! buffer `j % depth` by one batch on the device's stream. The first `depth` chunks are
//! queued at once; each time one completes, the consumer gets its bytes, and the chunk
//! that reuses its buffer is queued. Every queued batch holds its pinned buffer and the
//! sources until its event completes, so an error (from a copy or from the consumer)
//! returns at once without freeing memory a queued copy still writes.

use std::sync::Arc;

use super::batch::{runs, submit_when_ready};
use super::engine::fetch_span;
use super::fragmented;
use super::ring::{drive, RingSteps};
use super::ring_memory::RingMemory;
#[cfg(test)]
use super::staging::Staging;
use super::staging::{chunks, Chunk, Ring};
use crate::backend::{backend_for, Backend, CopyBatch, Direction, Event};
use crate::consolidate::PackedLayout;
use crate::device::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Calls `sink` with the bytes of `tensors` (all on `device`), in order, each in C order,
/// back to back: `sink` sees every byte once, in order, in pieces of at most
/// `ring.chunk_bytes`. Waits for copies still filling a source first (on the device).
/// The slices handed to `sink` live only for the call. A ring beyond the limits is refused
/// before anything is allocated ([`crate::Staging::validate`]); one `Staging::Auto` chose
/// goes through ordinary memory where no pinned memory is to be had.
///
/// A tensor whose bytes lie in many tiny runs (a transposed matrix) is gathered on the
/// host instead ([`fragmented::prepare`]) when the stream reaches it, so that at most one
/// such tensor is on the host at a time.
pub(crate) fn stream_to_sink(
    device: Device,
    tensors: &[&Tensor],
    ring: Ring,
    mut sink: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let ring = ring.validate()?;
    // Consecutive device tensors go through the ring together; gathered ones in between.
    let mut pending: Vec<Tensor> = Vec::new();
    for &t in tensors {
        match fragmented::prepare(t, Device::Cpu, fetch_span)? {
            Some(host) => {
                through_ring(device, std::mem::take(&mut pending), ring, &mut sink)?;
                host.for_each_run(&mut sink)?;
            }
            None => pending.push(t.clone()),
        }
    }
    through_ring(device, pending, ring, &mut sink)
}

/// The ring's pass over `sources`, all contiguous or with runs long enough to copy.
fn through_ring(
    device: Device,
    sources: Vec<Tensor>,
    ring: Ring,
    sink: &mut impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let mut offsets = Vec::with_capacity(sources.len());
    let mut total = 0usize;
    for t in &sources {
        offsets.push(total);
        total += t.nbytes();
    }
    if total == 0 {
        return Ok(());
    }
    let layout = PackedLayout { offsets, total };
    let (runs, waits) = runs(&sources, &layout)?;
    let chunks = chunks(&runs, ring.chunk_bytes);
    let backend = backend_for(device)?;
    // A ring `Staging::Auto` chose that gets no pinned memory streams through ordinary
    // memory: the device copies there directly, and host memory stays bounded.
    let memory = RingMemory::pinned_else_pageable(
        backend.pinned_pool(),
        ring.chunk_bytes.min(total),
        ring.depth.min(chunks.len()),
        ring.align,
        ring.automatic,
    )?;
    let depth = memory.depth();
    let mut steps = Download {
        backend,
        chunks,
        waits,
        memory: Arc::new(memory),
        sources: Arc::new(sources),
        sink,
    };
    drive(device, depth, &mut steps)
}

/// A stream's steps: a chunk of the sources to its slot on the device, the slot to the
/// sink on the host.
struct Download<'a, S> {
    backend: Arc<dyn Backend>,
    chunks: Vec<Chunk>,
    waits: Vec<Event>,
    memory: Arc<RingMemory>,
    sources: Arc<Vec<Tensor>>,
    sink: &'a mut S,
}

impl<S: FnMut(&[u8]) -> Result<()>> RingSteps for Download<'_, S> {
    fn chunks(&self) -> usize {
        self.chunks.len()
    }

    fn submit(&mut self, j: usize) -> Event {
        let batch = CopyBatch {
            direction: Direction::DeviceToHost,
            ops: self.chunks[j].ops_into(&self.sources, self.memory.slot_address(j)),
            waits: self.waits.clone(),
        };
        let event = Event::pending();
        let keep = Box::new((self.sources.clone(), self.memory.clone()));
        // SAFETY: the ops read the sources' elements (inside their storages, by
        // `run_offsets`), held by `keep`, and write the chunk's slot of the ring inside
        // its length (a chunk's pieces lie within `chunk_bytes` of its start), held by
        // `keep`; only this chunk writes that slot until its event completes, since the
        // ring reuses a slot only after it has drained it.
        unsafe { submit_when_ready(self.backend.clone(), batch, keep, event.clone(), true) };
        event
    }

    fn drain(&mut self, j: usize) -> Result<()> {
        let c = &self.chunks[j];
        let len = c.end() - c.start;
        // SAFETY: chunk `j`'s copy has completed (the ring drains after its event), having
        // written its `len` bytes of the slot, and the next chunk using the slot is queued
        // only after this.
        (self.sink)(unsafe { self.memory.bytes(j, len) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::serial;
    use crate::error::Error;

    /// emu:1, whose unit tests run one at a time: its pool's counts are this test's own.
    const DEV: Device = Device::Emulated(1);

    fn on_device(len: usize) -> Tensor {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        Tensor::from_slice(&data, &[len])
            .unwrap()
            .to(DEV, false)
            .unwrap()
    }

    #[test]
    fn a_consumer_failing_mid_stream_is_the_error_and_every_buffer_comes_back() {
        let _serial = serial();
        let t = on_device(40_000);
        let ring = Staging::Ring {
            chunk_bytes: 4096,
            depth: 3,
        }
        .ring_for_stream()
        .unwrap();
        let pool = backend_for(DEV).unwrap().pinned_pool().unwrap();
        let mut seen = Vec::new();
        let err = stream_to_sink(DEV, &[&t], ring, |bytes| {
            seen.extend_from_slice(bytes);
            if seen.len() >= 3 * 4096 {
                return Err(Error::InvalidValue {
                    key: String::new(),
                    reason: "the disk is full".into(),
                });
            }
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains("the disk is full"), "{err}");
        let expected: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
        assert_eq!(seen, expected, "the bytes before the failure, in order");
        // Chunks still queued hold their buffers until they have run, then give them back.
        for _ in 0..200 {
            let s = pool.stats();
            if s.cached_bytes == s.pinned_bytes {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let s = pool.stats();
        assert_eq!(s.cached_bytes, s.pinned_bytes, "{s:?}");
    }

    #[test]
    fn an_automatic_ring_refused_pinned_memory_streams_through_ordinary_memory() {
        use crate::backend::emulated::{configure, EmuConfig};
        let _serial = serial();
        let t = on_device(100_000);
        let pool = backend_for(DEV).unwrap().pinned_pool().unwrap();
        // Hold every cached buffer of the ring's size class, so that the ring must pin anew.
        let cached = pool.hold_cached(100_000);
        let refuse_next = |n| {
            let config = EmuConfig {
                fail_pin: Some(n),
                ..EmuConfig::default()
            };
            configure(1, config).unwrap();
        };
        refuse_next(1);
        let mut seen = Vec::new();
        let auto = Staging::Auto.ring_for_stream().unwrap();
        stream_to_sink(DEV, &[&t], auto, |bytes| {
            seen.extend_from_slice(bytes);
            Ok(())
        })
        .unwrap();
        assert_eq!(
            seen,
            t.to(Device::Cpu, false).unwrap().to_vec::<u8>().unwrap()
        );
        refuse_next(1);
        let explicit = Staging::Ring {
            chunk_bytes: 100_000,
            depth: 2,
        }
        .ring_for_stream()
        .unwrap();
        let err = stream_to_sink(DEV, &[&t], explicit, |_| Ok(())).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
        configure(1, EmuConfig::default()).unwrap();
        drop(cached);
    }

    #[test]
    fn a_ring_beyond_the_limits_is_refused_before_anything_is_copied() {
        let t = on_device(10_000);
        for (chunk_bytes, depth) in [(4096, 10_000), (1, 1_000_000_000), (1 << 31, 1)] {
            let ring = Staging::Ring { chunk_bytes, depth }
                .ring_for_stream()
                .unwrap();
            let mut called = false;
            let err = stream_to_sink(DEV, &[&t], ring, |_| {
                called = true;
                Ok(())
            })
            .unwrap_err();
            assert!(err.to_string().contains("staging"), "{err}");
            assert!(!called);
        }
    }
}
