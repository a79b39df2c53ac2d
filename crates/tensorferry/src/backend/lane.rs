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
//! Dispatching happens under the lane's lock (so that order holds between threads), and
//! must not complete events there: it returns what to complete, which the lane does after
//! unlocking (callbacks of a completed event may submit to this lane again).

use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::event::Outcome;
use super::{CopyBatch, Event};

/// A batch as submitted: the copies, what they hold, the event they complete.
pub(crate) struct Submitted {
    pub batch: CopyBatch,
    pub keep: Box<dyn Any + Send>,
    pub event: Event,
    /// A number the backend gave the batch when it was submitted (its fault counters).
    pub seq: u64,
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

/// One stream's submission order.
pub(crate) struct Lane {
    deferred: Mutex<VecDeque<Submitted>>,
    /// Whether a wait on a GPU-queued event can be honoured at dispatch (CUDA).
    device_waits: bool,
    dispatch: Dispatch,
}

impl Lane {
    /// A lane that queues ready batches with `dispatch`; with `device_waits`, events
    /// queued on a GPU count as ready (the dispatch orders after them on the GPU).
    pub(crate) fn new(
        device_waits: bool,
        dispatch: impl Fn(Submitted) -> Option<Refused> + Send + Sync + 'static,
    ) -> Arc<Lane> {
        Arc::new(Lane {
            deferred: Mutex::new(VecDeque::new()),
            device_waits,
            dispatch: Box::new(dispatch),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Submitted>> {
        self.deferred.lock().unwrap_or_else(|p| p.into_inner())
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
        let mut deferred = self.lock();
        if !ordered {
            if let Some(blocker) = self.blocker(&submitted.batch) {
                drop(deferred);
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
        if (!ordered || deferred.is_empty()) && self.blocker(&submitted.batch).is_none() {
            let refused = (self.dispatch)(submitted);
            drop(deferred);
            if let Some(r) = refused {
                r.finish();
            }
            return;
        }
        let arm = deferred.is_empty();
        let blocker = self.blocker(&submitted.batch);
        deferred.push_back(submitted);
        drop(deferred);
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

    /// Dispatches deferred batches in order while the head can go; chains to the head's
    /// blocker when it cannot.
    fn pump(self: &Arc<Self>) {
        let mut refused = Vec::new();
        let mut deferred = self.lock();
        let mut blocker = None;
        while let Some(head) = deferred.front() {
            if let Some(b) = self.blocker(&head.batch) {
                blocker = Some(b);
                break;
            }
            let head = deferred.pop_front().expect("a head");
            refused.extend((self.dispatch)(head));
        }
        drop(deferred);
        for r in refused {
            r.finish();
        }
        if blocker.is_some() {
            self.arm(blocker);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Direction;

    fn batch(waits: Vec<Event>) -> CopyBatch {
        CopyBatch {
            direction: Direction::HostToDevice,
            ops: Vec::new(),
            waits,
        }
    }

    #[test]
    fn a_deferred_batch_holds_later_ones_behind_it_and_the_caller_never_waits() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let seen = order.clone();
        let lane = Lane::new(false, move |s: Submitted| {
            let n = *s.keep.downcast_ref::<usize>().unwrap();
            seen.lock().unwrap().push(n);
            s.event.complete(Ok(()));
            None
        });
        let host = Event::pending();
        let (a, b, c) = (Event::pending(), Event::pending(), Event::pending());
        lane.submit(
            Submitted {
                batch: batch(vec![]),
                keep: Box::new(0usize),
                event: a.clone(),
                seq: 0,
            },
            true,
        );
        lane.submit(
            Submitted {
                batch: batch(vec![host.clone()]),
                keep: Box::new(1usize),
                event: b.clone(),
                seq: 0,
            },
            true,
        );
        lane.submit(
            Submitted {
                batch: batch(vec![]),
                keep: Box::new(2usize),
                event: c.clone(),
                seq: 0,
            },
            true,
        );
        assert_eq!(*order.lock().unwrap(), [0], "2 queues behind 1");
        assert!(!c.is_ready());
        host.complete(Ok(()));
        assert_eq!(*order.lock().unwrap(), [0, 1, 2]);
        assert!(b.is_ready() && c.is_ready());
    }

    #[test]
    fn a_refused_batch_drops_its_keep_before_completing_outside_the_lock() {
        let lane = Lane::new(false, |s: Submitted| {
            Some(Refused {
                keep: s.keep,
                event: s.event,
                outcome: Err(crate::backend::Failure::new("emu:0", "refused")),
            })
        });
        let e = Event::pending();
        let again = lane.clone();
        // A callback that submits to the same lane must not deadlock.
        e.on_complete(move |_| {
            again.submit(
                Submitted {
                    batch: batch(vec![]),
                    keep: Box::new(()),
                    event: Event::pending(),
                    seq: 0,
                },
                true,
            )
        });
        lane.submit(
            Submitted {
                batch: batch(vec![]),
                keep: Box::new(()),
                event: e.clone(),
                seq: 0,
            },
            true,
        );
        assert!(e.wait().is_err());
    }
}
