//! Filling new device memory from a host producer (a file being read) through a few
//! aligned, pinned host buffers, so that host memory stays bounded by the ring whatever
//! the size of what is streamed.
//!
//! The producer fills chunk `j` into buffer `j % depth`; the part of the chunk that
//! belongs on the device is queued as a copy, and the producer moves on to the next
//! buffer while it runs, waiting only when it comes back to a buffer whose copy has not
//! finished. The calling thread is the producer: the stream returns once every copy has
//! completed (or with the first error), and every queued copy holds its buffer and the
//! destination, so nothing it touches is freed or reused before it has run, whatever
//! happens to the caller.

use std::mem::MaybeUninit;
use std::sync::Arc;

use super::batch::submit_when_ready;
use super::ring::{drive, RingSteps};
use super::ring_memory::RingMemory;
use super::staging::Ring;
use crate::backend::{Backend, CopyBatch, CopyOp, Direction, Event, Failure};
use crate::error::{Error, Result};
use crate::storage::Storage;

/// What goes to the device from one chunk: `len` bytes from `skip` in its buffer, to
/// `dst_offset` in the device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Where the bytes begin in the chunk's buffer.
    pub skip: usize,
    /// Bytes copied.
    pub len: usize,
    /// Where they go in the device memory.
    pub dst_offset: usize,
}

/// Allocates `total` bytes on `backend`'s device and fills them chunk by chunk through
/// `ring`: `fill(j, buffer)` writes chunk `j` into its buffer (`ring.chunk_bytes` bytes,
/// aligned to `ring.align`, holding what they held before), at least the bytes
/// `pieces[j]` names, which are then copied to the device. Returns the memory, filled,
/// once every copy has completed; the first error otherwise (of `fill` — a panic in it
/// is an internal error of the device — or of a copy), once no copy runs any more.
///
/// Pieces must lie inside their chunk and inside the memory without overlapping: a
/// layout that does not is refused before anything is allocated.
pub(crate) fn stream_to_device(
    backend: &Arc<dyn Backend>,
    total: usize,
    pieces: &[Piece],
    ring: Ring,
    fill: impl FnMut(usize, &mut [MaybeUninit<u8>]) -> Result<()>,
) -> Result<Arc<Storage>> {
    check_pieces(total, pieces, ring.chunk_bytes)?;
    let mut memory = backend.alloc(total)?;
    let done = Event::pending();
    memory.set_written(done.clone());
    let dest = Arc::new(Storage::device_memory(memory));
    let memory = RingMemory::pinned_else_pageable(
        backend.pinned_pool(),
        ring.chunk_bytes,
        ring.depth.max(1).min(pieces.len()),
        ring.align,
        ring.automatic,
    );
    let outcome = memory.and_then(|memory| {
        let depth = memory.depth();
        let mut steps = Upload {
            backend,
            pieces,
            memory: Arc::new(memory),
            dest: &dest,
            fill,
        };
        drive(backend.device(), depth, &mut steps)
    });
    match outcome {
        Ok(()) => {
            done.complete(Ok(()));
            Ok(dest)
        }
        Err(e) => {
            done.complete(Err(Failure::from_error(backend.device(), &e)));
            Err(e)
        }
    }
}

/// Refuses pieces beyond their chunk or the memory, or overlapping in it.
fn check_pieces(total: usize, pieces: &[Piece], chunk_bytes: usize) -> Result<()> {
    let mut placed: Vec<(usize, usize)> = Vec::with_capacity(pieces.len());
    for p in pieces {
        let inside_chunk = p.skip.checked_add(p.len).is_some_and(|e| e <= chunk_bytes);
        let end = p.dst_offset.checked_add(p.len);
        if !inside_chunk || end.is_none_or(|e| e > total) {
            return Err(Error::InvalidValue {
                key: "pieces".into(),
                reason: format!(
                    "{p:?} lies outside its {chunk_bytes}-byte chunk or the {total} bytes"
                ),
            });
        }
        if p.len > 0 {
            placed.push((p.dst_offset, p.len));
        }
    }
    placed.sort_unstable();
    if let Some(w) = placed.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(Error::InvalidValue {
            key: "pieces".into(),
            reason: format!("the pieces at {} and {} overlap", w[0].0, w[1].0),
        });
    }
    Ok(())
}

/// A stream's steps: the producer fills a slot, its piece goes to the device.
struct Upload<'a, F> {
    backend: &'a Arc<dyn Backend>,
    pieces: &'a [Piece],
    memory: Arc<RingMemory>,
    dest: &'a Arc<Storage>,
    fill: F,
}

impl<F: FnMut(usize, &mut [MaybeUninit<u8>]) -> Result<()>> RingSteps for Upload<'_, F> {
    fn chunks(&self) -> usize {
        self.pieces.len()
    }

    fn fill(&mut self, j: usize) -> Result<()> {
        // SAFETY: the ring fills chunk `j`'s slot only once the copy of the chunk that
        // used it last has completed, and queues this chunk's copy only after `fill`
        // returns: nothing else touches the slot meanwhile.
        let buffer = unsafe { self.memory.slot_mut(j, 0..self.memory.slot_bytes()) };
        (self.fill)(j, buffer)
    }

    /// Queues the copy of piece `j` from its slot to the device memory; the copy holds the
    /// ring's memory and the destination until it completes.
    fn submit(&mut self, j: usize) -> Event {
        let piece = self.pieces[j];
        let event = Event::pending();
        if piece.len == 0 {
            event.complete(Ok(()));
            return event;
        }
        let batch = CopyBatch {
            direction: Direction::HostToDevice,
            ops: vec![CopyOp {
                src: self.memory.slot_address(j).wrapping_add(piece.skip),
                dst: self.dest.as_ptr().cast_mut().wrapping_add(piece.dst_offset),
                len: piece.len,
            }],
            waits: Vec::new(),
        };
        let keep = Box::new((self.memory.clone(), self.dest.clone()));
        // Unordered: the stream's deferred batches never wait for memory nobody has seen
        // yet, and this one must not queue behind them.
        // SAFETY: the source is the piece's bytes of the chunk's slot (inside it, by
        // `check_pieces`), written by `fill` before this and not again until this copy's
        // event completes (the ring waits for it before reusing the slot); the destination
        // is the piece's own range of the new memory (by `check_pieces`), which no other
        // piece overlaps and nobody reads before the stream's event. `keep` holds both.
        unsafe { submit_when_ready(self.backend.clone(), batch, keep, event.clone(), false) };
        event
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::backend_for;
    use crate::device::Device;

    /// A ring of two 4 KiB slots, smaller than the tests' data.
    fn small_ring() -> Ring {
        Ring {
            chunk_bytes: 4096,
            depth: 2,
            align: 4096,
            automatic: false,
        }
    }

    #[test]
    fn chunks_land_at_their_offsets_through_a_ring_smaller_than_the_data() {
        let backend = backend_for(Device::Emulated(0)).unwrap();
        let ring = small_ring();
        // Five chunks of a 20 000-byte "file" whose first 100 bytes are not wanted.
        let source: Vec<u8> = (0..20_480u32).map(|i| (i % 251) as u8).collect();
        let pieces: Vec<Piece> = (0..5)
            .map(|j| {
                let from = (j * 4096).max(100);
                let to = ((j + 1) * 4096).min(20_000);
                Piece {
                    skip: from - j * 4096,
                    len: to - from,
                    dst_offset: from - 100,
                }
            })
            .collect();
        let mut filled = Vec::new();
        let fill = |j: usize, buffer: &mut [MaybeUninit<u8>]| {
            filled.push(j);
            assert_eq!(buffer.as_ptr() as usize % 4096, 0);
            assert_eq!(buffer.len(), 4096);
            for (d, s) in buffer.iter_mut().zip(&source[j * 4096..]) {
                d.write(*s);
            }
            Ok(())
        };
        let storage = stream_to_device(&backend, 19_900, &pieces, ring, fill).unwrap();
        assert_eq!(filled, [0, 1, 2, 3, 4]);
        assert!(storage.is_ready());
        let t = crate::Tensor::contiguous_view(storage, 0, crate::DType::U8, vec![19_900])
            .unwrap()
            .to(Device::Cpu, false)
            .unwrap();
        assert_eq!(t.to_vec::<u8>().unwrap(), source[100..20_000]);
    }

    #[test]
    fn a_failing_producer_is_the_streams_error() {
        let backend = backend_for(Device::Emulated(0)).unwrap();
        let ring = Ring {
            depth: 1,
            ..small_ring()
        };
        let pieces = pieces_of_ten(3);
        let fill = |j: usize, buffer: &mut [MaybeUninit<u8>]| match j {
            2 => Err(crate::Error::InvalidValue {
                key: String::new(),
                reason: "the disk went away".into(),
            }),
            _ => {
                buffer[..10].fill(MaybeUninit::new(1));
                Ok(())
            }
        };
        let err = stream_to_device(&backend, 30, &pieces, ring, fill).unwrap_err();
        assert!(err.to_string().contains("the disk went away"), "{err}");
    }

    fn pieces_of_ten(n: usize) -> Vec<Piece> {
        (0..n)
            .map(|j| Piece {
                skip: 0,
                len: 10,
                dst_offset: 10 * j,
            })
            .collect()
    }

    #[test]
    fn a_producer_that_panics_is_an_internal_error_of_the_device_not_a_panic() {
        let backend = backend_for(Device::Emulated(0)).unwrap();
        let ring = small_ring();
        let fill = |j: usize, buffer: &mut [MaybeUninit<u8>]| {
            if j == 3 {
                panic!("the producer has a bug");
            }
            buffer[..10].fill(MaybeUninit::new(j as u8));
            Ok(())
        };
        let err = stream_to_device(&backend, 60, &pieces_of_ten(6), ring, fill).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("emu:0") && msg.contains("internal error: the producer has a bug"),
            "{msg}"
        );
    }

    #[test]
    fn pieces_outside_their_chunk_or_overlapping_are_refused_before_anything_runs() {
        let backend = backend_for(Device::Emulated(0)).unwrap();
        let ring = small_ring();
        let mut called = false;
        let mut fill = |_: usize, _: &mut [MaybeUninit<u8>]| {
            called = true;
            Ok(())
        };
        let mut beyond_chunk = pieces_of_ten(2);
        beyond_chunk[1].skip = 4090;
        let mut overlapping = pieces_of_ten(2);
        overlapping[1].dst_offset = 5;
        for (total, pieces) in [
            (20, beyond_chunk),
            (20, overlapping),
            (15, pieces_of_ten(2)),
        ] {
            let err = stream_to_device(&backend, total, &pieces, ring, &mut fill).unwrap_err();
            assert!(matches!(err, Error::InvalidValue { .. }), "{err}");
        }
        assert!(!called);
    }
}
