//! A GPU's memory is given back on a thread of its own.
//!
//! `cuMemFree` waits until the whole device is idle. Called where the last reference to a
//! result drops, it would stall that thread for as long as the GPU has work queued: a
//! Python thread inside PyTorch's DLPack deleter (with the GIL held, so every Python
//! thread), or the reaper that completes other transfers. Frees are handed to this thread
//! instead, in order; later is always safe (nothing uses the memory any more). An
//! allocation that finds the device full waits for the frees still queued
//! ([`Freer::wait_idle`]) and tries again.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::device::Device;
use crate::error::{Error, Result};

/// The bytes of the frees handed over and not yet done.
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

/// The handle of a GPU's freeing thread.
pub(crate) struct Freer {
    queue: Mutex<Sender<(u64, usize)>>,
    pending: Arc<Pending>,
    free_now: Arc<dyn Fn(u64) + Send + Sync>,
}

impl Freer {
    /// Starts the thread of `device`; `setup` runs on it first (making the GPU's context
    /// current), then `free` for each address handed over.
    pub(crate) fn spawn(
        device: Device,
        setup: impl FnOnce() + Send + 'static,
        free: impl Fn(u64) + Send + Sync + 'static,
    ) -> Result<Freer> {
        let (tx, rx) = channel::<(u64, usize)>();
        let pending = Arc::new(Pending::default());
        let free: Arc<dyn Fn(u64) + Send + Sync> = Arc::new(free);
        let (on_thread, done) = (free.clone(), pending.clone());
        std::thread::Builder::new()
            .name(format!(
                "tensorferry-{}-freer",
                device.to_string().replace(':', "")
            ))
            .spawn(move || {
                setup();
                for (address, len) in rx {
                    on_thread(address);
                    done.finish(len);
                }
            })
            .map_err(|e| Error::DeviceUnavailable {
                device: device.to_string(),
                reason: format!("cannot start its freeing thread: {e}"),
            })?;
        Ok(Freer {
            queue: Mutex::new(tx),
            pending,
            free_now: free,
        })
    }

    /// Hands `address` (`len` bytes) over to be freed; frees it here if the thread is gone.
    pub(crate) fn free(&self, address: u64, len: usize) {
        self.pending.add(len);
        let sent = self
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send((address, len));
        if sent.is_err() {
            (self.free_now)(address);
            self.pending.finish(len);
        }
    }

    /// Bytes handed over and not freed yet.
    pub(crate) fn pending_bytes(&self) -> usize {
        *self.pending.bytes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until every free handed over so far is done, or `timeout` has passed; true
    /// when none is left.
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

    #[test]
    fn frees_run_on_the_thread_in_order_and_the_caller_does_not_wait_for_them() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let freed = Arc::new(Mutex::new(Vec::new()));
        let set_up = Arc::new(AtomicBool::new(false));
        let (g, f, s) = (gate.clone(), freed.clone(), set_up.clone());
        let freer = Freer::spawn(
            Device::Cuda(0),
            move || s.store(true, Ordering::SeqCst),
            move |address| {
                // Held until the gate opens, as `cuMemFree` is until the GPU is idle.
                let (open, cv) = &*g;
                let mut open = open.lock().unwrap();
                while !*open {
                    open = cv.wait(open).unwrap();
                }
                f.lock().unwrap().push(address);
            },
        )
        .unwrap();
        let start = Instant::now();
        for address in [1, 2, 3] {
            freer.free(address, 100);
        }
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
        assert_eq!(*freed.lock().unwrap(), [1, 2, 3]);
        assert_eq!(freer.pending_bytes(), 0);
        assert!(set_up.load(Ordering::SeqCst));
    }

    #[test]
    fn with_the_thread_gone_a_free_happens_at_once() {
        let freed = Arc::new(Mutex::new(Vec::new()));
        let f = freed.clone();
        // A thread that stops at once (its setup panics), as one that did not survive.
        let freer = Freer::spawn(
            Device::Cuda(0),
            || panic!("the freeing thread is gone"),
            move |address| f.lock().unwrap().push(address),
        )
        .unwrap();
        // Its receiver is dropped once it has unwound.
        let start = Instant::now();
        while freer.queue.lock().unwrap().send((0, 0)).is_ok() {
            assert!(start.elapsed() < Duration::from_secs(20));
            std::thread::sleep(Duration::from_millis(1));
        }
        freer.free(7, 10);
        assert_eq!(*freed.lock().unwrap(), [7]);
        assert!(freer.wait_idle(Duration::from_secs(1)));
    }
}
