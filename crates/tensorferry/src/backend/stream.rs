//! A device thread that runs queued jobs in order: each stream of the emulated device (a
//! batch's job passes the batch's fence, then releases what the batch held and completes
//! its event with the completer's code, as CUDA's completer thread does), and a GPU's
//! freeing thread. A job that panics completes its event with the panic as an internal
//! error, and the thread goes on with the next job: no waiter is left blocked by a bug or a
//! bad setting.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Sender};
use std::sync::Mutex;

use super::event::Event;
use super::event::Failure;
use super::process::spawn_thread;
use crate::device::Device;
use crate::error::Result;

/// The name of an emulated stream's thread, and of the thread in errors.
pub(crate) const STREAM: (&str, &str) = ("stream", "stream");

/// A job on the stream.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The worker thread of one device, fed in order.
pub(crate) struct StreamThread {
    device: Device,
    jobs: Mutex<Sender<(Job, Event)>>,
}

impl StreamThread {
    /// Starts the thread of `device` named after `name` (`what` names it in the error when
    /// it cannot start); `init` runs on it first (e.g. to make a context current).
    pub(crate) fn spawn(
        device: Device,
        (name, what): (&str, &str),
        init: impl FnOnce() + Send + 'static,
    ) -> Result<StreamThread> {
        let (tx, rx) = mpsc::channel::<(Job, Event)>();
        spawn_thread(device, name, what, move || {
            init();
            for (job, event) in rx {
                // What the job holds is dropped as the panic unwinds, before the event
                // completes; a job that completed its event before panicking keeps that
                // outcome.
                if let Err(panic) = catch_unwind(AssertUnwindSafe(job)) {
                    event.complete(Err(Failure::internal(device, &*panic)));
                }
            }
        })?;
        Ok(StreamThread {
            device,
            jobs: Mutex::new(tx),
        })
    }

    /// Queues `job`, which completes `event`; gives the job back if the thread is gone.
    pub(crate) fn try_queue(&self, job: Job, event: &Event) -> std::result::Result<(), Job> {
        self.jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send((job, event.clone()))
            .map_err(|unsent| unsent.0 .0)
    }

    /// The failure of work queued after the thread stopped.
    pub(crate) fn stopped(&self) -> Failure {
        Failure::new(self.device, "the stream thread has stopped")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_panicking_job_fails_its_event_and_the_thread_runs_the_next() {
        let stream = StreamThread::spawn(Device::Emulated(0), STREAM, || {}).unwrap();
        let first = Event::pending();
        let queued = stream.try_queue(Box::new(|| panic!("a job fails")), &first);
        assert!(queued.is_ok());
        let second = Event::pending();
        let done = second.clone();
        let queued = stream.try_queue(Box::new(move || done.complete(Ok(()))), &second);
        assert!(queued.is_ok());
        let err = first.wait().unwrap_err().to_string();
        assert!(
            err.contains("emu:0") && err.contains("internal error: a job fails"),
            "{err}"
        );
        assert!(second.wait_timeout(Duration::from_secs(10)).unwrap());
    }
}
