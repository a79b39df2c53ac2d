//! Completion events: recorded when work is queued, completed by the stream that runs it,
//! waited on by every reader. A failed copy completes its event with the error, which
//! every waiter then sees.

use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};

#[derive(Debug, Default)]
struct State {
    done: Mutex<Option<std::result::Result<(), String>>>,
    cv: Condvar,
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
    pub fn complete(&self, result: std::result::Result<(), String>) {
        let mut done = self.0.done.lock().unwrap_or_else(|p| p.into_inner());
        if done.is_none() {
            *done = Some(result);
        }
        self.0.cv.notify_all();
    }

    /// True when the work has finished (successfully or not).
    pub fn is_ready(&self) -> bool {
        self.0
            .done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Blocks until the work finishes; its failure, if any, as an error naming `device`.
    pub fn wait(&self, device: &str) -> Result<()> {
        let mut done = self.0.done.lock().unwrap_or_else(|p| p.into_inner());
        while done.is_none() {
            done = self.0.cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
        match done.as_ref().expect("set") {
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
