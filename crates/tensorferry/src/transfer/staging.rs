//! The staging ring: copies between a device and ordinary (pageable) host memory through
//! a few pinned buffers, so that the device always copies to or from pinned memory (at
//! the bus's speed) while host threads move the previous chunk between the pinned buffer
//! and its destination (or the next chunk from its sources), at the same time.
//!
//! The packed layout is cut into chunks of `chunk_bytes`; chunk `j` uses pinned buffer
//! `j % depth`. Device → host: the first `depth` chunks are queued at once; each time one
//! completes, the host copies it out and queues the chunk that reuses its buffer. Host →
//! device: the host fills a buffer, queues its chunk, and moves on to the next buffer,
//! waiting only when it comes back to one whose chunk has not finished. A staging thread
//! drives each transfer and completes the transfer's event after the last chunk;
//! every queued chunk holds its pinned buffer and its sources, so nothing it touches can
//! be freed or reused before it has run, whatever happens to the staging thread.

use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use super::{runs, submit_when_ready, Run};
use crate::backend::{Backend, CopyBatch, CopyOp, Direction, Event};
use crate::consolidate::PackedLayout;
use crate::error::{Error, Result};
use crate::memory::PinnedBuffer;
use crate::storage::Storage;
use crate::tensor::Tensor;

/// Chunk size of the automatic ring.
pub const AUTO_CHUNK_BYTES: usize = 32 << 20;
/// Pinned buffers of the automatic ring.
pub const AUTO_DEPTH: usize = 3;
/// Smallest transfer the automatic ring is used for.
pub const AUTO_MIN_BYTES: usize = 64 << 20;

/// Whether copies between a device and ordinary host memory go through pinned staging
/// buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Staging {
    /// Where the device copies faster from pinned memory (CUDA) and the transfer is at
    /// least [`AUTO_MIN_BYTES`]: a ring of [`AUTO_DEPTH`] buffers of [`AUTO_CHUNK_BYTES`].
    #[default]
    Auto,
    /// Never: the device copies straight to or from ordinary memory.
    Off,
    /// Always (for host memory that is not pinned already), through `depth` pinned
    /// buffers of `chunk_bytes` each.
    Ring {
        /// Bytes per chunk (and per pinned buffer).
        chunk_bytes: usize,
        /// Pinned buffers in the ring.
        depth: usize,
    },
}

/// The ring a transfer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ring {
    chunk_bytes: usize,
    depth: usize,
}

impl Staging {
    /// The ring for a transfer of `total` bytes on `backend`, or `None` to copy directly.
    pub(crate) fn ring_for(self, backend: &dyn Backend, total: usize) -> Option<Ring> {
        match self {
            Staging::Off => None,
            Staging::Auto => (backend.prefers_pinned_staging() && total >= AUTO_MIN_BYTES)
                .then_some(Ring {
                    chunk_bytes: AUTO_CHUNK_BYTES,
                    depth: AUTO_DEPTH,
                }),
            Staging::Ring { chunk_bytes, depth } => Some(Ring {
                chunk_bytes: chunk_bytes.max(1),
                depth: depth.max(1),
            }),
        }
    }
}

/// One chunk: the packed range `[start, start + len)` and the runs (cut at its edges)
/// that land in it.
struct Chunk {
    start: usize,
    pieces: Vec<Run>,
}

/// Cuts `runs` (in packed order) at every multiple of `chunk_bytes`.
fn chunks(runs: &[Run], chunk_bytes: usize) -> Vec<Chunk> {
    let mut out: Vec<Chunk> = Vec::new();
    for r in runs {
        let mut done = 0;
        while done < r.len {
            let at = r.dst_offset + done;
            let index = at / chunk_bytes;
            let room = (index + 1) * chunk_bytes - at;
            let len = room.min(r.len - done);
            if out.last().is_none_or(|c| c.start != index * chunk_bytes) {
                out.push(Chunk {
                    start: index * chunk_bytes,
                    pieces: Vec::new(),
                });
            }
            out.last_mut().expect("pushed").pieces.push(Run {
                src: r.src.wrapping_add(done),
                dst_offset: at,
                len,
            });
            done += len;
        }
    }
    out
}

/// The packed ranges a chunk's pieces cover, adjacent ones merged: `(offset, len)`.
fn covered(chunk: &Chunk) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for p in &chunk.pieces {
        match out.last_mut() {
            Some((at, len)) if *at + *len == p.dst_offset => *len += p.len,
            _ => out.push((p.dst_offset, p.len)),
        }
    }
    out
}

/// A host copy of `len` bytes.
#[derive(Clone, Copy)]
struct Span {
    src: *const u8,
    dst: *mut u8,
    len: usize,
}
// SAFETY: plain addresses; `Crew::copy`'s contract says when they may be used.
unsafe impl Send for Span {}

/// Host threads that copy the spans of a chunk together, started once per transfer.
struct Crew {
    workers: Vec<Sender<Vec<Span>>>,
    done: std::sync::mpsc::Receiver<()>,
}

impl Crew {
    /// Copies `spans`, split into about equal shares, one per thread (this one included).
    ///
    /// # Safety
    /// Every span's source must be readable and destination writable for `len` bytes, and
    /// no destination may overlap another span or any source.
    unsafe fn copy(&self, spans: &[Span]) {
        let shares = split(spans, self.workers.len() + 1);
        let mut sent = 0;
        for (worker, share) in self.workers.iter().zip(shares.iter().skip(1)) {
            if !share.is_empty() && worker.send(share.clone()).is_ok() {
                sent += 1;
            }
        }
        // SAFETY: forwarded contract.
        unsafe { copy_spans(&shares[0]) };
        for _ in 0..sent {
            let _ = self.done.recv();
        }
    }
}

/// # Safety
/// As [`Crew::copy`].
unsafe fn copy_spans(spans: &[Span]) {
    for s in spans {
        // SAFETY: the caller's contract: valid, non-overlapping ranges.
        unsafe { std::ptr::copy_nonoverlapping(s.src, s.dst, s.len) };
    }
}

/// `spans` cut into `n` shares of about equal bytes (a span may be cut in two).
fn split(spans: &[Span], n: usize) -> Vec<Vec<Span>> {
    let total: usize = spans.iter().map(|s| s.len).sum();
    let share = total.div_ceil(n.max(1)).max(1);
    let mut out = vec![Vec::new()];
    let mut room = share;
    for s in spans {
        let mut s = *s;
        while s.len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = share;
            }
            let len = s.len.min(room);
            out.last_mut().expect("one share").push(Span { len, ..s });
            s.src = s.src.wrapping_add(len);
            s.dst = s.dst.wrapping_add(len);
            s.len -= len;
            room -= len;
        }
    }
    out.resize(n.max(1), Vec::new());
    out
}

/// Runs `f` with a crew of `threads` (the calling thread is one of them).
fn with_crew<R>(threads: usize, f: impl FnOnce(&Crew) -> R) -> R {
    std::thread::scope(|scope| {
        let (done_tx, done) = channel();
        let workers = (1..threads.max(1))
            .map(|_| {
                let (tx, rx) = channel::<Vec<Span>>();
                let done_tx = done_tx.clone();
                scope.spawn(move || {
                    for share in rx {
                        // SAFETY: `Crew::copy`'s contract, passed on with the share.
                        unsafe { copy_spans(&share) };
                        let _ = done_tx.send(());
                    }
                });
                tx
            })
            .collect();
        f(&Crew { workers, done })
    })
}

/// What one staged transfer needs on its thread.
struct Transfer {
    backend: Arc<dyn Backend>,
    chunks: Vec<Chunk>,
    waits: Vec<Event>,
    buffers: Vec<Arc<PinnedBuffer>>,
    sources: Arc<Vec<Tensor>>,
    dest: Arc<Storage>,
    base: *mut u8,
}

// SAFETY: the raw addresses in `chunks` and `base` name memory that the transfer itself
// holds (`sources`, `dest`, `buffers`), so they stay valid on whichever thread owns it.
unsafe impl Send for Transfer {}

impl Transfer {
    fn prepare(
        backend: Arc<dyn Backend>,
        ring: Ring,
        sources: Vec<Tensor>,
        layout: &PackedLayout,
        dest: Arc<Storage>,
        base: *mut u8,
    ) -> Result<Transfer> {
        let (runs, waits) = runs(&sources, layout)?;
        let chunks = chunks(&runs, ring.chunk_bytes);
        let pool = backend.pinned_pool()?;
        // A transfer smaller than a chunk needs no more than its own size.
        let buffer_bytes = ring.chunk_bytes.min(layout.total);
        let buffers = (0..ring.depth.min(chunks.len()))
            .map(|_| pool.take(buffer_bytes).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(Transfer {
            backend,
            chunks,
            waits,
            buffers,
            sources: Arc::new(sources),
            dest,
            base,
        })
    }

    /// Queues chunk `j`'s device copies; the batch holds its pinned buffer and the sources.
    fn queue(&self, j: usize, direction: Direction, ops: Vec<CopyOp>) -> Event {
        let buffer = self.buffers[j % self.buffers.len()].clone();
        let batch = CopyBatch {
            direction,
            ops,
            waits: self.waits.clone(),
        };
        let event = Event::pending();
        let keep = Box::new((self.sources.clone(), buffer, self.dest.clone()));
        // SAFETY: the ops address the sources (held by `keep`), the chunk's pinned buffer
        // (held by `keep`; only this chunk uses it until its event completes, since the
        // staging thread waits for that before reusing it) and the destination (held by
        // `keep`, written only at this chunk's own packed range).
        unsafe { submit_when_ready(self.backend.clone(), batch, keep, event.clone()) };
        event
    }

    fn device_name(&self) -> String {
        self.backend.device().to_string()
    }

    /// Device → host.
    fn run_to_host(&self, crew: &Crew) -> Result<()> {
        let n = self.chunks.len();
        let depth = self.buffers.len();
        let queue_chunk = |j: usize| {
            let c = &self.chunks[j];
            let staging = self.buffers[j % depth].as_ptr();
            let ops = c
                .pieces
                .iter()
                .map(|p| CopyOp {
                    src: p.src,
                    dst: staging.wrapping_add(p.dst_offset - c.start),
                    len: p.len,
                })
                .collect();
            self.queue(j, Direction::DeviceToHost, ops)
        };
        let mut events: Vec<Event> = (0..depth.min(n)).map(queue_chunk).collect();
        for j in 0..n {
            events[j].wait(&self.device_name())?;
            let c = &self.chunks[j];
            let staging = self.buffers[j % depth].as_ptr();
            let spans: Vec<Span> = covered(c)
                .into_iter()
                .map(|(at, len)| Span {
                    src: staging.wrapping_add(at - c.start),
                    dst: self.base.wrapping_add(at),
                    len,
                })
                .collect();
            // SAFETY: the chunk's copy completed (its event), so its pinned buffer holds
            // the bytes and nothing writes it until this thread queues its next chunk;
            // the spans cover disjoint ranges of the destination, which `self.dest` holds
            // and nobody reads before the transfer's event.
            unsafe { crew.copy(&spans) };
            if j + depth < n {
                events.push(queue_chunk(j + depth));
            }
        }
        Ok(())
    }

    /// Host → device.
    fn run_to_device(&self, crew: &Crew) -> Result<()> {
        for w in &self.waits {
            w.wait(&self.device_name())?;
        }
        let depth = self.buffers.len();
        let mut events: Vec<Event> = Vec::with_capacity(self.chunks.len());
        for (j, c) in self.chunks.iter().enumerate() {
            if j >= depth {
                events[j - depth].wait(&self.device_name())?;
            }
            let staging = self.buffers[j % depth].as_ptr();
            let spans: Vec<Span> = c
                .pieces
                .iter()
                .map(|p| Span {
                    src: p.src,
                    dst: staging.wrapping_add(p.dst_offset - c.start),
                    len: p.len,
                })
                .collect();
            // SAFETY: the sources are filled (their events waited for above) and held by
            // `self.sources`; the pinned buffer is free (the chunk that used it last has
            // completed); pieces of one chunk land on disjoint ranges of it.
            unsafe { crew.copy(&spans) };
            let ops = covered(c)
                .into_iter()
                .map(|(at, len)| CopyOp {
                    src: staging.wrapping_add(at - c.start),
                    dst: self.base.wrapping_add(at),
                    len,
                })
                .collect();
            events.push(self.queue(j, Direction::HostToDevice, ops));
        }
        for e in &events {
            e.wait(&self.device_name())?;
        }
        Ok(())
    }
}

/// Runs one transfer through `ring` on a staging thread of its own, which completes
/// `event` when done: device → ordinary host memory, or ordinary host memory → a device,
/// as `direction` says, into the memory at `base` (inside `dest`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn start(
    backend: Arc<dyn Backend>,
    ring: Ring,
    direction: Direction,
    sources: Vec<Tensor>,
    layout: &PackedLayout,
    dest: Arc<Storage>,
    base: *mut u8,
    event: &Event,
) -> Result<()> {
    let transfer = Transfer::prepare(backend, ring, sources, layout, dest, base)?;
    let event = event.clone();
    let threads = crate::consolidate::threads_for(ring.chunk_bytes);
    std::thread::Builder::new()
        .name("tensorferry-staging".into())
        .spawn(move || {
            let outcome = with_crew(threads, |crew| match direction {
                Direction::DeviceToHost => transfer.run_to_host(crew),
                _ => transfer.run_to_device(crew),
            });
            drop(transfer); // buffers back to the pool before anyone is woken
            event.complete(outcome.map_err(|e| e.to_string()));
        })
        .map(|_| ())
        .map_err(|e| Error::DeviceUnavailable {
            device: "cpu".into(),
            reason: format!("cannot start a staging thread: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(dst_offset: usize, len: usize) -> Run {
        Run {
            src: std::ptr::null::<u8>().wrapping_add(1000 + dst_offset),
            dst_offset,
            len,
        }
    }

    #[test]
    fn runs_are_cut_at_chunk_edges_and_keep_their_source_offsets() {
        let cs = chunks(&[run(0, 10), run(64, 100), run(192, 8)], 50);
        let starts: Vec<usize> = cs.iter().map(|c| c.start).collect();
        assert_eq!(starts, [0, 50, 100, 150]);
        let all: Vec<(usize, usize, usize)> = cs
            .iter()
            .flat_map(|c| c.pieces.iter())
            .map(|p| (p.dst_offset, p.len, p.src as usize - 1000))
            .collect();
        assert_eq!(
            all,
            [
                (0, 10, 0),
                (64, 36, 64),
                (100, 50, 100),
                (150, 14, 150),
                (192, 8, 192)
            ]
        );
        assert_eq!(covered(&cs[0]), [(0, 10)]);
    }

    #[test]
    fn shares_cover_every_byte_once_in_about_equal_parts() {
        let spans = [
            Span {
                src: std::ptr::null(),
                dst: std::ptr::null_mut::<u8>().wrapping_add(0),
                len: 7,
            },
            Span {
                src: std::ptr::null(),
                dst: std::ptr::null_mut::<u8>().wrapping_add(100),
                len: 5,
            },
        ];
        let shares = split(&spans, 3);
        assert_eq!(shares.len(), 3);
        let sizes: Vec<usize> = shares
            .iter()
            .map(|s| s.iter().map(|x| x.len).sum())
            .collect();
        assert_eq!(sizes, [4, 4, 4]);
        let mut covered: Vec<usize> = shares
            .iter()
            .flatten()
            .flat_map(|s| (0..s.len).map(move |i| s.dst as usize + i))
            .collect();
        covered.sort();
        let expected: Vec<usize> = (0..7).chain(100..105).collect();
        assert_eq!(covered, expected);
    }
}
