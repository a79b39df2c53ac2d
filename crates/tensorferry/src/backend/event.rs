//! Completion events: recorded when work is queued, completed by the stream that runs it,
//! waited on by every reader. A failed copy completes its event with the error, which
//! every waiter then sees. Work that depends on an event can also be chained to it
//! ([`Event::on_complete`]) instead of blocking a thread until it completes.

use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};

/// What an event completes with: success, or the reason of the failure.
pub type Outcome = std::result::Result<(), String>;

type Callback = Box<dyn FnOnce(&Outcome) + Send>;

#[derive(Default)]
struct Inner {
    outcome: Option<Outcome>,
    callbacks: Vec<Callback>,
}

#[derive(Default)]
struct State {
    done: Mutex<Inner>,
    cv: Condvar,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.done.lock().unwrap_or_else(|p| p.into_inner());
        write!(f, "Event({:?})", inner.outcome)
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

    /// Marks the work done (or failed with a reason) and wakes every waiter.
    /// Callbacks chained with [`Event::on_complete`] run on this thread, after the waiters
    /// are woken. Completing twice keeps the first outcome.
    pub fn complete(&self, result: Outcome) {
        let mut done = self.0.done.lock().unwrap_or_else(|p| p.into_inner());
        if done.outcome.is_some() {
            return;
        }
        let callbacks = std::mem::take(&mut done.callbacks);
        done.outcome = Some(result.clone());
        self.0.cv.notify_all();
        drop(done);
        for f in callbacks {
            f(&result);
        }
    }

    /// Runs `f` with the outcome once the event completes: at once (on this thread) if it
    /// has, else on the thread that completes it — so `f` must be quick and must not wait
    /// for work queued after it.
    pub fn on_complete(&self, f: impl FnOnce(&Outcome) + Send + 'static) {
        let mut done = self.0.done.lock().unwrap_or_else(|p| p.into_inner());
        match done.outcome.clone() {
            Some(outcome) => {
                drop(done);
                f(&outcome);
            }
            None => done.callbacks.push(Box::new(f)),
        }
    }

    /// True when the work has finished (successfully or not).
    pub fn is_ready(&self) -> bool {
        self.0
            .done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .outcome
            .is_some()
    }

    /// Blocks until the work finishes; its failure, if any, as an error naming `device`.
    pub fn wait(&self, device: &str) -> Result<()> {
        let mut done = self.0.done.lock().unwrap_or_else(|p| p.into_inner());
        while done.outcome.is_none() {
            done = self.0.cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
        match done.outcome.as_ref().expect("set") {
            Ok(()) => Ok(()),
            Err(reason) => Err(Error::DeviceUnavailable {
                device: device.to_string(),
                reason: format!("a queued copy failed: {reason}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiters_see_completion_from_another_thread() {
        let e = Event::pending();
        assert!(!e.is_ready());
        let done = e.clone();
        let t = std::thread::spawn(move || done.complete(Ok(())));
        e.wait("emu:0").unwrap();
        assert!(e.is_ready());
        t.join().unwrap();
    }

    #[test]
    fn chained_work_runs_once_on_completion_or_at_once_when_already_complete() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let e = Event::pending();
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        e.on_complete(move |o| {
            assert!(o.is_err());
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        e.complete(Err("failed".into()));
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
    fn a_failure_reaches_every_waiter() {
        let e = Event::pending();
        e.complete(Err("injected".into()));
        assert!(e
            .wait("emu:0")
            .unwrap_err()
            .to_string()
            .contains("injected"));
        assert!(e.clone().wait("emu:0").is_err());
    }
}
