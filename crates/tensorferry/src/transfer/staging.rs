//! The staging ring: copies between a device and ordinary (pageable) host memory through
//! a few pinned buffers, so that the device always copies to or from pinned memory (at
//! the bus's speed) while host threads move the previous chunk between the pinned buffer
//! and its destination (or the next chunk from its sources), at the same time.
//!
//! The packed layout is cut into chunks of `chunk_bytes`; chunk `j` uses pinned buffer
//! `j % depth`. Device → host: the first `depth` chunks are queued at once; each time one
//! completes, the host copies it out and queues the chunk that reuses its buffer. Host →
//! device: the host fills a buffer, queues its chunk, and moves on to the next buffer,
//! waiting only when it comes back to one whose chunk has not finished. Both are the
//! engine's one ring loop (`transfer::ring`), driven by a worker of the bounded pool
//! (`backend::worker`), which completes the transfer's event after the last chunk
//! (or with the first failure, a panic included); a chunk's host copy is split among the
//! pool's free workers. Every queued chunk holds its pinned buffer and its sources, so
//! nothing it touches can be freed or reused before it has run.

use std::sync::Arc;

use super::batch::{copy_direct, runs, submit_when_ready, Run};
use super::ring_memory::RingMemory;
use crate::backend::event::{Outcome, Progress};
use crate::backend::worker;
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
/// Most shares a chunk's host copy is split into (for the pool's workers), whatever
/// `TENSORFERRY_COPY_THREADS` asks.
const MAX_SHARES: usize = 64;

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

/// The host buffers a transfer, or a stream to or from a device, copies through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ring {
    /// Bytes of each buffer: the most one chunk may hold.
    pub(crate) chunk_bytes: usize,
    /// Buffers in the ring.
    pub(crate) depth: usize,
    /// Alignment of each buffer's start (a power of two; 1 where pinned memory's own will do).
    pub(crate) align: usize,
    /// `Staging::Auto` chose it (or `Off`, for a stream into a device): a transfer's ring
    /// that cannot be set up, or one beyond [`MAX_AUTO_RINGS`], leaves the transfer to a
    /// direct batch instead, and a stream's buffers are ordinary memory where no pinned
    /// memory is to be had.
    pub(crate) automatic: bool,
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
            Staging::Auto if !backend.prefers_pinned_staging() || total == 0 => None,
            Staging::Auto if total < AUTO_MIN_BYTES => non_blocking.then_some(Ring {
                chunk_bytes: total.min(AUTO_CHUNK_BYTES),
                depth: 2,
                align: 1,
                automatic: true,
            }),
            _ => self.ring_for_stream(),
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
                align: 1,
                automatic: true,
            }),
            Staging::Ring { chunk_bytes, depth } => Some(Ring {
                chunk_bytes: chunk_bytes.max(1),
                depth: depth.max(1),
                align: 1,
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

    /// The device copies of the chunk's runs (of `sources`) into the slot at `slot`, each
    /// at its offset from the chunk's start.
    pub(super) fn ops_into(&self, sources: &[Tensor], slot: *mut u8) -> Vec<CopyOp> {
        super::batch::ops_into(&self.pieces, sources, slot, self.start)
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
                src_offset: r.src_offset + done,
                dst_offset: at,
                len,
                ..*r
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

/// How many shares a chunk's host copy is split into: one per thread
/// [`crate::consolidate::threads_for`] gives a chunk, at most [`MAX_SHARES`].
fn shares_for(chunk_bytes: usize) -> usize {
    crate::consolidate::threads_for(chunk_bytes).clamp(1, MAX_SHARES)
}

/// `runs` cut into `n` shares of about equal bytes (a run may be cut in two).
fn split(runs: &[Run], n: usize) -> Vec<Vec<Run>> {
    let total: usize = runs.iter().map(|r| r.len).sum();
    let share = total.div_ceil(n.max(1)).max(1);
    let mut out = vec![Vec::new()];
    let mut room = share;
    for r in runs {
        let mut r = *r;
        while r.len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = share;
            }
            let len = r.len.min(room);
            out.last_mut().expect("one share").push(Run { len, ..r });
            r.src_offset += len;
            r.dst_offset += len;
            r.len -= len;
            room -= len;
        }
    }
    out.resize(n.max(1), Vec::new());
    out
}

/// What one staged transfer holds while a pool worker drives it: plain data and owners,
/// no raw address (addresses are taken where a copy is made).
struct Transfer {
    backend: Arc<dyn Backend>,
    direction: Direction,
    chunks: Vec<Chunk>,
    waits: Vec<Event>,
    ring: Arc<RingMemory>,
    sources: Arc<Vec<Tensor>>,
    dest: Arc<Storage>,
    /// Shares a chunk's host copy is split into.
    shares: usize,
    /// The transfer's own event, marked once an upload's last chunk is on the GPU.
    event: Event,
}

impl Transfer {
    fn prepare(
        backend: Arc<dyn Backend>,
        ring: Ring,
        direction: Direction,
        sources: Vec<Tensor>,
        layout: &PackedLayout,
        dest: Arc<Storage>,
        event: &Event,
    ) -> Result<Transfer> {
        let (runs, waits) = runs(&sources, layout)?;
        let chunks = chunks(&runs, ring.chunk_bytes);
        let pool = backend.pinned_pool()?;
        // A transfer smaller than a chunk needs no more than its own size.
        let slot_bytes = ring.chunk_bytes.min(layout.total);
        let depth = ring.depth.min(chunks.len());
        let memory = RingMemory::pinned(&pool, slot_bytes, depth, ring.align)?;
        Ok(Transfer {
            backend,
            direction,
            chunks,
            waits,
            ring: Arc::new(memory),
            sources: Arc::new(sources),
            dest,
            shares: shares_for(ring.chunk_bytes),
            event: event.clone(),
        })
    }

    /// Runs the transfer through the ring (an upload first waits for its sources, which
    /// its host copies read).
    fn run(&mut self) -> Outcome {
        let device = self.backend.device();
        let outcome = (|| {
            if self.direction == Direction::HostToDevice {
                for w in &self.waits {
                    w.wait()?;
                }
            }
            let depth = self.ring.depth();
            super::ring::drive(device, depth, self)
        })();
        outcome.map_err(|e| Failure::from_error(device, &e))
    }

    /// Copies chunk `j` between its slot and the host memory on the host, split among pool
    /// workers that are free: a download's slot out to the destination, an upload's sources
    /// into the slot. A panic while copying is an internal error of the device.
    fn host_copy(&self, j: usize) -> Result<()> {
        let c = &self.chunks[j];
        let runs: Vec<Run> = match self.direction {
            // From the slot (at the chunk's offsets) to the destination.
            Direction::DeviceToHost => covered(c)
                .into_iter()
                .map(|(at, len)| Run {
                    source: 0,
                    src_offset: at - c.start,
                    dst_offset: at,
                    len,
                })
                .collect(),
            // From the sources to the slot (at the chunk's offsets).
            _ => c
                .pieces
                .iter()
                .map(|p| Run {
                    dst_offset: p.dst_offset - c.start,
                    ..*p
                })
                .collect(),
        };
        let shares = Arc::new(split(&runs, self.shares));
        let n = shares.len();
        let copy = ShareCopy {
            direction: self.direction,
            j,
            shares,
            ring: self.ring.clone(),
            sources: self.sources.clone(),
            dest: self.dest.clone(),
        };
        let copy = Arc::new(copy);
        worker::share_out(n, n - 1, Arc::new(move |i| copy.run(i))).map_err(|panic| {
            Failure::new(self.backend.device(), format!("internal error: {panic}")).to_error()
        })
    }
}

impl super::ring::RingSteps for Transfer {
    fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// An upload's sources into the slot.
    fn fill(&mut self, j: usize) -> Result<()> {
        match self.direction {
            Direction::DeviceToHost => Ok(()),
            _ => self.host_copy(j),
        }
    }

    /// Queues chunk `j`'s device copies; the batch holds the ring's memory and the sources.
    fn submit(&mut self, j: usize) -> Event {
        let c = &self.chunks[j];
        let slot = self.ring.slot_address(j);
        let ops = match self.direction {
            Direction::DeviceToHost => c.ops_into(&self.sources, slot),
            _ => {
                let dst = self.dest.as_ptr().cast_mut();
                covered(c)
                    .into_iter()
                    .map(|(at, len)| CopyOp {
                        src: slot.wrapping_add(at - c.start),
                        dst: dst.wrapping_add(at),
                        len,
                    })
                    .collect()
            }
        };
        let batch = CopyBatch {
            direction: self.direction,
            ops,
            waits: self.waits.clone(),
        };
        let event = Event::pending();
        let keep = Box::new((self.sources.clone(), self.ring.clone(), self.dest.clone()));
        // Unordered: a deferred batch of the stream may be waiting for this very transfer.
        // SAFETY: the ops address the sources (held by `keep`), the chunk's slot of the
        // ring (held by `keep`; only this chunk uses it until its event completes, since the
        // ring drains it before reusing it) and the destination (held by `keep`, written
        // only at this chunk's own packed range).
        unsafe { submit_when_ready(self.backend.clone(), batch, keep, event.clone(), false) };
        event
    }

    /// A download's slot out to the destination.
    fn drain(&mut self, j: usize) -> Result<()> {
        match self.direction {
            Direction::DeviceToHost => self.host_copy(j),
            _ => Ok(()),
        }
    }

    /// Once an upload's last chunk is queued on the GPU (behind every other chunk, on the
    /// same stream), its fence marks the transfer's event too: a consumer's stream can then
    /// be ordered after the whole transfer on the GPU instead of waiting on the host. Only
    /// when every chunk is on the GPU (or done) without a failure: a consumer ordered
    /// behind the mark must not read a range whose copy failed, whose error it would never
    /// see; otherwise it waits for the outcome on the host.
    fn all_queued(&mut self, events: &[Event]) {
        if self.direction == Direction::DeviceToHost {
            return;
        }
        let all_queued = events
            .iter()
            .all(|e| matches!(e.progress(), Progress::Queued(_) | Progress::Done(Ok(()))));
        if all_queued {
            if let Some(Progress::Queued(mark)) = events.last().map(Event::progress) {
                self.event.set_mark(mark);
            }
        }
    }
}

/// One chunk's host copy, split in shares that pool workers take: it owns (shares in) what
/// it copies between, so a worker that comes late holds nothing that could dangle.
struct ShareCopy {
    direction: Direction,
    j: usize,
    shares: Arc<Vec<Vec<Run>>>,
    ring: Arc<RingMemory>,
    sources: Arc<Vec<Tensor>>,
    dest: Arc<Storage>,
}

impl ShareCopy {
    /// Copies share `i`.
    fn run(&self, i: usize) {
        for r in &self.shares[i] {
            match self.direction {
                Direction::DeviceToHost => {
                    // SAFETY: the chunk's copy has completed (the ring drains a slot only
                    // after its event), so the slot holds its bytes and nothing writes it
                    // until the ring queues its next chunk, which waits for this copy; the
                    // run lies inside the slot (a chunk's pieces lie within `chunk_bytes`
                    // of its start).
                    let from = unsafe { self.ring.bytes(self.j, r.src_offset + r.len) };
                    let from = &from[r.src_offset..];
                    let dst = self.dest.as_ptr().cast_mut().wrapping_add(r.dst_offset);
                    // SAFETY: the run lies inside the destination (by the layout), which
                    // `dest` holds and nobody reads before the transfer's event; the shares
                    // cover disjoint ranges of it, and it is host memory apart from the slot.
                    unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), dst, r.len) };
                }
                _ => {
                    let source = self.sources[r.source].storage();
                    let bytes = source
                        .host_bytes()
                        .expect("an upload's sources are host memory, filled before its ring");
                    let from = &bytes[r.src_offset..r.src_offset + r.len];
                    let range = r.dst_offset..r.dst_offset + r.len;
                    // SAFETY: only this chunk uses its slot until its copy is queued, after
                    // this copy (the ring fills a slot only once the chunk that used it last
                    // has completed); the shares write disjoint ranges of it.
                    let to = unsafe { self.ring.slot_mut(self.j, range) };
                    // SAFETY: `to` and `from` are `len` bytes each; `to` is the slot's,
                    // `from` the source's, which are different memories.
                    unsafe {
                        std::ptr::copy_nonoverlapping(from.as_ptr(), to.as_mut_ptr().cast(), r.len)
                    };
                }
            }
        }
    }
}

/// Runs one transfer through `ring` on a worker of the pool, which completes `event` when
/// done: device → ordinary host memory, or ordinary host memory → a device, as `direction`
/// says, into `dest`. A ring `Staging::Auto` chose that cannot be set up (no pinned memory)
/// leaves the transfer to one direct batch.
pub(crate) fn start(
    backend: Arc<dyn Backend>,
    ring: Ring,
    direction: Direction,
    sources: Vec<Tensor>,
    layout: &PackedLayout,
    dest: Arc<Storage>,
    event: &Event,
) -> Result<()> {
    let fall_back = ring.automatic;
    let direct = |sources: Vec<Tensor>, dest: Arc<Storage>| {
        copy_direct(&backend, direction, sources, layout, dest, event)
    };
    // Where staging was the automatic choice, at most `MAX_AUTO_RINGS` run at once (each
    // holds pinned buffers): many small non-blocking moves in a row copy directly beyond
    // that, as they would without the ring.
    let slot = match fall_back.then(AutoRing::take) {
        Some(None) => return direct(sources, dest),
        Some(Some(slot)) => Some(slot),
        None => None,
    };
    let retry = fall_back.then(|| (sources.clone(), dest.clone()));
    let prepared = Transfer::prepare(
        backend.clone(),
        ring,
        direction,
        sources,
        layout,
        dest,
        event,
    );
    let mut transfer = match prepared {
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
    worker::run_on_pool(device, event.clone(), move || {
        let outcome = transfer.run();
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
            source: 0,
            src_offset: 1000 + dst_offset,
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
            .map(|p| (p.dst_offset, p.len, p.src_offset - 1000))
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
        let spans = [run(0, 7), run(100, 5)];
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
            .flat_map(|s| (0..s.len).map(move |i| s.dst_offset + i))
            .collect();
        covered.sort();
        let expected: Vec<usize> = (0..7).chain(100..105).collect();
        assert_eq!(covered, expected);
    }
}
