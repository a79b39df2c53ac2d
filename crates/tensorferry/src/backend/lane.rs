//! Submission order on one stream, without blocking the submitting thread: a batch whose
//! waits can be honoured where it is queued (complete, or — on a GPU — queued on a GPU)
//! is dispatched at once; one that waits for host work is deferred, chained to that work
//! ([`Event::on_complete`]), and every later batch of the same stream queues behind it, so
//! that a stream runs its batches in the order they were submitted.
//!
//! A batch submitted *unordered* (a staging ring's chunk, fed over time on behalf of a
//! transfer that deferred batches may be waiting for) does not queue behind deferred
//! batches: it is dispatched as soon as its own waits allow, or it would never run.
//!
//! One thread at a time dispatches a lane's batches, in order, *outside* the lane's lock:
//! a thread that finds another dispatching leaves its batch in the queue for that one and
//! returns. A batch whose dispatch may block until its copies have run (a download that
//! may land in pageable memory, which the CUDA driver copies synchronously) is handed,
//! with the dispatching, to the lane's own thread: no submitter, and no thread that
//! completes events (whose callbacks submit deferred batches), waits for a stream.
//! Dispatching must not complete events: it returns what to complete, which the lane
//! does after it.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::event::Event;
use super::event::Outcome;
use super::interface::{CopyBatch, Direction};

/// Which of a device's streams (lanes) a direction's copies run on: 0 for uploads (host → device),
/// 1 for copies that read device memory.
pub(crate) fn lane_of(direction: Direction) -> usize {
    match direction {
        Direction::HostToDevice => 0,
        Direction::DeviceToHost | Direction::DeviceToDevice => 1,
    }
}

/// How many streams (lanes) a device has: uploads overlap copies that read device memory.
pub(crate) const LANES: usize = 2;

/// A batch as submitted: the copies, what they hold, the event they complete.
pub(crate) struct Submitted {
    pub batch: CopyBatch,
    pub keep: Box<dyn Any + Send>,
    pub event: Event,
    /// A number the backend gave the batch when it was submitted (its fault counters).
    pub seq: u64,
}

/// Hands a batch to the lane of its direction among a device's `lanes`, numbered `seq`
/// ([`Lane::submit`]).
pub(crate) fn submit_to(
    lanes: &[Arc<Lane>; LANES],
    batch: CopyBatch,
    keep: Box<dyn Any + Send>,
    event: &Event,
    seq: u64,
    ordered: bool,
) {
    let lane = &lanes[lane_of(batch.direction)];
    let event = event.clone();
    lane.submit(
        Submitted {
            batch,
            keep,
            event,
            seq,
        },
        ordered,
    );
}

/// What a dispatch could not queue: drop `keep` (nothing queued uses it), then complete
/// `event` with `outcome`.
pub(crate) struct Refused {
    pub keep: Box<dyn Any + Send>,
    pub event: Event,
    pub outcome: Outcome,
}

impl Refused {
    fn finish(self) {
        drop(self.keep);
        self.event.complete(self.outcome);
    }
}

type Dispatch = Box<dyn Fn(Submitted) -> Option<Refused> + Send + Sync>;

/// Whether dispatching a batch may block the dispatching thread until its copies ran.
pub(crate) type MayBlock = fn(&CopyBatch) -> bool;

#[derive(Default)]
struct State {
    /// Ordered batches behind one that waits for host work, in submission order.
    deferred: VecDeque<Submitted>,
    /// Batches whose waits allow dispatch, in the order they are to be dispatched.
    ready: VecDeque<Submitted>,
    /// Whether a thread is dispatching this lane's batches.
    dispatching: bool,
}

/// One stream's submission order.
pub(crate) struct Lane {
    state: Mutex<State>,
    /// Whether a wait on a GPU-queued event can be honoured at dispatch (CUDA).
    device_waits: bool,
    dispatch: Dispatch,
    may_block: MayBlock,
    /// The lane's own thread, which dispatches batches that may block (started on first
    /// need; `None` when it could not start: such batches are then dispatched in place).
    blocking: OnceLock<Option<Mutex<Sender<Submitted>>>>,
    /// Names the lane's thread.
    name: String,
}

impl Lane {
    /// A lane `name` that queues ready batches with `dispatch`; with `device_waits`, events
    /// queued on a GPU count as ready (the dispatch orders after them on the GPU). Batches
    /// for which `may_block` is true are dispatched on the lane's own thread.
    pub(crate) fn new(
        name: impl Into<String>,
        device_waits: bool,
        may_block: MayBlock,
        dispatch: impl Fn(Submitted) -> Option<Refused> + Send + Sync + 'static,
    ) -> Arc<Lane> {
        Arc::new(Lane {
            state: Mutex::new(State::default()),
            device_waits,
            dispatch: Box::new(dispatch),
            may_block,
            blocking: OnceLock::new(),
            name: name.into(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The first wait of `batch` that the dispatch cannot honour yet.
    fn blocker(&self, batch: &CopyBatch) -> Option<Event> {
        batch
            .waits
            .iter()
            .find(|e| {
                if self.device_waits {
                    !e.is_queued_or_ready()
                } else {
                    !e.is_ready()
                }
            })
            .cloned()
    }

    /// Submits after everything submitted before (`ordered`), or as soon as its own waits
    /// allow (not `ordered`); never blocks on other work.
    pub(crate) fn submit(self: &Arc<Self>, submitted: Submitted, ordered: bool) {
        let mut state = self.lock();
        let blocker = self.blocker(&submitted.batch);
        if !ordered {
            if let Some(blocker) = blocker {
                drop(state);
                let lane = self.clone();
                let held = Mutex::new(Some(submitted));
                blocker.on_complete(move |_| {
                    let taken = held.lock().unwrap_or_else(|p| p.into_inner()).take();
                    if let Some(s) = taken {
                        lane.submit(s, false);
                    }
                });
                return;
            }
        }
        if (!ordered || state.deferred.is_empty()) && blocker.is_none() {
            state.ready.push_back(submitted);
            drop(state);
            self.drain(false);
            return;
        }
        let arm = state.deferred.is_empty();
        state.deferred.push_back(submitted);
        drop(state);
        if arm {
            self.arm(blocker);
        }
    }

    /// Chains a pump to `blocker` (the head's), or pumps now when there is none.
    fn arm(self: &Arc<Self>, blocker: Option<Event>) {
        let lane = self.clone();
        match blocker {
            Some(e) => e.on_complete(move |_| lane.pump()),
            None => lane.pump(),
        }
    }

    /// Moves deferred batches, in order, to the ready queue while the head can go, then
    /// dispatches; chains to the head's blocker when it cannot go.
    fn pump(self: &Arc<Self>) {
        let mut state = self.lock();
        let mut blocker = None;
        while let Some(head) = state.deferred.front() {
            if let Some(b) = self.blocker(&head.batch) {
                blocker = Some(b);
                break;
            }
            let head = state.deferred.pop_front().expect("a head");
            state.ready.push_back(head);
        }
        drop(state);
        self.drain(false);
        if blocker.is_some() {
            self.arm(blocker);
        }
    }

    /// Dispatches ready batches in order, unless another thread is dispatching (which then
    /// takes them too). On the lane's own thread (`on_lane_thread`) every batch is
    /// dispatched in place; elsewhere one that may block is handed, with the dispatching,
    /// to that thread.
    fn drain(self: &Arc<Self>, on_lane_thread: bool) {
        loop {
            let next = {
                let mut state = self.lock();
                if state.dispatching {
                    return;
                }
                let Some(next) = state.ready.pop_front() else {
                    return;
                };
                state.dispatching = true;
                next
            };
            let next = if !on_lane_thread && (self.may_block)(&next.batch) {
                match self.hand_over(next) {
                    Ok(()) => return,
                    Err(back) => back,
                }
            } else {
                next
            };
            self.dispatch_one(next);
        }
    }

    /// Dispatches one batch (this thread holds the dispatching), then releases the
    /// dispatching and finishes a refusal.
    fn dispatch_one(&self, next: Submitted) {
        let refused = (self.dispatch)(next);
        self.lock().dispatching = false;
        if let Some(r) = refused {
            r.finish();
        }
    }

    /// Hands `next` to the lane's own thread, starting it on first use; `next` back if
    /// there is none.
    fn hand_over(self: &Arc<Self>, next: Submitted) -> Result<(), Submitted> {
        let thread = self.blocking.get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Submitted>();
            let lane: Weak<Lane> = Arc::downgrade(self);
            std::thread::Builder::new()
                .name(format!("tensorferry-{}", self.name))
                .spawn(move || {
                    for next in rx {
                        let Some(lane) = lane.upgrade() else { return };
                        lane.dispatch_one(next);
                        lane.drain(true);
                    }
                })
                .ok()
                .map(|_| Mutex::new(tx))
        });
        match thread {
            Some(tx) => tx
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .send(next)
                .map_err(|e| e.0),
            None => Err(next),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(waits: Vec<Event>) -> CopyBatch {
        CopyBatch {
            direction: Direction::HostToDevice,
            ops: Vec::new(),
            waits,
        }
    }

    /// An upload of no copies waiting for `waits`, holding `keep`, completing `event`.
    fn submitted(waits: Vec<Event>, keep: impl Any + Send, event: &Event) -> Submitted {
        Submitted {
            batch: batch(waits),
            keep: Box::new(keep),
            event: event.clone(),
            seq: 0,
        }
    }

    #[test]
    fn a_deferred_batch_holds_later_ones_behind_it_and_the_caller_never_waits() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let seen = order.clone();
        let lane = Lane::new(
            "test",
            false,
            |_| false,
            move |s: Submitted| {
                let n = *s.keep.downcast_ref::<usize>().unwrap();
                seen.lock().unwrap().push(n);
                s.event.complete(Ok(()));
                None
            },
        );
        let host = Event::pending();
        let (a, b, c) = (Event::pending(), Event::pending(), Event::pending());
        lane.submit(submitted(vec![], 0usize, &a), true);
        lane.submit(submitted(vec![host.clone()], 1usize, &b), true);
        lane.submit(submitted(vec![], 2usize, &c), true);
        assert_eq!(*order.lock().unwrap(), [0], "2 queues behind 1");
        assert!(!c.is_ready());
        host.complete(Ok(()));
        assert_eq!(*order.lock().unwrap(), [0, 1, 2]);
        assert!(b.is_ready() && c.is_ready());
    }

    #[test]
    fn a_refused_batch_drops_its_keep_before_completing_outside_the_lock() {
        let lane = Lane::new(
            "test",
            false,
            |_| false,
            |s: Submitted| {
                Some(Refused {
                    keep: s.keep,
                    event: s.event,
                    outcome: Err(crate::backend::Failure::new("emu:0", "refused")),
                })
            },
        );
        let e = Event::pending();
        let again = lane.clone();
        // A callback that submits to the same lane must not deadlock.
        e.on_complete(move |_| again.submit(submitted(vec![], (), &Event::pending()), true));
        lane.submit(submitted(vec![], (), &e), true);
        assert!(e.wait().is_err());
    }

    #[test]
    fn a_dispatch_that_blocks_runs_on_the_lanes_thread_and_keeps_the_order() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let seen = order.clone();
        let gate = Event::pending();
        let held = gate.clone();
        let lane = Lane::new(
            "test-blocking",
            false,
            |b| b.direction == Direction::DeviceToHost,
            move |s: Submitted| {
                if s.batch.direction == Direction::DeviceToHost {
                    // A synchronous copy: returns once its stream (held here) has run it.
                    held.wait().unwrap();
                }
                seen.lock()
                    .unwrap()
                    .push(*s.keep.downcast_ref::<usize>().unwrap());
                s.event.complete(Ok(()));
                None
            },
        );
        let (a, b) = (Event::pending(), Event::pending());
        let mut download = submitted(vec![], 0usize, &a);
        download.batch.direction = Direction::DeviceToHost;
        lane.submit(download, true);
        lane.submit(submitted(vec![], 1usize, &b), true);
        // Both submissions returned with the blocking dispatch still held.
        assert!(!b
            .wait_timeout(std::time::Duration::from_millis(30))
            .unwrap());
        assert!(order.lock().unwrap().is_empty(), "1 ran before 0");
        gate.complete(Ok(()));
        b.wait().unwrap();
        a.wait().unwrap();
        assert_eq!(*order.lock().unwrap(), [0, 1]);
    }
}
