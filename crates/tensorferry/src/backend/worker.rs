//! One-off host threads of the transfer engine (a staging ring's driver, a host copy that
//! waits for its sources): each runs one piece of work and completes its event with the
//! outcome, or with the panic as an internal error — never leaving a waiter blocked.

use std::fmt;

use super::event::Event;
use super::event::{guarded, Outcome};
use crate::error::{Error, Result};

/// Runs `work` on a new thread named `name`, then completes `event` with its outcome (a
/// panic becomes [`super::event::Failure::internal`] of `device`). What `work` holds is
/// dropped before `event` completes.
pub(crate) fn spawn_worker(
    name: &str,
    device: impl fmt::Display + Send + 'static,
    event: Event,
    work: impl FnOnce() -> Outcome + Send + 'static,
) -> Result<()> {
    let label = device.to_string();
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || event.complete(guarded(device, work)))
        .map(drop)
        .map_err(|e| Error::DeviceUnavailable {
            device: label,
            reason: format!("cannot start a {name} thread: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::event::Failure;

    #[test]
    fn a_panicking_worker_fails_its_event_instead_of_leaving_it_pending() {
        let event = Event::pending();
        spawn_worker("test", "emu:0", event.clone(), || panic!("worker bug")).unwrap();
        let err = event.wait().unwrap_err().to_string();
        assert!(err.contains("internal error: worker bug"), "{err}");
        let event = Event::pending();
        spawn_worker("test", "emu:0", event.clone(), || {
            Err(Failure::new("emu:1", "its own"))
        })
        .unwrap();
        assert!(event.wait().unwrap_err().to_string().contains("emu:1"));
    }
}
