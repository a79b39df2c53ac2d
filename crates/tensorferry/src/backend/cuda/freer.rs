//! A GPU's memory is given back on a thread of its own.
//!
//! `cuMemFree` and `cuMemFreeHost` wait until the GPU is idle. Called where the last
//! reference to a result drops, they would stall that thread for as long as the GPU has
//! work queued: a Python thread inside PyTorch's DLPack deleter (with the GIL held, so every
//! Python thread), or the completer that completes other transfers. Every call of that kind
//! (device and pinned frees, the fence of lent pinned memory) is handed to this thread
//! instead, in order; later is always safe (nothing uses the memory any more). An
//! allocation that finds the device full waits for the device frees still queued
//! ([`Freer::wait_idle`]) and tries again.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::backend::event::Event;
use crate::backend::stream::StreamThread;
use crate::device::Device;
use crate::error::Result;

/// Work for the freeing thread: a driver call that may wait for the GPU.
pub(crate) use crate::backend::stream::Job;

/// The bytes of device memory handed over to be freed and not freed yet.
#[derive(Default)]
struct Pending {
    bytes: Mutex<usize>,
    done: Condvar,
}

impl Pending {
    fn add(&self, len: usize) {
        *self.bytes.lock().unwrap_or_else(|p| p.into_inner()) += len;
    }

    fn finish(&self, len: usize) {
        let mut n = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(len);
        if *n == 0 {
            self.done.notify_all();
        }
    }
}

/// The handle of a GPU's freeing thread: a [`StreamThread`] whose jobs are frees.
pub(crate) struct Freer {
    thread: StreamThread,
    pending: Arc<Pending>,
}

impl Freer {
    /// Starts the thread of `device`; `setup` runs on it first (making the GPU's context
    /// current), then each job handed over, in order.
    pub(crate) fn spawn(device: Device, setup: impl FnOnce() + Send + 'static) -> Result<Freer> {
        Ok(Freer {
            thread: StreamThread::spawn(device, ("freer", "freeing"), setup)?,
            pending: Arc::new(Pending::default()),
        })
    }

    /// Hands `job` over: a free of `len` bytes of device memory (0 for other work, which
    /// [`Freer::wait_idle`] does not wait for). Runs it here if the thread is gone.
    pub(crate) fn run(&self, len: usize, job: Job) {
        self.pending.add(len);
        let done = self.pending.clone();
        let job: Job = Box::new(move || {
            // A job that panics must not stop the frees behind it.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            done.finish(len);
        });
        if let Err(unsent) = self.thread.try_queue(job, &Event::pending()) {
            unsent();
        }
    }

    /// Bytes of device memory handed over and not freed yet.
    pub(crate) fn pending_bytes(&self) -> usize {
        *self.pending.bytes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until every device free handed over so far is done, or `timeout` has passed;
    /// true when none is left.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> bool {
        let n = self.pending.bytes.lock().unwrap_or_else(|p| p.into_inner());
        let (n, _) = self
            .pending
            .done
            .wait_timeout_while(n, timeout, |n| *n > 0)
            .unwrap_or_else(|p| p.into_inner());
        *n == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    /// A job that records `address` once `gate` opens, as `cuMemFree` returns once the GPU
    /// is idle.
    fn held_free(
        gate: &Arc<(Mutex<bool>, Condvar)>,
        freed: &Arc<Mutex<Vec<u64>>>,
        address: u64,
    ) -> Job {
        let (g, f) = (gate.clone(), freed.clone());
        Box::new(move || {
            let (open, cv) = &*g;
            let mut open = open.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            f.lock().unwrap().push(address);
        })
    }

    #[test]
    fn frees_run_on_the_thread_in_order_and_the_caller_does_not_wait_for_them() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let freed = Arc::new(Mutex::new(Vec::new()));
        let set_up = Arc::new(AtomicBool::new(false));
        let s = set_up.clone();
        let freer = Freer::spawn(Device::Cuda(0), move || s.store(true, Ordering::SeqCst)).unwrap();
        let start = Instant::now();
        for address in [1, 2, 3] {
            freer.run(100, held_free(&gate, &freed, address));
        }
        // Other work (a pinned free) is in order too, and not counted as device bytes.
        freer.run(0, held_free(&gate, &freed, 4));
        assert_eq!(freer.pending_bytes(), 300);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the caller waited"
        );
        assert!(
            !freer.wait_idle(Duration::from_millis(30)),
            "freed before the gate opened"
        );
        assert!(freed.lock().unwrap().is_empty());
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        assert!(freer.wait_idle(Duration::from_secs(20)));
        assert_eq!(freer.pending_bytes(), 0);
        assert!(set_up.load(Ordering::SeqCst));
        // The last job runs after the device frees: wait for it through one more.
        let (tx, rx) = std::sync::mpsc::channel();
        freer.run(0, Box::new(move || tx.send(()).unwrap()));
        rx.recv_timeout(Duration::from_secs(20)).unwrap();
        assert_eq!(*freed.lock().unwrap(), [1, 2, 3, 4]);
    }

    #[test]
    fn with_the_thread_gone_a_free_happens_at_once() {
        let freed = Arc::new(Mutex::new(Vec::new()));
        // A thread that stops at once (its setup panics), as one that did not survive.
        let freer = Freer::spawn(Device::Cuda(0), || panic!("the freeing thread is gone")).unwrap();
        // Its receiver is dropped once it has unwound.
        let start = Instant::now();
        while freer
            .thread
            .try_queue(Box::new(|| {}), &Event::pending())
            .is_ok()
        {
            assert!(start.elapsed() < Duration::from_secs(20));
            std::thread::sleep(Duration::from_millis(1));
        }
        let f = freed.clone();
        freer.run(10, Box::new(move || f.lock().unwrap().push(7)));
        assert_eq!(*freed.lock().unwrap(), [7]);
        assert!(freer.wait_idle(Duration::from_secs(1)));
    }
}
