//! A stream as both backends run it: one worker thread per device that runs queued jobs
//! in order, each completing its event.

use std::sync::mpsc::{self, Sender};
use std::sync::Mutex;

use super::Event;
use crate::device::Device;
use crate::error::{Error, Result};

/// A job on the stream.
pub type Job = Box<dyn FnOnce() + Send>;

/// The worker thread of one device, fed in order.
pub struct StreamThread {
    jobs: Mutex<Sender<Job>>,
}

impl StreamThread {
    /// Starts the thread for `device`; `init` runs on it first (e.g. to make a context
    /// current).
    pub fn spawn(device: Device, init: impl FnOnce() + Send + 'static) -> Result<StreamThread> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(format!(
                "tensorferry-{}-stream",
                device.to_string().replace(':', "")
            ))
            .spawn(move || {
                init();
                for job in rx {
                    job();
                }
            })
            .map_err(|e| Error::DeviceUnavailable {
                device: device.to_string(),
                reason: format!("cannot start its stream thread: {e}"),
            })?;
        Ok(StreamThread {
            jobs: Mutex::new(tx),
        })
    }

    /// Queues `job`, which completes `event`; if the thread is gone, completes `event` with
    /// that error instead (dropping the job, and what it holds, afterwards).
    pub fn queue(&self, job: Job, event: &Event) {
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job);
        if let Err(unsent) = sent {
            event.complete(Err("the stream thread has stopped".into()));
            drop(unsent);
        }
    }
}
