//! The transfer engine's host workers: one pool of at most [`max_workers`] threads, started
//! as work arrives and kept, that runs every piece of host work of the engine (a staging
//! ring's driver, a host copy that waits for its sources, the shares of a large host
//! copy). However many transfers run at once, the process holds no more threads for them
//! than that: work beyond it waits in a queue, first come, first served.
//!
//! Jobs may block (a ring's driver waits for its copies), yet they cannot deadlock the
//! pool: a job waits only for events that exist when it is queued — copies on a device,
//! which the backend completes without the pool, and jobs queued before it, which start
//! first — so the oldest unfinished job is always running and always progresses. A share
//! of a split copy ([`share_out`]) is help, never a dependency: the thread that splits the
//! copy takes every share no worker has taken.
//!
//! Each job completes its event with its outcome, or with its panic as an internal error:
//! a waiter is never left blocked, and a worker survives the panic.

use std::collections::VecDeque;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use super::event::Event;
use super::event::{guarded, panic_message, Outcome};
use crate::error::{Error, Result};

/// The most threads the pool runs: the machine's cores, at least 4 (jobs mostly wait for
/// a device, so a small machine still overlaps a few transfers) and at most 16.
pub(crate) fn max_workers() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .clamp(4, 16)
    })
}

type Job = Box<dyn FnOnce() + Send>;

/// The queue and the threads serving it.
struct Pool {
    state: Mutex<State>,
    wake: Condvar,
}

struct State {
    queue: VecDeque<Job>,
    /// Threads started (they never stop).
    threads: usize,
    /// Threads waiting for a job.
    idle: usize,
    /// The process that started the threads: a child forked since has none of them.
    owner: u32,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            threads: 0,
            idle: 0,
            owner: std::process::id(),
        }),
        wake: Condvar::new(),
    })
}

impl Pool {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job`, starting a thread when every started one is busy and there is room.
    /// Fails only when no thread runs and none can be started (the job is dropped).
    fn execute(&'static self, job: Job) -> std::io::Result<()> {
        let mut state = self.lock();
        let me = std::process::id();
        if state.owner != me {
            // Forked: the parent's threads and queued jobs do not exist here. The jobs
            // are the parent's; they are forgotten, not run or dropped.
            std::mem::forget(std::mem::take(&mut state.queue));
            state.threads = 0;
            state.idle = 0;
            state.owner = me;
        }
        state.queue.push_back(job);
        if state.queue.len() > state.idle && state.threads < max_workers() {
            let started = std::thread::Builder::new()
                .name("tensorferry-worker".into())
                .spawn(move || self.serve());
            match started {
                Ok(_) => state.threads += 1,
                Err(e) if state.threads == 0 => {
                    state.queue.pop_back();
                    return Err(e);
                }
                // The threads already running will get to it.
                Err(_) => {}
            }
        }
        drop(state);
        self.wake.notify_one();
        Ok(())
    }

    /// A worker's life: run jobs, oldest first, forever. A job's panic is its own
    /// business (jobs catch their own); one that escapes does not stop the worker.
    fn serve(&self) {
        loop {
            let job = {
                let mut state = self.lock();
                loop {
                    if let Some(job) = state.queue.pop_front() {
                        break job;
                    }
                    state.idle += 1;
                    state = self.wake.wait(state).unwrap_or_else(|p| p.into_inner());
                    state.idle -= 1;
                }
            };
            let _ = catch_unwind(AssertUnwindSafe(job));
        }
    }
}

/// Runs `work` on the pool, then completes `event` with its outcome (a panic becomes
/// [`super::event::Failure::internal`] of `device`). What `work` holds is dropped before
/// `event` completes. Fails only when no worker thread can be started at all.
pub(crate) fn run_on_pool(
    device: impl fmt::Display + Send + 'static,
    event: Event,
    work: impl FnOnce() -> Outcome + Send + 'static,
) -> Result<()> {
    let label = device.to_string();
    pool()
        .execute(Box::new(move || event.complete(guarded(device, work))))
        .map_err(|e| Error::DeviceUnavailable {
            device: label,
            reason: format!("cannot start a worker thread: {e}"),
        })
}

/// Calls `work(i)` for every `i` in `0..n` exactly once, on the calling thread and on up
/// to `helpers` pool workers that are free to help, and returns when every call has
/// returned: `Err` with the message of a call that panicked. Helpers that come late find
/// nothing left and only drop their handle on `work`, so `work` must own (or share) what
/// it touches.
pub(crate) fn share_out(
    n: usize,
    helpers: usize,
    work: Arc<dyn Fn(usize) + Send + Sync>,
) -> std::result::Result<(), String> {
    let shares = Arc::new(Shares {
        next: AtomicUsize::new(0),
        n,
        work,
        state: Mutex::new(Helping::default()),
        done: Condvar::new(),
    });
    for _ in 0..helpers.min(n.saturating_sub(1)) {
        let shares = shares.clone();
        if pool().execute(Box::new(move || shares.help())).is_err() {
            break;
        }
    }
    shares.take_all();
    let mut state = shares.lock();
    state.closed = true;
    while state.active > 0 {
        state = shares.done.wait(state).unwrap_or_else(|p| p.into_inner());
    }
    state.panic.take().map_or(Ok(()), Err)
}

/// One split piece of work and who is on it.
struct Shares {
    next: AtomicUsize,
    n: usize,
    work: Arc<dyn Fn(usize) + Send + Sync>,
    state: Mutex<Helping>,
    done: Condvar,
}

#[derive(Default)]
struct Helping {
    /// Helpers taking shares now.
    active: usize,
    /// The caller has stopped waiting for helpers: none may start.
    closed: bool,
    /// The first panic's message.
    panic: Option<String>,
}

impl Shares {
    fn lock(&self) -> MutexGuard<'_, Helping> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes and runs shares until none is left.
    fn take_all(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.work)(i))) {
                self.lock().panic.get_or_insert(panic_message(&*p));
            }
        }
    }

    /// A worker's help: shares, if the caller still waits for helpers.
    fn help(&self) {
        {
            let mut state = self.lock();
            if state.closed {
                return;
            }
            state.active += 1;
        }
        self.take_all();
        self.lock().active -= 1;
        self.done.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::event::Failure;

    #[test]
    fn a_panicking_job_fails_its_event_instead_of_leaving_it_pending() {
        let event = Event::pending();
        run_on_pool("emu:0", event.clone(), || panic!("worker bug")).unwrap();
        let err = event.wait().unwrap_err().to_string();
        assert!(err.contains("internal error: worker bug"), "{err}");
        let event = Event::pending();
        run_on_pool("emu:0", event.clone(), || {
            Err(Failure::new("emu:1", "its own"))
        })
        .unwrap();
        assert!(event.wait().unwrap_err().to_string().contains("emu:1"));
        // The pool still serves after the panic.
        let event = Event::pending();
        run_on_pool("emu:0", event.clone(), || Ok(())).unwrap();
        event.wait().unwrap();
    }

    #[test]
    fn every_share_runs_once_and_a_panicking_share_is_the_error() {
        let seen: Arc<Vec<AtomicUsize>> = Arc::new((0..100).map(|_| AtomicUsize::new(0)).collect());
        let counts = seen.clone();
        share_out(
            100,
            8,
            Arc::new(move |i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            }),
        )
        .unwrap();
        assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        let err = share_out(
            10,
            3,
            Arc::new(|i| {
                if i == 7 {
                    panic!("share seven fails")
                }
            }),
        )
        .unwrap_err();
        assert_eq!(err, "share seven fails");
    }

    #[test]
    fn more_jobs_than_workers_all_run_on_at_most_max_workers_threads() {
        let events: Vec<Event> = (0..4 * max_workers())
            .map(|_| {
                let event = Event::pending();
                run_on_pool("cpu", event.clone(), || {
                    std::thread::yield_now();
                    Ok(())
                })
                .unwrap();
                event
            })
            .collect();
        for e in events {
            e.wait().unwrap();
        }
        assert!(pool().lock().threads <= max_workers());
    }
}
