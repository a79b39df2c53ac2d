//! The ranged GETs of one read, drained into the caller's buffer on the runtime's workers.
//!
//! A part's body arrives on a worker (the connection's task) and is copied into its place
//! by a task on a worker too, usually the same one, while the bytes are still in its cache:
//! the caller's thread neither copies every chunk nor is woken for each. That made a 1 GB
//! object load 5–11 % faster on loopback, in alternated runs, than draining every part on
//! the caller's thread (docs/benchmarks.md, object storage).
//!
//! The tasks write into memory the caller lends them. [`fetch_spawned`] is built like
//! `std::thread::scope`: it returns, or unwinds, only once every task it started has ended
//! (run to its end, or aborted and dropped), so no task outlives the borrow.

use std::collections::{HashMap, VecDeque};
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::task::JoinHandle;

use super::failure::{failed, Cause};
use super::get::{drain_into, request_part, Asked, Version};
use super::location::Location;
use super::runtime;
use crate::error::Result;

/// One part of the caller's buffer, lent to the task that fills it: the address and
/// length of a `&mut [MaybeUninit<u8>]` that [`fetch_spawned`] holds, disjoint from every
/// other part of the same call.
struct Lent {
    ptr: *mut MaybeUninit<u8>,
    len: usize,
}

// SAFETY: a `Lent` is the only way to its bytes while a task holds it: it was made from an
// exclusive borrow that `fetch_spawned` keeps (and uses for nothing else) until every task
// has ended, and the parts of one call are disjoint. Moving it to a worker thread is
// moving that exclusive access, as sending the `&mut` slice would be.
unsafe impl Send for Lent {}

/// The parts still to fetch, taken one at a time by the lanes.
type Queue = Arc<Mutex<VecDeque<(Range<u64>, Lent)>>>;

/// How many tasks of one [`fetch_spawned`] call have not ended yet.
type Live = Arc<(Mutex<usize>, Condvar)>;

/// Counts one task as live until dropped with its future (run to its end, or aborted).
struct Alive(Live);

impl Drop for Alive {
    fn drop(&mut self) {
        let (count, ended) = &*self.0;
        *count.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        ended.notify_all();
    }
}

/// The tasks of one [`fetch_spawned`] call, awaited with [`Lanes::join`].
pub(super) struct Lanes {
    tasks: Vec<JoinHandle<Result<()>>>,
    live: Live,
    /// The object, for messages.
    url: String,
}

impl Lanes {
    /// Waits for every part to be in; the first failure is returned at once (the other
    /// tasks are then stopped by [`fetch_spawned`] before it returns).
    pub(super) async fn join(&mut self) -> Result<()> {
        let mut pending: FuturesUnordered<_> = self.tasks.iter_mut().collect();
        while let Some(ended) = pending.next().await {
            match ended {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(failed("read", &self.url, Cause::Other, e.to_string())),
            }
        }
        Ok(())
    }
}

/// Fills each `(range, into)` of `jobs` with the bytes `range` of the object at `at` by
/// one ranged GET, as [`request_part`] and [`drain_into`] do; see [`fetch_spawned_with`].
/// `ahead`, if any, holds GETs of some of the ranges asked for already (by their range's
/// first byte): their answers are drained instead of asking again.
pub(super) fn fetch_spawned<R>(
    at: &Location,
    jobs: Vec<(Range<u64>, &mut [MaybeUninit<u8>])>,
    version: &Version,
    concurrency: usize,
    ahead: Option<HashMap<u64, Asked>>,
    alongside: impl FnOnce(&mut Lanes) -> R,
) -> Result<R> {
    let url = at.url().to_string();
    let (at, version) = (at.clone(), version.clone());
    let ahead = Arc::new(Mutex::new(ahead.unwrap_or_default()));
    let fetch = part_fetcher(move |range, into| {
        let (at, version, ahead) = (at.clone(), version.clone(), ahead.clone());
        async move {
            let asked = (ahead.lock().unwrap_or_else(|p| p.into_inner())).remove(&range.start);
            let answer = match asked {
                Some(asked) => asked.answer(&at).await?,
                None => request_part(&at, range.clone(), &version).await?,
            };
            drain_into(&at, range, answer, into).await
        }
        .boxed()
    });
    fetch_spawned_with(url, jobs, concurrency, fetch, alongside)
}

/// Fills each `(range, into)` of `jobs` as [`fetch_spawned`] does (taking the answers of
/// the GETs `ahead` holds), waiting on this thread for all of them; the first failure
/// stops the others.
pub(super) fn fetch_all(
    at: &Location,
    jobs: Vec<(Range<u64>, &mut [MaybeUninit<u8>])>,
    version: &Version,
    concurrency: usize,
    ahead: Option<HashMap<u64, Asked>>,
) -> Result<()> {
    fetch_spawned(at, jobs, version, concurrency, ahead, |lanes| {
        runtime::block_on(lanes.join())
    })??
}

/// `fetch`, typed as [`fetch_spawned_with`] takes it (for any lifetime of the slice: a
/// closure's type is only inferred so when it is passed where that is asked).
fn part_fetcher<F>(fetch: F) -> F
where
    F: for<'b> Fn(Range<u64>, &'b mut [MaybeUninit<u8>]) -> BoxFuture<'b, Result<()>>,
{
    fetch
}

/// Runs `fetch(range, into)` for each `(range, into)` of `jobs`, `concurrency` at once,
/// each in a task on the runtime's workers; meanwhile runs `alongside` (which awaits them
/// with [`Lanes::join`], beside work of its own) on this thread, and returns what it
/// returns. Returns (or unwinds) only once every task has ended: tasks still running when
/// `alongside` is done (it failed, or did not wait) are aborted, and waited for.
fn fetch_spawned_with<R, F>(
    url: String,
    jobs: Vec<(Range<u64>, &mut [MaybeUninit<u8>])>,
    concurrency: usize,
    fetch: F,
    alongside: impl FnOnce(&mut Lanes) -> R,
) -> Result<R>
where
    F: for<'b> Fn(Range<u64>, &'b mut [MaybeUninit<u8>]) -> BoxFuture<'b, Result<()>>,
    F: Send + Sync + 'static,
{
    let lanes = concurrency.max(1).min(jobs.len());
    let queue: Queue = Arc::new(Mutex::new(
        jobs.into_iter()
            .map(|(range, into)| {
                let (ptr, len) = (into.as_mut_ptr(), into.len());
                (range, Lent { ptr, len })
            })
            .collect(),
    ));
    let mut guard = EndAll(Lanes {
        tasks: Vec::with_capacity(lanes),
        live: Arc::new((Mutex::new(0), Condvar::new())),
        url,
    });
    let fetch = Arc::new(fetch);
    for _ in 0..lanes {
        let live = guard.0.live.clone();
        *live.0.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let task = lane(queue.clone(), fetch.clone(), Alive(live));
        guard.0.tasks.push(runtime::spawn(task)?);
    }
    Ok(alongside(&mut guard.0))
}

/// One lane: takes the next part from `queue` and fetches it, until none is left or one
/// fails; counted live (`_alive`) until its future is dropped.
async fn lane<F>(queue: Queue, fetch: Arc<F>, _alive: Alive) -> Result<()>
where
    F: for<'b> Fn(Range<u64>, &'b mut [MaybeUninit<u8>]) -> BoxFuture<'b, Result<()>>,
{
    loop {
        let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
        let Some((range, lent)) = next else {
            return Ok(());
        };
        // SAFETY: `lent` is the only access to its bytes (see `Lent`), and they stay
        // borrowed by `fetch_spawned_with` until this task has ended. `fetch` may keep the
        // slice no longer than the future it returns, which lives in this task's future.
        let into = unsafe { std::slice::from_raw_parts_mut(lent.ptr, lent.len) };
        fetch(range, into).await?;
    }
}

/// Ends the lanes when dropped: aborts the tasks (those that ended already are not
/// touched) and waits until every task's future has been dropped, so that none writes
/// into the lent buffer after [`fetch_spawned`] returns.
struct EndAll(Lanes);

impl Drop for EndAll {
    fn drop(&mut self) {
        for task in &self.0.tasks {
            task.abort();
        }
        // Blocks this thread, never a worker's (callers block on the runtime from their
        // own threads), while the workers drop the aborted tasks' futures.
        let (count, ended) = &*self.0.live;
        let mut live = count.lock().unwrap_or_else(|p| p.into_inner());
        while *live > 0 {
            live = ended.wait(live).unwrap_or_else(|p| p.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    const PART: usize = 64 << 10;

    /// A buffer of `parts` parts of [`PART`] zeroed bytes, and its jobs.
    fn jobs(buf: &mut [MaybeUninit<u8>]) -> Vec<(Range<u64>, &mut [MaybeUninit<u8>])> {
        let at = |i: usize| (i * PART) as u64;
        buf.chunks_mut(PART)
            .enumerate()
            .map(|(i, part)| (at(i)..at(i + 1), part))
            .collect()
    }

    fn bytes(buf: &[MaybeUninit<u8>]) -> Vec<u8> {
        // SAFETY: every byte was initialised (to zero, or by a fetch).
        buf.iter().map(|b| unsafe { b.assume_init() }).collect()
    }

    #[test]
    fn no_task_writes_into_the_buffer_after_the_call_returns() {
        // Each fetch writes its part in pieces, blocking its worker 2 ms after each, and
        // yields every fourth piece. `alongside` waits for nothing: the call must abort
        // the tasks and wait until each one's future is gone, mid-write or not.
        let mut buf = vec![MaybeUninit::new(0u8); 16 * PART];
        let fetch = part_fetcher(|_, into| {
            async move {
                for (i, piece) in into.chunks_mut(4096).enumerate() {
                    piece.fill(MaybeUninit::new(1));
                    std::thread::sleep(Duration::from_millis(2));
                    if i % 4 == 3 {
                        tokio::task::yield_now().await;
                    }
                }
                Ok(())
            }
            .boxed()
        });
        let url = "test://parts".to_string();
        let start = Instant::now();
        let jobs = jobs(&mut buf);
        fetch_spawned_with(url, jobs, 4, fetch, |_| {
            std::thread::sleep(Duration::from_millis(20))
        })
        .unwrap();
        let returned = start.elapsed();
        let at_return = bytes(&buf);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            bytes(&buf),
            at_return,
            "a task wrote after the call returned"
        );
        let written = at_return.iter().filter(|&&b| b == 1).count();
        assert!(written > 0, "no task ran");
        assert!(
            written < buf.len(),
            "every part was written in {returned:?}: nothing was left to abort"
        );
    }

    #[test]
    fn the_first_failure_ends_the_wait_and_stops_the_other_tasks() {
        let mut buf = vec![MaybeUninit::new(0u8); 8 * PART];
        let fetch = part_fetcher(|range, into| {
            async move {
                if range.start == 2 * PART as u64 {
                    return Err(failed(
                        "read",
                        "test://parts",
                        Cause::Other,
                        "part 2 failed",
                    ));
                }
                for piece in into.chunks_mut(4096) {
                    piece.fill(MaybeUninit::new(1));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok(())
            }
            .boxed()
        });
        let start = Instant::now();
        let jobs = jobs(&mut buf);
        let got = fetch_spawned_with("test://parts".into(), jobs, 4, fetch, |lanes| {
            runtime::block_on(lanes.join()).unwrap()
        })
        .unwrap();
        let err = got.unwrap_err().to_string();
        assert!(err.contains("part 2 failed"), "{err}");
        // The other parts would take 16 s to write.
        assert!(
            start.elapsed() < Duration::from_secs(8),
            "{:?}",
            start.elapsed()
        );
    }
}
