//! The completer of one device, the same for every backend: a thread that polls the
//! [`Fence`] each backend hands back for a batch (backing off while nothing completes), and
//! when one has been passed releases what the batch held (`keep`: buffers back to their
//! pool, sources) and only then completes the batch's host [`Event`]. A backend whose own
//! thread runs the copies (the emulated device) sees its fences pass and completes the
//! batch there, with the same code ([`finish_passed`]).
//!
//! A batch whose waits were honoured on the device also takes their outcome: its host
//! event completes once theirs have, failing with the first failure among them (the device
//! ran it after them, but on what a failed copy left).
//!
//! When a fence cannot be had or polled, the completer drains the batch's queue (the
//! backend's `drain`: on CUDA, synchronising the stream) before releasing anything, so no
//! copy still queued outlives the memory it uses. When draining fails too, nothing tells
//! when the device stops using the batch's memory: it is kept (leaked), never freed or
//! reused, and the device is taken out of service ([`Health`]). A panic while releasing
//! fails the batch's event as an internal error, on every backend alike.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use super::event::{Event, Failure, Outcome};
use super::fence::Fence;
use super::process::spawn_thread;
use crate::device::Device;
use crate::error::{Error, Result};

/// Shortest and longest pause between rounds of queries when nothing completed.
const BACKOFF_MIN: Duration = Duration::from_micros(5);
const BACKOFF_MAX: Duration = Duration::from_micros(500);

/// Waits until everything queued so far on the batch's queue has run, for when its fence
/// cannot tell (it runs on the completer's thread, or on the pusher's if that has stopped).
pub(crate) type Drain = Box<dyn FnOnce() -> Result<()> + Send>;

/// One batch queued on a device, to be completed.
pub(crate) struct Entry {
    /// The fence after the batch's copies; `None` when it could not be had (the queue is
    /// drained instead).
    pub done: Option<Arc<dyn Fence>>,
    /// Drains the batch's queue when the fence cannot tell.
    pub drain: Drain,
    /// What the batch holds until its copies are done.
    pub keep: Box<dyn Any + Send>,
    /// The batch's host event.
    pub event: Event,
    /// How queuing went: a failure here still waits for what was queued.
    pub outcome: Outcome,
    /// Events the batch waited for on the device: their outcome becomes the batch's.
    pub device_waits: Vec<Event>,
}

/// Whether a device is still in service: taken out (for good, with the reason) once memory
/// it may still use had to be kept because a drain failed.
#[derive(Debug, Default)]
pub(crate) struct Health(OnceLock<String>);

impl Health {
    /// Takes the device out of service (the first reason stays).
    fn fail(&self, why: String) {
        let _ = self.0.set(why);
    }

    /// Fails when the device is out of service, saying why.
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

/// The completer thread of one device.
pub(crate) struct Completer {
    device: Device,
    health: Arc<Health>,
    entries: Mutex<Sender<Entry>>,
}

impl Completer {
    /// Starts the completer of `device`, running `init` first on its thread (CUDA makes
    /// the GPU's context current); a failed drain takes the device out of service through
    /// `health`.
    pub(crate) fn spawn(
        device: Device,
        init: impl FnOnce() + Send + 'static,
        health: Arc<Health>,
    ) -> Result<Completer> {
        let (tx, rx) = mpsc::channel::<Entry>();
        let on_thread = health.clone();
        spawn_thread(device, "completer", "completer", move || {
            init();
            complete(device, &on_thread, rx);
        })?;
        Ok(Completer {
            device,
            health,
            entries: Mutex::new(tx),
        })
    }

    /// Hands `entry` over. If the thread is gone, drains the queue here, then releases and
    /// fails the batch.
    pub(crate) fn push(&self, entry: Entry) {
        let sent = self
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(entry);
        if let Err(mpsc::SendError(entry)) = sent {
            let failure = Failure::new(self.device, "the completer thread has stopped");
            finish(self.device, &self.health, entry, Some(Err(failure)));
        }
    }
}

/// The completer loop: polls every pending entry, finishes those done, backs off while
/// nothing completes, sleeps on the channel while nothing is pending.
fn complete(device: Device, health: &Health, rx: Receiver<Entry>) {
    let mut pending: Vec<Entry> = Vec::new();
    let mut backoff = BACKOFF_MIN;
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(e) => pending.push(e),
                Err(_) => return,
            }
        }
        while let Ok(e) = rx.try_recv() {
            // New work: look again soon.
            pending.push(e);
            backoff = BACKOFF_MIN;
        }
        let before = pending.len();
        let mut i = 0;
        while i < pending.len() {
            let state = match &pending[i].done {
                None => Some(None),
                Some(done) => match done.poll() {
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
                    // only keeps the completer alive for the other batches.
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

/// Releases a batch whose fence the calling thread has just seen passed, then completes
/// its event, exactly as the completer thread does: for a backend whose own thread runs the
/// copies (the emulated device's streams), which so needs no hop to another thread.
pub(crate) fn finish_passed(device: Device, health: &Health, entry: Entry) {
    finish(device, health, entry, None);
}

/// Releases a batch whose copies are done (or, when `failure` says the fence could not
/// tell, after draining its queue), then completes its event, as the module documentation
/// says: a panic while releasing is an internal error of `device`, and a failed drain keeps
/// what the batch held for good.
fn finish(device: Device, health: &Health, entry: Entry, failure: Option<Outcome>) {
    let Entry {
        done,
        drain,
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
        // Nothing else tells when the queued copies are done: wait for the whole queue.
        if let Err(e) = drain() {
            let what = match e {
                Error::DeviceUnavailable { reason, .. } => reason,
                other => other.to_string(),
            };
            let why = format!(
                "{what} after a batch's copies were queued: the memory they use was kept, as \
                 the device may still use it"
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::StreamHandle;
    use std::sync::atomic::AtomicBool;

    /// A fence passed when the test says, or one that cannot tell.
    #[derive(Debug, Default)]
    struct TestFence {
        passed: AtomicBool,
        broken: bool,
    }

    impl Fence for TestFence {
        fn device(&self) -> Device {
            Device::Emulated(9)
        }
        fn poll(&self) -> Result<bool> {
            if self.broken {
                return Err(Error::DeviceUnavailable {
                    device: "emu:9".into(),
                    reason: "the fence cannot tell".into(),
                });
            }
            Ok(self.passed.load(Ordering::SeqCst))
        }
        fn wait(&self) -> Result<()> {
            unreachable!("the completer polls")
        }
        fn order_stream(&self, _stream: StreamHandle) -> Result<()> {
            unreachable!("not a consumer's")
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    /// Sets its flag when dropped (the batch's memory given back), or panics.
    struct Held(Arc<AtomicBool>, bool);

    impl Drop for Held {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
            if self.1 {
                panic!("a release panics");
            }
        }
    }

    fn entry(fence: &Arc<TestFence>, drain: Drain, panics: bool) -> (Entry, Arc<AtomicBool>) {
        let released = Arc::new(AtomicBool::new(false));
        let entry = Entry {
            done: Some(fence.clone() as Arc<dyn Fence>),
            drain,
            keep: Box::new(Held(released.clone(), panics)),
            event: Event::pending(),
            outcome: Ok(()),
            device_waits: Vec::new(),
        };
        (entry, released)
    }

    fn completer() -> (Completer, Arc<Health>) {
        let health = Arc::new(Health::default());
        let c = Completer::spawn(Device::Emulated(9), || {}, health.clone()).unwrap();
        (c, health)
    }

    /// Pushes a batch whose fence cannot tell and whose queue `drain` drains: its event's
    /// error, whether what it held was released, and the device's health.
    fn with_broken_fence(drain: Drain) -> (String, bool, Arc<Health>) {
        let (c, health) = completer();
        let fence = Arc::new(TestFence {
            broken: true,
            ..Default::default()
        });
        let (e, released) = entry(&fence, drain, false);
        let event = e.event.clone();
        c.push(e);
        let err = event.wait().unwrap_err().to_string();
        (err, released.load(Ordering::SeqCst), health)
    }

    #[test]
    fn a_batch_is_released_once_its_fence_is_passed_and_before_its_event_completes() {
        let (c, _) = completer();
        let fence = Arc::new(TestFence::default());
        let (e, released) = entry(&fence, Box::new(|| unreachable!("no drain")), false);
        let event = e.event.clone();
        let seen = released.clone();
        event.on_complete(move |_| assert!(seen.load(Ordering::SeqCst), "completed first"));
        c.push(e);
        assert!(!event.wait_timeout(Duration::from_millis(20)).unwrap());
        assert!(
            !released.load(Ordering::SeqCst),
            "released before its fence"
        );
        fence.passed.store(true, Ordering::SeqCst);
        event.wait().unwrap();
    }

    #[test]
    fn a_fence_that_cannot_tell_drains_the_queue_before_releasing() {
        let drained = Arc::new(AtomicBool::new(false));
        let d = drained.clone();
        let (err, released, health) = with_broken_fence(Box::new(move || {
            d.store(true, Ordering::SeqCst);
            Ok(())
        }));
        assert!(err.contains("cannot tell"), "{err}");
        assert!(drained.load(Ordering::SeqCst) && released);
        health.check(Device::Emulated(9)).unwrap();
    }

    #[test]
    fn a_failed_drain_keeps_the_memory_and_takes_the_device_out_of_service() {
        let (err, released, health) = with_broken_fence(Box::new(|| {
            Err(Error::DeviceUnavailable {
                device: "emu:9".into(),
                reason: "the queue cannot be drained".into(),
            })
        }));
        // The first failure is the batch's.
        assert!(err.contains("cannot tell"), "{err}");
        assert!(!released, "memory the device may use was freed");
        let refused = health.check(Device::Emulated(9)).unwrap_err().to_string();
        assert!(
            refused.contains("out of service") && refused.contains("cannot be drained"),
            "{refused}"
        );
    }

    #[test]
    fn a_panic_while_releasing_fails_the_event_and_the_completer_goes_on() {
        let (c, _) = completer();
        let fence = Arc::new(TestFence::default());
        fence.passed.store(true, Ordering::SeqCst);
        let (first, _) = entry(&fence, Box::new(|| Ok(())), true);
        let (second, _) = entry(&fence, Box::new(|| Ok(())), false);
        let (a, b) = (first.event.clone(), second.event.clone());
        c.push(first);
        c.push(second);
        let err = a.wait().unwrap_err().to_string();
        assert!(err.contains("internal error: a release panics"), "{err}");
        b.wait().unwrap();
    }
}
