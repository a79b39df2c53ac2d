//! The one ring of the transfer engine: a transfer cut into chunks moves through a few
//! host slots, each chunk in three steps — fill its slot on the host (an upload's bytes),
//! submit its device copy, and, once the copy's fence has passed, drain the slot on the
//! host (a download's bytes) — and a slot is recycled for the chunk `depth` further only
//! after that. Staged transfers (both ways), streamed loads and streamed saves are all this
//! loop; they differ only in their steps ([`RingSteps`]).
//!
//! The loop runs on whichever thread calls [`drive`] (a pool worker for a staged transfer,
//! the caller for a stream). A step's error, or its panic (as an internal error of the
//! device), ends it; it then waits for every copy it queued before returning, so that what
//! the steps borrow outlives every copy that uses it.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::backend::{Event, Failure};
use crate::device::Device;
use crate::error::Result;

/// What a ring does with each chunk.
pub(crate) trait RingSteps {
    /// Chunks to move.
    fn chunks(&self) -> usize;

    /// Host work that fills chunk `j`'s slot before its copy (an upload's bytes); its slot
    /// is free: the copy of the chunk that used it last has run and been drained.
    fn fill(&mut self, _j: usize) -> Result<()> {
        Ok(())
    }

    /// Queues chunk `j`'s device copy; the event completes when it has run.
    fn submit(&mut self, j: usize) -> Event;

    /// Host work once chunk `j`'s copy has run (a download's bytes, from its slot).
    fn drain(&mut self, _j: usize) -> Result<()> {
        Ok(())
    }

    /// Every chunk is queued, with these events (called once, before the last ones are
    /// waited for).
    fn all_queued(&mut self, _events: &[Event]) {}
}

/// Moves every chunk of `steps` through `depth` slots on `device`: `Ok` once every copy
/// has run and every chunk is drained; else the first error, once every copy queued has
/// completed.
pub(crate) fn drive(device: Device, depth: usize, steps: &mut impl RingSteps) -> Result<()> {
    let n = steps.chunks();
    let depth = depth.max(1);
    let mut events: Vec<Event> = Vec::with_capacity(n);
    let mut run = || -> Result<()> {
        for j in 0..n {
            if j >= depth {
                recycle(device, steps, &events[j - depth], j - depth)?;
            }
            guarded(device, || steps.fill(j))?;
            let event = guarded(device, || Ok(steps.submit(j)))?;
            events.push(event);
        }
        steps.all_queued(&events);
        let last = n.saturating_sub(depth);
        for (j, event) in events.iter().enumerate().skip(last) {
            recycle(device, steps, event, j)?;
        }
        Ok(())
    };
    let outcome = run();
    if outcome.is_err() {
        // What the steps borrow (and the slots) may go once this returns: no copy may still
        // use them.
        for e in &events {
            let _ = e.wait_outcome();
        }
    }
    outcome
}

/// Waits for chunk `j`'s copy (`event`), then drains its slot.
fn recycle(device: Device, steps: &mut impl RingSteps, event: &Event, j: usize) -> Result<()> {
    event.wait()?;
    guarded(device, || steps.drain(j))
}

/// `step`'s result, or its panic as an internal error of `device`.
fn guarded<T>(device: Device, step: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(step))
        .unwrap_or_else(|p| Err(Failure::internal(device, &*p).to_error()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps on the host alone: each "copy" completes at once; records the order of steps.
    struct Recorder {
        n: usize,
        log: Vec<String>,
        panic_in_fill: Option<usize>,
        fail_drain: Option<usize>,
    }

    impl RingSteps for Recorder {
        fn chunks(&self) -> usize {
            self.n
        }
        fn fill(&mut self, j: usize) -> Result<()> {
            if self.panic_in_fill == Some(j) {
                panic!("fill {j} breaks");
            }
            self.log.push(format!("fill {j}"));
            Ok(())
        }
        fn submit(&mut self, j: usize) -> Event {
            self.log.push(format!("copy {j}"));
            let e = Event::pending();
            e.complete(Ok(()));
            e
        }
        fn drain(&mut self, j: usize) -> Result<()> {
            if self.fail_drain == Some(j) {
                return Err(crate::Error::InvalidValue {
                    key: String::new(),
                    reason: format!("drain {j} fails"),
                });
            }
            self.log.push(format!("drain {j}"));
            Ok(())
        }
    }

    fn recorder(n: usize) -> Recorder {
        Recorder {
            n,
            log: Vec::new(),
            panic_in_fill: None,
            fail_drain: None,
        }
    }

    #[test]
    fn a_slot_is_filled_again_only_after_its_last_chunk_is_drained() {
        let mut steps = recorder(5);
        drive(Device::Emulated(0), 2, &mut steps).unwrap();
        let log = steps.log.join(", ");
        assert_eq!(
            log,
            "fill 0, copy 0, fill 1, copy 1, drain 0, fill 2, copy 2, drain 1, fill 3, copy 3, \
             drain 2, fill 4, copy 4, drain 3, drain 4"
        );
    }

    #[test]
    fn a_panicking_step_is_an_internal_error_of_the_device() {
        let mut steps = recorder(4);
        steps.panic_in_fill = Some(2);
        let err = drive(Device::Emulated(3), 2, &mut steps).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("emu:3") && msg.contains("internal error: fill 2 breaks"),
            "{msg}"
        );
        let mut steps = recorder(4);
        steps.fail_drain = Some(1);
        let err = drive(Device::Emulated(0), 3, &mut steps).unwrap_err();
        assert!(err.to_string().contains("drain 1 fails"), "{err}");
    }
}
