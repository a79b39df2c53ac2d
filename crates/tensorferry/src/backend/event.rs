//! Completion events: recorded when work is queued, completed by the stream that runs it,
//! waited on by every reader. A failed copy completes its event with a [`Failure`] naming
//! the device whose work failed, which every waiter then sees. Work that depends on an
//! event can also be chained to it ([`Event::on_complete`]) instead of blocking a thread
//! until it completes; a waiter that must stay responsive (to Ctrl-C, say) waits in slices
//! with [`Event::wait_timeout`].
//!
//! An event of device work also carries, from the moment its copies are queued, the
//! device's [`Fence`] after them (its *device mark*; on CUDA, an event recorded after them):
//! later work on that device, or another library's stream, that depends on it waits on the
//! device instead of on the host. The mark is dropped once the host event completes.

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::fence::Fence;
use crate::error::{Error, Result};

/// Why queued work failed: the device whose work it was, and what went wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The device that ran (or was to run) the failed work, e.g. `emu:0` or `cuda:1`;
    /// never the host a result was meant for.
    pub device: String,
    /// What went wrong.
    pub reason: String,
}

impl Failure {
    /// A failure of `device`'s work.
    pub fn new(device: impl fmt::Display, reason: impl Into<String>) -> Failure {
        Failure {
            device: device.to_string(),
            reason: reason.into(),
        }
    }

    /// A panic caught on a worker thread doing `device`'s work:
    /// `internal error: <panic message>`.
    pub fn internal(device: impl fmt::Display, panic: &(dyn Any + Send)) -> Failure {
        Failure::new(device, format!("internal error: {}", panic_message(panic)))
    }

    /// `error` as a failure of `device`'s work; an error that names a device already
    /// ([`Error::DeviceUnavailable`], as driver calls give, or the [`Error::Copy`] of work
    /// it waited for) keeps its own.
    pub fn from_error(device: impl fmt::Display, error: &Error) -> Failure {
        match error {
            Error::DeviceUnavailable { device, reason } | Error::Copy { device, reason } => {
                Failure::new(device, reason.clone())
            }
            other => Failure::new(device, other.to_string()),
        }
    }

    /// The error a reader of the work's results gets: [`Error::Copy`], naming the device
    /// and the cause (a failed copy is not an unavailable device).
    pub fn to_error(&self) -> Error {
        Error::Copy {
            device: self.device.clone(),
            reason: self.reason.clone(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.device, self.reason)
    }
}

/// The message of a caught panic (`panic!`'s text, when it has one).
pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Runs `work` for `device`, turning a panic in it into a [`Failure::internal`], so that
/// a worker thread completes its event whatever happens.
pub(crate) fn guarded(device: impl fmt::Display, work: impl FnOnce() -> Outcome) -> Outcome {
    catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|p| Err(Failure::internal(device, &*p)))
}

/// What an event completes with: success, or the failure.
pub type Outcome = std::result::Result<(), Failure>;

type Callback = Box<dyn FnOnce(&Outcome) + Send>;

#[derive(Default)]
struct Inner {
    outcome: Option<Outcome>,
    callbacks: Vec<Callback>,
    /// The device's fence after the work, while it is pending.
    mark: Option<Arc<dyn Fence>>,
}

/// Where pending work stands, as a device that could wait for it on the GPU sees it.
pub(crate) enum Progress {
    /// Done, with this outcome.
    Done(Outcome),
    /// Queued on a device, behind this fence.
    Queued(Arc<dyn Fence>),
    /// Not queued on a GPU yet (host work, or CUDA work still waiting for host work).
    Pending,
}

#[derive(Default)]
struct State {
    done: Mutex<Inner>,
    cv: Condvar,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.done.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event({:?})", self.lock().outcome)
    }
}

/// The completion of queued work, shared by the producer and every waiter.
#[derive(Clone, Debug, Default)]
pub struct Event(Arc<State>);

impl Event {
    /// An event not yet completed.
    pub fn pending() -> Event {
        Event::default()
    }

    /// An event that is already complete.
    pub fn ready() -> Event {
        let e = Event::default();
        e.complete(Ok(()));
        e
    }

    /// Marks the work done (or failed) and wakes every waiter. Callbacks chained with
    /// [`Event::on_complete`] run on this thread, after the waiters are woken, each on
    /// its own: one that panics neither stops the others nor reaches the caller.
    /// Completing twice keeps the first outcome. Crate-private: memory behind an event
    /// is handed out once the event completes, so only the work it stands for may
    /// complete it.
    pub(crate) fn complete(&self, result: Outcome) {
        let mut done = self.0.lock();
        if done.outcome.is_some() {
            return;
        }
        let callbacks = std::mem::take(&mut done.callbacks);
        let mark = done.mark.take();
        done.outcome = Some(result.clone());
        self.0.cv.notify_all();
        drop(done);
        drop(mark);
        for f in callbacks {
            // A panicking callback is its own failure (callbacks that complete other
            // events catch their panics themselves); the others still run.
            let _ = catch_unwind(AssertUnwindSafe(|| f(&result)));
        }
    }

    /// Runs `f` with the outcome once the event completes: at once (on this thread) if it
    /// has, else on the thread that completes it — so `f` must be quick and must not wait
    /// for work queued after it.
    pub fn on_complete(&self, f: impl FnOnce(&Outcome) + Send + 'static) {
        let mut done = self.0.lock();
        match done.outcome.clone() {
            Some(outcome) => {
                drop(done);
                f(&outcome);
            }
            None => done.callbacks.push(Box::new(f)),
        }
    }

    /// Marks the work as queued on a GPU behind `mark` (ignored once complete).
    pub(crate) fn set_mark(&self, mark: Arc<dyn Fence>) {
        let mut done = self.0.lock();
        if done.outcome.is_none() {
            done.mark = Some(mark);
            self.0.cv.notify_all();
        }
    }

    /// Blocks until the work is queued on a GPU or finished, or `timeout` has passed:
    /// `true` in the first two cases.
    pub(crate) fn wait_queued_timeout(&self, timeout: Duration) -> bool {
        self.wait_until(Some(timeout), |d| d.outcome.is_some() || d.mark.is_some())
            .1
    }

    /// Blocks until `ready` holds of the state, or `timeout` (`None`: no limit) has passed;
    /// the state, and whether `ready` held. A timeout too long for the clock waits as long
    /// as it takes.
    fn wait_until(
        &self,
        timeout: Option<Duration>,
        ready: impl Fn(&Inner) -> bool,
    ) -> (MutexGuard<'_, Inner>, bool) {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut done = self.0.lock();
        while !ready(&done) {
            let Some(deadline) = deadline else {
                done = self.0.cv.wait(done).unwrap_or_else(|p| p.into_inner());
                continue;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (done, false);
            }
            done = self
                .0
                .cv
                .wait_timeout(done, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        (done, true)
    }

    /// Where the work stands, read at once (one lock): done, queued on a GPU, or pending.
    pub(crate) fn progress(&self) -> Progress {
        let done = self.0.lock();
        match (&done.outcome, &done.mark) {
            (Some(outcome), _) => Progress::Done(outcome.clone()),
            (None, Some(mark)) => Progress::Queued(mark.clone()),
            (None, None) => Progress::Pending,
        }
    }

    /// True when work on a GPU can be ordered after this event without a host wait:
    /// complete, or queued on a GPU.
    pub(crate) fn is_queued_or_ready(&self) -> bool {
        !matches!(self.progress(), Progress::Pending)
    }

    /// True when the work has finished (successfully or not).
    pub fn is_ready(&self) -> bool {
        self.0.lock().outcome.is_some()
    }

    /// The outcome if the work has finished, without waiting.
    pub fn peek(&self) -> Option<Outcome> {
        self.0.lock().outcome.clone()
    }

    /// Blocks until the work finishes; its outcome.
    pub fn wait_outcome(&self) -> Outcome {
        let (done, _) = self.wait_until(None, |d| d.outcome.is_some());
        done.outcome.clone().expect("waited for the outcome")
    }

    /// Blocks until the work finishes; its failure, if any, as an error naming the device
    /// whose work failed.
    pub fn wait(&self) -> Result<()> {
        self.wait_outcome().map_err(|f| f.to_error())
    }

    /// Blocks until the work finishes or `timeout` has passed, whichever comes first:
    /// `Ok(true)` when it finished, `Ok(false)` on timeout, the failure (as in
    /// [`Event::wait`]) when it failed. A caller that must stay responsive waits in slices.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        let (done, _) = self.wait_until(Some(timeout), |d| d.outcome.is_some());
        match &done.outcome {
            Some(Ok(())) => Ok(true),
            Some(Err(f)) => Err(f.to_error()),
            None => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn waiting_to_be_queued_with_no_deadline_waits_for_completion() {
        let e = Event::pending();
        let done = e.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            done.complete(Ok(()));
        });
        assert!(e.wait_queued_timeout(Duration::MAX));
        assert!(e.is_ready(), "returned before the work was queued or done");
        t.join().unwrap();
        assert!(!Event::pending().wait_queued_timeout(Duration::from_millis(5)));
    }

    #[test]
    fn waiters_see_completion_from_another_thread() {
        let e = Event::pending();
        assert!(!e.is_ready());
        let done = e.clone();
        let t = std::thread::spawn(move || done.complete(Ok(())));
        e.wait().unwrap();
        assert!(e.is_ready());
        t.join().unwrap();
    }

    #[test]
    fn chained_work_runs_once_on_completion_or_at_once_when_already_complete() {
        let e = Event::pending();
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        e.on_complete(move |o| {
            assert!(o.is_err());
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        e.complete(Err(Failure::new("emu:0", "failed")));
        e.complete(Ok(()));
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "once, with the first outcome"
        );
        let r = runs.clone();
        e.on_complete(move |_| {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_failure_reaches_every_waiter_naming_the_device_that_failed() {
        let e = Event::pending();
        e.complete(Err(Failure::new("emu:1", "injected")));
        let err = e.wait().unwrap_err();
        assert!(
            matches!(&err, Error::Copy { device, reason } if device == "emu:1" && reason == "injected"),
            "a failed copy, not an unavailable device: {err:?}"
        );
        let err = err.to_string();
        assert!(err.contains("injected") && err.contains("emu:1"), "{err}");
        assert!(e.clone().wait().is_err());
        assert!(e.wait_timeout(Duration::ZERO).is_err());
        assert_eq!(e.peek(), Some(Err(Failure::new("emu:1", "injected"))));
    }

    #[test]
    fn a_timed_wait_returns_false_until_the_work_is_done() {
        let e = Event::pending();
        let started = Instant::now();
        assert!(!e.wait_timeout(Duration::from_millis(20)).unwrap());
        assert!(started.elapsed() >= Duration::from_millis(20));
        let done = e.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            done.complete(Ok(()));
        });
        while !e.wait_timeout(Duration::from_millis(5)).unwrap() {}
        assert!(e.wait_timeout(Duration::MAX).unwrap(), "no overflow");
        t.join().unwrap();
    }

    #[test]
    fn a_panicking_callback_skips_no_other_and_stays_on_its_thread() {
        let e = Event::pending();
        let runs = Arc::new(AtomicUsize::new(0));
        let (before, after) = (runs.clone(), runs.clone());
        let chained = Event::pending();
        let c = chained.clone();
        e.on_complete(move |_| {
            before.fetch_add(1, Ordering::SeqCst);
        });
        e.on_complete(|_| panic!("a callback fails"));
        e.on_complete(move |o| {
            after.fetch_add(1, Ordering::SeqCst);
            c.complete(o.clone());
        });
        e.complete(Ok(()));
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert!(chained.wait_timeout(Duration::ZERO).unwrap());
        // The event still works for later waiters and callbacks.
        e.wait().unwrap();
        e.on_complete(move |_| {
            runs.fetch_add(1, Ordering::SeqCst);
        });
    }

    #[test]
    fn guarded_work_turns_a_panic_into_an_internal_error() {
        let outcome = guarded("emu:0", || panic!("boom {}", 7));
        let failure = outcome.unwrap_err();
        assert_eq!(failure.device, "emu:0");
        assert_eq!(failure.reason, "internal error: boom 7");
        assert_eq!(guarded("cpu", || Ok(())), Ok(()));
    }
}
