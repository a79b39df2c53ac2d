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
//! drives each transfer and completes the transfer's event after the last chunk (or with
//! the first failure, a panic included); every queued chunk holds its pinned buffer and
//! its sources, so nothing it touches can be freed or reused before it has run, whatever
//! happens to the staging thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use super::ring_memory::RingMemory;
use super::{runs, submit_when_ready, Run};
use crate::backend::event::{panic_message, Outcome, Progress};
use crate::backend::worker::spawn_worker;
use crate::backend::{Backend, CopyBatch, CopyOp, Direction, Event, Failure};
use crate::consolidate::PackedLayout;
use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::tensor::Tensor;

/// Chunk size of the automatic ring.
pub const AUTO_CHUNK_BYTES: usize = 32 << 20;
/// Pinned buffers of the automatic ring.
pub const AUTO_DEPTH: usize = 3;
/// Smallest transfer the automatic ring is used for.
pub const AUTO_MIN_BYTES: usize = 64 << 20;
/// Most host threads copying a chunk, whatever `TENSORFERRY_COPY_THREADS` asks.
const MAX_CREW_THREADS: usize = 64;

/// Smallest chunk a [`Staging::Ring`] takes: a chunk is one device copy, and smaller ones
/// cost more in calls than they move.
pub const MIN_CHUNK_BYTES: usize = 4 << 10;
/// Largest chunk a [`Staging::Ring`] takes.
pub const MAX_CHUNK_BYTES: usize = 1 << 30;
/// Most buffers a [`Staging::Ring`] takes.
pub const MAX_DEPTH: usize = 64;
/// Most bytes a [`Staging::Ring`] takes in all (`chunk_bytes × depth`).
pub const MAX_RING_BYTES: usize = 4 << 30;

/// The limits of a ring, as error messages state them.
pub const RING_LIMITS: &str = "a staging ring takes chunk_bytes from 4096 (4 KiB) to \
     1073741824 (1 GiB), depth from 1 to 64, and chunk_bytes × depth up to 4294967296 (4 GiB)";

/// Whether copies between a device and ordinary host memory go through pinned staging
/// buffers.
///
/// ```
/// use tensorferry::Staging;
///
/// assert_eq!(Staging::default(), Staging::Auto);
/// assert!(Staging::Ring { chunk_bytes: 1 << 20, depth: 4 }.validate().is_ok());
/// assert!(Staging::Ring { chunk_bytes: 1, depth: 4 }.validate().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Staging {
    /// Where the device copies faster from pinned memory (CUDA) and the transfer is at
    /// least [`AUTO_MIN_BYTES`]: a ring of [`AUTO_DEPTH`] buffers of [`AUTO_CHUNK_BYTES`];
    /// there also for a smaller non-blocking transfer, so that the call never waits for
    /// the GPU (a ring of two buffers of at most [`AUTO_CHUNK_BYTES`]).
    #[default]
    Auto,
    /// Never: the device copies straight to or from ordinary memory.
    Off,
    /// Always (for host memory that is not pinned already), through `depth` pinned
    /// buffers of `chunk_bytes` each: within [`MIN_CHUNK_BYTES`]..=[`MAX_CHUNK_BYTES`],
    /// `1..=`[`MAX_DEPTH`] and [`MAX_RING_BYTES`] in all, else refused
    /// ([`Staging::validate`]). Small chunks share pinned buffers, so a ring pins at most
    /// twice `chunk_bytes × depth` (the pool's size classes are powers of two), and at
    /// least 64 KiB.
    Ring {
        /// Bytes per chunk (and per pinned buffer).
        chunk_bytes: usize,
        /// Pinned buffers in the ring.
        depth: usize,
    },
}

/// The ring a transfer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ring {
    chunk_bytes: usize,
    depth: usize,
    /// `Staging::Auto` chose it: a ring that cannot be set up, or one beyond
    /// [`MAX_AUTO_RINGS`], leaves the transfer to a direct batch instead.
    automatic: bool,
}

impl Staging {
    /// `self`, when it is `Auto`, `Off`, or a `Ring` within the limits ([`RING_LIMITS`]);
    /// else an [`Error::InvalidValue`] at key `staging` naming the value out of range.
    /// Every call that takes a `Staging` checks it before allocating anything.
    ///
    /// ```
    /// use tensorferry::Staging;
    /// assert!(Staging::Ring { chunk_bytes: 1 << 20, depth: 4 }.validate().is_ok());
    /// let err = Staging::Ring { chunk_bytes: 4096, depth: 10_000 }.validate().unwrap_err();
    /// assert!(err.to_string().contains("depth=10000"), "{err}");
    /// ```
    pub fn validate(self) -> Result<Staging> {
        if let Staging::Ring { chunk_bytes, depth } = self {
            check_ring(chunk_bytes, depth)?;
        }
        Ok(self)
    }

    /// The ring for a transfer of `total` bytes on `backend`, or `None` to copy directly.
    ///
    /// With `Auto`, a `non_blocking` transfer on such a device takes a ring whatever its
    /// size: the driver's own copies between a GPU and ordinary memory hold the calling
    /// thread (a download until it is done, an upload until the stream's earlier work is),
    /// which would make the call wait for the GPU; through the ring the GPU's copies are to
    /// and from pinned memory, queued without waiting, and host threads do the rest.
    pub(crate) fn ring_for(
        self,
        backend: &dyn Backend,
        total: usize,
        non_blocking: bool,
    ) -> Option<Ring> {
        match self {
            Staging::Off => None,
            Staging::Auto if !backend.prefers_pinned_staging() || total == 0 => None,
            Staging::Auto if total >= AUTO_MIN_BYTES => Some(Ring {
                chunk_bytes: AUTO_CHUNK_BYTES,
                depth: AUTO_DEPTH,
                automatic: true,
            }),
            Staging::Auto => non_blocking.then_some(Ring {
                chunk_bytes: total.min(AUTO_CHUNK_BYTES),
                depth: 2,
                automatic: true,
            }),
            Staging::Ring { chunk_bytes, depth } => Some(Ring {
                chunk_bytes: chunk_bytes.max(1),
                depth: depth.max(1),
                automatic: false,
            }),
        }
    }

    /// The ring that streams device memory out to a consumer (a file being written),
    /// whatever the device and size — host memory stays bounded by it —, or `None` when
    /// `Off` (the tensors are copied to the host whole first).
    pub(crate) fn ring_for_stream(self) -> Option<Ring> {
        match self {
            Staging::Off => None,
            Staging::Auto => Some(Ring {
                chunk_bytes: AUTO_CHUNK_BYTES,
                depth: AUTO_DEPTH,
                automatic: true,
            }),
            Staging::Ring { chunk_bytes, depth } => Some(Ring {
                chunk_bytes: chunk_bytes.max(1),
                depth: depth.max(1),
                automatic: false,
            }),
        }
    }
}

/// Refuses a ring of `depth` buffers of `chunk_bytes` beyond the limits.
fn check_ring(chunk_bytes: usize, depth: usize) -> Result<()> {
    let why = if !(MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(&chunk_bytes) {
        format!("chunk_bytes={chunk_bytes} is out of range")
    } else if !(1..=MAX_DEPTH).contains(&depth) {
        format!("depth={depth} is out of range")
    } else if chunk_bytes.saturating_mul(depth) > MAX_RING_BYTES {
        format!(
            "chunk_bytes × depth = {} bytes is too much",
            chunk_bytes.saturating_mul(depth)
        )
    } else {
        return Ok(());
    };
    Err(Error::InvalidValue {
        key: "staging".into(),
        reason: format!("({chunk_bytes}, {depth}): {why}: {RING_LIMITS}"),
    })
}

impl Ring {
    /// The ring's own limits ([`Staging::validate`]); the automatic rings are within them.
    pub(crate) fn validate(self) -> Result<Ring> {
        if !self.automatic {
            check_ring(self.chunk_bytes, self.depth)?;
        }
        Ok(self)
    }

    /// True when `Staging::Auto` chose the ring: one that cannot get pinned memory copies
    /// through ordinary memory instead.
    pub(crate) fn automatic(self) -> bool {
        self.automatic
    }

    /// Bytes per chunk (and per pinned buffer).
    pub(crate) fn chunk_bytes(self) -> usize {
        self.chunk_bytes
    }

    /// Pinned buffers in the ring.
    pub(crate) fn depth(self) -> usize {
        self.depth
    }
}

/// One chunk: the packed range from `start` and the runs (cut at its edges) that land
/// in it.
pub(super) struct Chunk {
    pub(super) start: usize,
    pub(super) pieces: Vec<Run>,
}

impl Chunk {
    /// The end of the last run in the chunk.
    pub(super) fn end(&self) -> usize {
        self.pieces
            .last()
            .map_or(self.start, |p| p.dst_offset + p.len)
    }

    /// The device copies of the chunk's runs into the pinned buffer at `staging`, each at
    /// its offset from the chunk's start.
    pub(super) fn ops_into(&self, staging: *mut u8) -> Vec<CopyOp> {
        self.pieces
            .iter()
            .map(|p| CopyOp {
                src: p.src,
                dst: staging.wrapping_add(p.dst_offset - self.start),
                len: p.len,
            })
            .collect()
    }
}

/// Cuts `runs` (in packed order) at every multiple of `chunk_bytes`.
pub(super) fn chunks(runs: &[Run], chunk_bytes: usize) -> Vec<Chunk> {
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

/// How a crew copies one share of spans (the real copy, or a stand-in in tests).
///
/// # Safety
/// As [`Crew::copy`].
type CopyShare = unsafe fn(&[Span]);

/// Host threads that copy the spans of a chunk together, started once per transfer.
struct Crew {
    workers: Vec<Sender<Vec<Span>>>,
    done: Receiver<std::result::Result<(), String>>,
    copy_share: CopyShare,
}

impl Crew {
    /// Copies every span, the calling thread taking one share. Returns only when every
    /// share is done (or its thread has gone); a panic while copying comes back as its
    /// message.
    ///
    /// # Safety
    /// Every span's source must be readable and destination writable for `len` bytes, and
    /// no destination may overlap another span or any source.
    unsafe fn copy(&self, spans: &[Span]) -> std::result::Result<(), String> {
        let shares = split(spans, self.workers.len() + 1);
        let mut sent = 0;
        for (worker, share) in self.workers.iter().zip(shares.iter().skip(1)) {
            if !share.is_empty() && worker.send(share.clone()).is_ok() {
                sent += 1;
            }
        }
        let copy_share = self.copy_share;
        // SAFETY: forwarded contract.
        let mut outcome = catch_unwind(AssertUnwindSafe(|| unsafe { copy_share(&shares[0]) }))
            .map_err(|p| panic_message(&*p));
        // Every share sent is waited for, whatever happened here: the spans address memory
        // the caller may release once this returns.
        for _ in 0..sent {
            let reply = self
                .done
                .recv()
                .unwrap_or_else(|_| Err("a copy thread has stopped".into()));
            outcome = outcome.and(reply);
        }
        outcome
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

/// Runs `f` with a crew of `threads` (the calling thread is one of them) that copies
/// shares with `copy_share`. A worker that panics reports it and goes on serving.
fn with_crew<R>(threads: usize, copy_share: CopyShare, f: impl FnOnce(&Crew) -> R) -> R {
    std::thread::scope(|scope| {
        let (done_tx, done) = channel();
        let workers = (1..threads.max(1))
            .map(|_| {
                let (tx, rx) = channel::<Vec<Span>>();
                let done_tx = done_tx.clone();
                scope.spawn(move || {
                    for share in rx {
                        // SAFETY: `Crew::copy`'s contract, passed on with the share.
                        let copied =
                            catch_unwind(AssertUnwindSafe(|| unsafe { copy_share(&share) }));
                        let _ = done_tx.send(copied.map_err(|p| panic_message(&*p)));
                    }
                });
                tx
            })
            .collect();
        // Only the workers hold senders now: should they all be gone, `recv` says so
        // instead of blocking.
        drop(done_tx);
        f(&Crew {
            workers,
            done,
            copy_share,
        })
    })
}

/// What one staged transfer needs on its thread.
struct Transfer {
    backend: Arc<dyn Backend>,
    chunks: Vec<Chunk>,
    waits: Vec<Event>,
    ring: Arc<RingMemory>,
    sources: Arc<Vec<Tensor>>,
    dest: Arc<Storage>,
    base: *mut u8,
}

// SAFETY: the raw addresses in `chunks` and `base` name memory that the transfer itself
// holds (`sources`, `dest`, `ring`), so they stay valid on whichever thread owns it.
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
        let slot_bytes = ring.chunk_bytes.min(layout.total);
        let depth = ring.depth.min(chunks.len());
        let ring = RingMemory::pinned(&pool, slot_bytes, depth, 1)?;
        Ok(Transfer {
            backend,
            chunks,
            waits,
            ring: Arc::new(ring),
            sources: Arc::new(sources),
            dest,
            base,
        })
    }

    /// Queues chunk `j`'s device copies; the batch holds the ring's memory and the sources.
    fn queue(&self, direction: Direction, ops: Vec<CopyOp>) -> Event {
        let batch = CopyBatch {
            direction,
            ops,
            waits: self.waits.clone(),
        };
        let event = Event::pending();
        let keep = Box::new((self.sources.clone(), self.ring.clone(), self.dest.clone()));
        // Unordered: a deferred batch of the stream may be waiting for this very transfer.
        // SAFETY: the ops address the sources (held by `keep`), the chunk's slot of the
        // ring (held by `keep`; only this chunk uses it until its event completes, since the
        // staging thread waits for that before reusing it) and the destination (held by
        // `keep`, written only at this chunk's own packed range).
        unsafe { submit_when_ready(self.backend.clone(), batch, keep, event.clone(), false) };
        event
    }

    /// A crew's copy, with a panic in it as an internal failure of this transfer's device.
    ///
    /// # Safety
    /// As [`Crew::copy`].
    unsafe fn copy(&self, crew: &Crew, spans: &[Span]) -> Outcome {
        // SAFETY: forwarded contract.
        unsafe { crew.copy(spans) }.map_err(|panic| {
            Failure::new(self.backend.device(), format!("internal error: {panic}"))
        })
    }

    /// Device → host.
    fn run_to_host(&self, crew: &Crew) -> Outcome {
        let n = self.chunks.len();
        let depth = self.ring.depth();
        let queue_chunk = |j: usize| {
            let ops = self.chunks[j].ops_into(self.ring.slot(j));
            self.queue(Direction::DeviceToHost, ops)
        };
        let mut events: Vec<Event> = (0..depth.min(n)).map(queue_chunk).collect();
        for j in 0..n {
            events[j].wait_outcome()?;
            let c = &self.chunks[j];
            let staging = self.ring.slot(j);
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
            unsafe { self.copy(crew, &spans) }?;
            if j + depth < n {
                events.push(queue_chunk(j + depth));
            }
        }
        Ok(())
    }

    /// Host → device. Once the last chunk is queued on the GPU (behind every other chunk,
    /// on the same stream), its CUDA event marks `event` too: a consumer's stream can then
    /// be ordered after the whole transfer on the GPU instead of waiting on the host.
    fn run_to_device(&self, crew: &Crew, event: &Event) -> Outcome {
        for w in &self.waits {
            w.wait_outcome()?;
        }
        let depth = self.ring.depth();
        let mut events: Vec<Event> = Vec::with_capacity(self.chunks.len());
        for (j, c) in self.chunks.iter().enumerate() {
            if j >= depth {
                events[j - depth].wait_outcome()?;
            }
            let staging = self.ring.slot(j);
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
            unsafe { self.copy(crew, &spans) }?;
            let ops = covered(c)
                .into_iter()
                .map(|(at, len)| CopyOp {
                    src: staging.wrapping_add(at - c.start),
                    dst: self.base.wrapping_add(at),
                    len,
                })
                .collect();
            events.push(self.queue(Direction::HostToDevice, ops));
        }
        // Only when every chunk is on the GPU (or done) without a failure: a consumer
        // ordered behind the mark must not read a range whose copy failed, whose error it
        // would never see; otherwise it waits for the outcome on the host.
        let all_queued = events
            .iter()
            .all(|e| matches!(e.progress(), Progress::Queued(_) | Progress::Done(Ok(()))));
        if all_queued {
            if let Some(Progress::Queued(mark)) = events.last().map(Event::progress) {
                event.set_mark(mark);
            }
        }
        for e in &events {
            e.wait_outcome()?;
        }
        Ok(())
    }
}

/// Runs one transfer through `ring` on a staging thread of its own, which completes
/// `event` when done: device → ordinary host memory, or ordinary host memory → a device,
/// as `direction` says, into the memory at `base` (inside `dest`). A ring `Staging::Auto`
/// chose that cannot be set up (no pinned memory) leaves the transfer to one direct batch.
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
    let fall_back = ring.automatic;
    let direct = |sources: Vec<Tensor>, dest: Arc<Storage>| -> Result<()> {
        let batch = super::plan(direction, &sources, layout, base)?;
        super::submit(&backend, batch, sources, dest, event);
        Ok(())
    };
    // Where staging was the automatic choice, at most `MAX_AUTO_RINGS` run at once (each
    // has a thread and pinned buffers): many small non-blocking moves in a row copy
    // directly beyond that, as they would without the ring.
    let slot = match fall_back.then(AutoRing::take) {
        Some(None) => return direct(sources, dest),
        Some(Some(slot)) => Some(slot),
        None => None,
    };
    let retry = fall_back.then(|| (sources.clone(), dest.clone()));
    let transfer = match Transfer::prepare(backend.clone(), ring, sources, layout, dest, base) {
        Ok(transfer) => transfer,
        // No pinned memory for the ring (a locked-memory limit, say): where staging was
        // the automatic choice, the device copies straight from or to ordinary memory.
        Err(_) if retry.is_some() => {
            let (sources, dest) = retry.expect("checked");
            return direct(sources, dest);
        }
        Err(e) => return Err(e),
    };
    let device = transfer.backend.device();
    let threads = crate::consolidate::threads_for(ring.chunk_bytes).min(MAX_CREW_THREADS);
    let marked = event.clone();
    spawn_worker("tensorferry-staging", device, event.clone(), move || {
        let outcome = with_crew(threads, copy_spans, |crew| match direction {
            Direction::DeviceToHost => transfer.run_to_host(crew),
            _ => transfer.run_to_device(crew, &marked),
        });
        drop(transfer); // the ring back to the pool before anyone is woken
        drop(slot);
        outcome
    })
}

/// The most rings `Staging::Auto` runs at once.
pub(crate) const MAX_AUTO_RINGS: usize = 8;

/// One of the [`MAX_AUTO_RINGS`] places; given back when dropped.
struct AutoRing;

static AUTO_RINGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl AutoRing {
    fn take() -> Option<AutoRing> {
        use std::sync::atomic::Ordering;
        AUTO_RINGS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_AUTO_RINGS).then_some(n + 1)
            })
            .ok()
            .map(|_| AutoRing)
    }
}

impl Drop for AutoRing {
    fn drop(&mut self) {
        AUTO_RINGS.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
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
    fn rings_within_the_limits_are_kept_and_the_rest_refused_naming_the_value() {
        let ring = |chunk_bytes, depth| Staging::Ring { chunk_bytes, depth }.validate();
        for (chunk, depth) in [(4096, 1), (4096, 64), (1 << 30, 4), (32 << 20, 3)] {
            assert_eq!(
                ring(chunk, depth).unwrap(),
                Staging::Ring {
                    chunk_bytes: chunk,
                    depth
                }
            );
        }
        for (chunk, depth, named) in [
            (4095, 1, "chunk_bytes=4095"),
            (1, 1_000_000_000, "chunk_bytes=1"),
            ((1 << 30) + 1, 1, "chunk_bytes=1073741825"),
            (4096, 0, "depth=0"),
            (4096, 65, "depth=65"),
            (4096, 10_000, "depth=10000"),
            (1 << 30, 5, "5368709120 bytes"),
        ] {
            let err = ring(chunk, depth).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidValue { key, reason }
                    if key == "staging" && reason.contains(named) && reason.contains(RING_LIMITS)),
                "{err}"
            );
        }
        assert_eq!(Staging::Auto.validate().unwrap(), Staging::Auto);
        assert_eq!(Staging::Off.validate().unwrap(), Staging::Off);
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

    /// A stand-in for the real copy: panics on shares whose first span is 13 bytes long.
    unsafe fn copy_or_panic(spans: &[Span]) {
        if spans.first().is_some_and(|s| s.len == 13) {
            panic!("a copy thread fails");
        }
        // SAFETY: forwarded contract.
        unsafe { copy_spans(spans) }
    }

    #[test]
    fn a_panicking_copy_thread_is_an_error_not_a_hang_and_the_crew_goes_on() {
        let src = [7u8; 26];
        let mut dst = [0u8; 26];
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let spans = |len: usize| {
            vec![Span {
                src: s,
                dst: d,
                len,
            }]
        };
        let (failed, then) = with_crew(2, copy_or_panic, |crew| {
            // Two shares of 13 bytes: the worker's and the caller's both panic.
            // SAFETY: both arrays hold 26 bytes and do not overlap.
            let failed = unsafe { crew.copy(&spans(26)) };
            // SAFETY: as above.
            let then = unsafe { crew.copy(&spans(24)) };
            (failed, then)
        });
        assert_eq!(failed.unwrap_err(), "a copy thread fails");
        then.unwrap();
        assert_eq!(dst[..24], src[..24]);
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
