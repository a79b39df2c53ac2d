//! The bytes of a load from object storage, still arriving after its tree is handed over.
//!
//! A whole object's header is in long before its last byte: the tree is built from it at
//! once, over memory the ranged GETs go on filling ([`crate::Storage`]'s incoming memory,
//! whose every read waits until the GETs are done), so a caller can prepare the results
//! (hand each tensor to its framework) while the bytes arrive. [`Arrival`] is that
//! caller's handle on the GETs: wait for them, or stop them.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::{AbortHandle, Abortable};

use super::failure::{failed, Cause};
use crate::backend::event::{Event, Failure};
use crate::error::{Error, Result};

/// The GETs filling the memory of a load's tree ([`super::load_url_arriving`]).
///
/// Every read of that memory waits until they are done and fails if they failed, so safe
/// code never sees a byte that has not arrived; [`Arrival::wait`] gives the load's own
/// error (the one [`super::load_url`] returns). Dropping the handle lets the GETs finish.
pub struct Arrival {
    /// Completed once nothing writes the memory any more: every byte in, or the GETs
    /// failed or were stopped.
    done: Event,
    /// The load's error, taken by the first [`Arrival::wait`] that sees it.
    failure: Arc<Mutex<Option<Error>>>,
    stop: Stop,
}

impl Arrival {
    /// The handle of a load whose bytes are all in.
    pub(super) fn complete() -> Arrival {
        Arrival {
            done: Event::ready(),
            failure: Arc::default(),
            stop: Stop::default(),
        }
    }

    /// The handle of GETs to come, and the writer's side of it.
    pub(super) fn pending(done: Event) -> (Arrival, Writer) {
        let arrival = Arrival {
            done,
            failure: Arc::default(),
            stop: Stop::default(),
        };
        let writer = Writer {
            done: arrival.done.clone(),
            failure: arrival.failure.clone(),
            stop: arrival.stop.clone(),
        };
        (arrival, writer)
    }

    /// True once nothing writes the memory any more (all in, failed or stopped).
    pub fn is_done(&self) -> bool {
        self.done.is_ready()
    }

    /// Waits at most `timeout` for [`Arrival::is_done`]; whether it is.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        !matches!(self.done.wait_timeout(timeout), Ok(false))
    }

    /// Waits until every byte is in; the load's error when the GETs failed or were
    /// stopped (the typed error of [`super::load_url`] the first time, its text after).
    pub fn wait(&self) -> Result<()> {
        self.done.wait_outcome().map_err(|f| {
            let taken = self
                .failure
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            taken.unwrap_or_else(|| f.to_error())
        })
    }

    /// Stops the GETs still in flight and waits until nothing writes the memory any more
    /// (the tasks are aborted, not drained): every later read of it fails.
    pub fn cancel(&self) {
        self.stop.stop();
        let _ = self.done.wait_outcome();
    }
}

/// The side of an [`Arrival`] that the thread filling the memory holds. Dropped without
/// [`Writer::succeed`] or [`Writer::fail`] (the thread panicked), it fails the arrival, so
/// that no waiter waits for ever.
pub(super) struct Writer {
    done: Event,
    failure: Arc<Mutex<Option<Error>>>,
    /// Ends the GETs' futures when the caller cancels.
    pub(super) stop: Stop,
}

impl Writer {
    /// Every byte is in (to call once nothing writes the memory any more).
    pub(super) fn succeed(self) {
        self.done.complete(Ok(()));
    }

    /// The GETs failed with `error` (to call once nothing writes the memory any more):
    /// reads of the memory fail with its text, [`Arrival::wait`] with `error`.
    pub(super) fn fail(self, url: &str, error: Error) {
        let failure = Failure::from_error(url, &error);
        *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
        self.done.complete(Err(failure));
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // After `succeed` or `fail`, a no-op: an event keeps its first outcome.
        self.done.complete(Err(Failure::new(
            "cpu",
            "internal error: the thread reading the object stopped",
        )));
    }
}

/// Stops futures from outside: each [`Stop::or_stopped`] ends with an error once
/// [`Stop::stop`] is called (before or while it runs).
#[derive(Clone, Default)]
pub(super) struct Stop(Arc<Mutex<Stopping>>);

#[derive(Default)]
struct Stopping {
    stopped: bool,
    running: Vec<AbortHandle>,
}

impl Stop {
    /// `future`'s output, or, once stopped, an error saying the read of `url` was
    /// cancelled (the future is dropped at its next wake-up: the GETs it holds end).
    pub(super) async fn or_stopped<T>(
        &self,
        url: &str,
        future: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let (handle, registration) = AbortHandle::new_pair();
        {
            let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if state.stopped {
                handle.abort();
            } else {
                state.running.retain(|h| !h.is_aborted());
                state.running.push(handle);
            }
        }
        match Abortable::new(future, registration).await {
            Ok(output) => output,
            Err(_) => Err(failed("read", url, Cause::Other, "the load was cancelled")),
        }
    }

    /// Ends every future run through [`Stop::or_stopped`], now and later.
    pub(super) fn stop(&self) {
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        state.stopped = true;
        for handle in state.running.drain(..) {
            handle.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_future_ends_with_a_cancellation_and_later_ones_do_not_start() {
        let stop = Stop::default();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let waiting = stop.or_stopped("s3://b/k", futures_util::future::pending::<Result<()>>());
        let stopper = stop.clone();
        let both = async {
            let stopping = async {
                tokio::task::yield_now().await;
                stopper.stop();
                Ok::<(), Error>(())
            };
            futures_util::future::join(waiting, stopping).await
        };
        let (ended, _) = rt.block_on(both);
        assert!(ended.unwrap_err().to_string().contains("cancelled"));
        let later = rt.block_on(stop.or_stopped("s3://b/k", async { Ok(1) }));
        assert!(later.is_err(), "a future started after stop() must not run");
    }

    #[test]
    fn a_writer_gone_without_an_outcome_fails_the_arrival_instead_of_hanging_it() {
        let (arrival, writer) = Arrival::pending(Event::pending());
        let thread = std::thread::spawn(move || {
            let _writer = writer;
            panic!("the filler died");
        });
        assert!(thread.join().is_err());
        assert!(arrival.wait_timeout(Duration::from_secs(10)));
        let e = arrival.wait().unwrap_err().to_string();
        assert!(e.contains("thread reading the object stopped"), "{e}");
    }

    #[test]
    fn wait_gives_the_typed_error_once_and_reads_see_the_failure() {
        let (arrival, writer) = Arrival::pending(Event::pending());
        assert!(!arrival.is_done());
        assert!(!arrival.wait_timeout(Duration::from_millis(1)));
        let done = arrival.done.clone();
        writer.fail(
            "s3://b/k",
            failed("read", "s3://b/k", Cause::Dropped, "reset"),
        );
        assert!(arrival.is_done() && arrival.wait_timeout(Duration::ZERO));
        let first = arrival.wait().unwrap_err();
        assert_eq!(super::super::cause_of(&first), Some(Cause::Dropped));
        let again = arrival.wait().unwrap_err().to_string();
        assert!(again.contains("reset"), "{again}");
        assert!(done.wait().unwrap_err().to_string().contains("s3://b/k"));
    }
}
