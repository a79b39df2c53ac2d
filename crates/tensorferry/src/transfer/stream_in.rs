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

use std::sync::Arc;

use super::ring_memory::RingMemory;
use super::submit_when_ready;
use crate::backend::{Backend, CopyBatch, CopyOp, Direction, Event, Failure};
use crate::error::Result;
use crate::storage::Storage;

/// The host buffers of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamRing {
    /// Bytes of each buffer: the most one chunk may hold.
    pub chunk_bytes: usize,
    /// Buffers in the ring.
    pub depth: usize,
    /// Alignment of each buffer's start (a power of two).
    pub align: usize,
    /// `Staging::Auto` (or `Off`) chose the ring: where no pinned memory is to be had, its
    /// buffers are ordinary memory.
    pub automatic: bool,
}

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
/// `ring`: `fill(j, buffer)` writes chunk `j` into the `ring.chunk_bytes` bytes at
/// `buffer` (aligned to `ring.align`, not necessarily initialised), at least the bytes
/// `pieces[j]` names, which are then copied to the device. Returns the memory, filled,
/// once every copy has completed; the first error (of `fill` or of a copy) otherwise.
///
/// # Safety
/// Every piece must lie inside its chunk (`skip + len <= ring.chunk_bytes`) and inside the
/// memory (`dst_offset + len <= total`), no two pieces may overlap in the memory, and
/// `fill` must write at least the piece's bytes of its buffer and nothing outside the
/// buffer's `ring.chunk_bytes` bytes.
pub(crate) unsafe fn stream_to_device(
    backend: &Arc<dyn Backend>,
    total: usize,
    pieces: &[Piece],
    ring: StreamRing,
    mut fill: impl FnMut(usize, *mut u8) -> Result<()>,
) -> Result<Arc<Storage>> {
    let mut memory = backend.alloc(total)?;
    let done = Event::pending();
    memory.set_written(done.clone());
    let base = memory.as_ptr() as *mut u8;
    let dest = Arc::new(Storage::device_memory(memory));
    let memory = RingMemory::pinned_else_pageable(
        backend.pinned_pool(),
        ring.chunk_bytes,
        ring.depth.max(1).min(pieces.len()),
        ring.align,
        ring.automatic,
    );
    let outcome = memory.and_then(|memory| {
        let memory = Arc::new(memory);
        let depth = memory.depth();
        let mut queued: Vec<Event> = Vec::with_capacity(pieces.len());
        let result = (|| {
            for (j, piece) in pieces.iter().enumerate() {
                if j >= depth {
                    // The slot comes back: its last chunk's copy must be done.
                    queued[j - depth].wait()?;
                }
                fill(j, memory.slot(j))?;
                queued.push(queue(backend, &memory, j, &dest, base, piece));
            }
            Ok(())
        })();
        // Every queued copy is waited for, whatever happened: the caller may drop what
        // `fill` borrows once this returns.
        let copies = queued.iter().try_for_each(|e| e.wait());
        result.and(copies)
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

/// Queues the copy of `piece` from chunk `j`'s slot of `memory` to the device memory at
/// `base`; the copy holds the ring's memory and the destination until it completes.
fn queue(
    backend: &Arc<dyn Backend>,
    memory: &Arc<RingMemory>,
    j: usize,
    dest: &Arc<Storage>,
    base: *mut u8,
    piece: &Piece,
) -> Event {
    let event = Event::pending();
    if piece.len == 0 {
        event.complete(Ok(()));
        return event;
    }
    let batch = CopyBatch {
        direction: Direction::HostToDevice,
        ops: vec![CopyOp {
            src: memory.slot(j).wrapping_add(piece.skip),
            dst: base.wrapping_add(piece.dst_offset),
            len: piece.len,
        }],
        waits: Vec::new(),
    };
    let keep = Box::new((memory.clone(), dest.clone()));
    // Unordered: the stream's deferred batches never wait for memory nobody has seen yet,
    // and this one must not queue behind them.
    // SAFETY: the source is the piece's bytes of the chunk's slot (inside it, by
    // `stream_to_device`'s contract), written by `fill` before this and not again until
    // this copy's event completes (the producer waits for it before reusing the slot);
    // the destination is the piece's own range of the new memory, which no other piece
    // overlaps and nobody reads before the stream's event. `keep` holds both.
    unsafe { submit_when_ready(backend.clone(), batch, keep, event.clone(), false) };
    event
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::backend_for;
    use crate::device::Device;

    #[test]
    fn chunks_land_at_their_offsets_through_a_ring_smaller_than_the_data() {
        let backend = backend_for(Device::Emulated(0)).unwrap();
        let ring = StreamRing {
            chunk_bytes: 4096,
            depth: 2,
            align: 4096,
            automatic: false,
        };
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
        let fill = |j: usize, buffer: *mut u8| {
            filled.push(j);
            assert_eq!(buffer as usize % 4096, 0);
            // SAFETY: the buffer holds 4096 writable bytes, and so does the source from
            // `j * 4096` (20 480 bytes in all).
            unsafe { std::ptr::copy_nonoverlapping(source[j * 4096..].as_ptr(), buffer, 4096) };
            Ok(())
        };
        // SAFETY: the pieces lie inside their 4096-byte chunks and tile the 19 900 bytes
        // of memory; `fill` writes exactly one chunk into its buffer.
        let storage = unsafe { stream_to_device(&backend, 19_900, &pieces, ring, fill) }.unwrap();
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
        let ring = StreamRing {
            chunk_bytes: 4096,
            depth: 1,
            align: 4096,
            automatic: false,
        };
        let pieces = [Piece {
            skip: 0,
            len: 10,
            dst_offset: 0,
        }; 3];
        let pieces: Vec<Piece> = pieces
            .iter()
            .enumerate()
            .map(|(j, p)| Piece {
                dst_offset: 10 * j,
                ..*p
            })
            .collect();
        let fill = |j: usize, buffer: *mut u8| match j {
            2 => Err(crate::Error::InvalidValue {
                key: String::new(),
                reason: "the disk went away".into(),
            }),
            _ => {
                // SAFETY: the buffer holds 4096 writable bytes.
                unsafe { std::ptr::write_bytes(buffer, 1, 10) };
                Ok(())
            }
        };
        // SAFETY: three 10-byte pieces, side by side, inside 4096-byte chunks; `fill`
        // writes the first two and fails on the third.
        let err = unsafe { stream_to_device(&backend, 30, &pieces, ring, fill) }.unwrap_err();
        assert!(err.to_string().contains("the disk went away"), "{err}");
    }
}
