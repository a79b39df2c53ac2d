//! The reaper of one GPU: a thread that watches the CUDA events recorded after each batch
//! (`cuEventQuery`, backing off while nothing completes), and when one has been passed
//! releases what the batch held (`keep`: buffers back to their pool, sources) and only
//! then completes the batch's host [`Event`].
//!
//! A batch whose waits were honoured on the GPU also takes their outcome: its host event
//! completes once theirs have, failing with the first failure among them (the GPU ran it
//! after them, but on what a failed copy left).
//!
//! When an event cannot be recorded or queried, the reaper synchronises the batch's stream
//! before releasing anything, so no copy still queued outlives the memory it uses. When that
//! synchronisation fails too, nothing tells when the GPU stops using the batch's memory: it
//! is kept (leaked), never freed or reused, and the GPU is taken out of service ([`Health`]).

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cudarc::driver::sys;

use super::cuda_driver::Context;
use super::cuda_event::CudaEvent;
use super::event::Event;
use super::event::{Failure, Outcome};
use crate::device::Device;
use crate::error::{Error, Result};

/// Shortest and longest pause between rounds of queries when nothing completed.
const BACKOFF_MIN: Duration = Duration::from_micros(5);
const BACKOFF_MAX: Duration = Duration::from_micros(500);

/// A stream handle, to synchronise when an event cannot tell that the stream is done.
#[derive(Clone, Copy)]
pub(crate) struct RawStream(pub sys::CUstream);
// SAFETY: a stream handle may be used from any thread with its context current; the
// GPU's streams are never destroyed.
unsafe impl Send for RawStream {}

/// One batch queued on a stream, to be reaped.
pub(crate) struct Entry {
    /// The event recorded after the batch's copies; `None` when it could not be recorded
    /// (the stream is synchronised instead).
    pub done: Option<Arc<CudaEvent>>,
    /// The stream the batch was queued on.
    pub stream: RawStream,
    /// What the batch holds until its copies are done.
    pub keep: Box<dyn Any + Send>,
    /// The batch's host event.
    pub event: Event,
    /// How queuing went: a failure here still waits for what was queued.
    pub outcome: Outcome,
    /// Events the batch waited for on the GPU: their outcome becomes the batch's.
    pub device_waits: Vec<Event>,
}

/// Whether a GPU is still in service: taken out (for good, with the reason) once memory it
/// may still use had to be kept because a synchronisation failed.
#[derive(Debug, Default)]
pub(crate) struct Health(OnceLock<String>);

impl Health {
    /// Takes the GPU out of service (the first reason stays).
    fn fail(&self, why: String) {
        let _ = self.0.set(why);
    }

    /// Fails when the GPU is out of service, saying why.
    pub(crate) fn check(&self, device: Device) -> Result<()> {
        match self.0.get() {
            None => Ok(()),
            Some(why) => Err(Error::DeviceUnavailable {
                device: device.to_string(),
                reason: format!("out of service since {why}"),
            }),
        }
    }
}

/// The reaper thread of one GPU.
pub(crate) struct Reaper {
    device: Device,
    health: Arc<Health>,
    entries: Mutex<Sender<Entry>>,
}

impl Reaper {
    /// Starts the reaper of `device`, with `context` current on its thread; a failed
    /// synchronisation takes the GPU out of service through `health`.
    pub(crate) fn spawn(device: Device, context: Context, health: Arc<Health>) -> Result<Reaper> {
        let (tx, rx) = mpsc::channel::<Entry>();
        let on_thread = health.clone();
        std::thread::Builder::new()
            .name(format!(
                "tensorferry-{}-reaper",
                device.to_string().replace(':', "")
            ))
            .spawn(move || {
                let _ = context.make_current(device);
                reap(device, &on_thread, rx);
            })
            .map_err(|e| Error::DeviceUnavailable {
                device: device.to_string(),
                reason: format!("cannot start its reaper thread: {e}"),
            })?;
        Ok(Reaper {
            device,
            health,
            entries: Mutex::new(tx),
        })
    }

    /// Hands `entry` over. If the thread is gone, synchronises the stream here, then
    /// releases and fails the batch.
    pub(crate) fn push(&self, entry: Entry) {
        let sent = self
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(entry);
        if let Err(mpsc::SendError(entry)) = sent {
            let failure = Failure::new(self.device, "the reaper thread has stopped");
            finish(self.device, &self.health, entry, Some(Err(failure)));
        }
    }
}

/// The reaper loop: queries every pending entry, finishes those done, backs off while
/// nothing completes, sleeps on the channel while nothing is pending.
fn reap(device: Device, health: &Health, rx: Receiver<Entry>) {
    let mut pending: Vec<Entry> = Vec::new();
    let mut backoff = BACKOFF_MIN;
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(e) => pending.push(e),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(e) => {
                    // New work: look again soon.
                    pending.push(e);
                    backoff = BACKOFF_MIN;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => break,
            }
        }
        let before = pending.len();
        let mut i = 0;
        while i < pending.len() {
            let state = match &pending[i].done {
                None => Some(None),
                Some(done) => match done.query() {
                    Ok(true) => Some(None),
                    Ok(false) => None,
                    Err(e) => Some(Some(Err(Failure::from_error(device, &e)))),
                },
            };
            match state {
                None => i += 1,
                Some(query_failure) => {
                    let entry = pending.swap_remove(i);
                    // `finish` completes the event whatever the release does; this guard
                    // only keeps the reaper alive for the other batches.
                    let guarded = catch_unwind(AssertUnwindSafe(|| {
                        finish(device, health, entry, query_failure)
                    }));
                    drop(guarded);
                }
            }
        }
        if pending.len() < before {
            backoff = BACKOFF_MIN;
        } else if !pending.is_empty() {
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }
}

/// Releases a batch whose copies are done (or, when `failure` says the event could not
/// tell, after synchronising its stream), then completes its event — with the panic as an
/// internal error of `device` when releasing what the batch held panics, as the emulated
/// device's stream does: a waiter is never left blocked. When the stream cannot be
/// synchronised either, what the batch held is kept for good and the GPU is taken out of
/// service: a copy may still be reading or writing that memory.
fn finish(device: Device, health: &Health, entry: Entry, failure: Option<Outcome>) {
    let Entry {
        done,
        stream,
        keep,
        event,
        outcome,
        device_waits,
    } = entry;
    let unknown = done.is_none() || failure.is_some();
    let mut outcome = match failure {
        Some(f) => outcome.and(f),
        None => outcome,
    };
    if unknown {
        // Nothing else tells when the queued copies are done: wait for the whole stream.
        // SAFETY: the stream is live (never destroyed); the device's context is current
        // on the reaper thread, or pushed by `Reaper::push`'s caller.
        let code = unsafe { sys::cuStreamSynchronize(stream.0) };
        if code != sys::CUresult::CUDA_SUCCESS {
            let why = format!(
                "cuStreamSynchronize failed ({code:?}) after a batch's copies were queued: the \
                 memory they use was kept, as the GPU may still use it"
            );
            outcome = outcome.and(Err(Failure::new(device, why.clone())));
            health.fail(why);
            // Never freed nor reused: leaked.
            std::mem::forget(keep);
            drop(done);
            return complete_after(event, outcome, device_waits);
        }
    }
    let released = catch_unwind(AssertUnwindSafe(|| drop(keep)));
    drop(done);
    if let Err(panic) = released {
        outcome = outcome.and(Err(Failure::internal(device, &*panic)));
    }
    complete_after(event, outcome, device_waits);
}

/// Completes `event` with `outcome` once every event of `waits` has completed, with the
/// first failure among them instead, if any (chained: never blocks).
fn complete_after(event: Event, outcome: Outcome, waits: Vec<Event>) {
    let pending: Vec<Event> = waits.iter().filter(|w| !w.is_ready()).cloned().collect();
    if pending.is_empty() {
        return event.complete(with_waits(outcome, &waits));
    }
    let left = Arc::new(AtomicUsize::new(pending.len()));
    let all = Arc::new(waits);
    for w in pending {
        let (left, all, event, outcome) =
            (left.clone(), all.clone(), event.clone(), outcome.clone());
        w.on_complete(move |_| {
            if left.fetch_sub(1, Ordering::SeqCst) == 1 {
                event.complete(with_waits(outcome, &all));
            }
        });
    }
}

/// The first failure among `waits` that have completed, or `outcome`.
fn with_waits(outcome: Outcome, waits: &[Event]) -> Outcome {
    match waits.iter().find_map(|w| w.peek().and_then(|o| o.err())) {
        Some(f) => Err(f),
        None => outcome,
    }
}
