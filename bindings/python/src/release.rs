//! Releases of Python-owned objects (imported producers' memory) that never make
//! tensorferry's own threads wait for the interpreter.
//!
//! The engine drops what a batch of copies held on its completer threads, before it
//! completes the batch's event. Were such a drop to attach to the interpreter there, it
//! would wait for the GIL — while a caller holding the GIL might wait for that very event.
//! On tensorferry's threads (named `tensorferry-…`) the release is handed to one release
//! thread instead, which attaches and drops it; on any other thread it happens at once.

use std::sync::mpsc::{self, Sender};
use std::sync::{Mutex, OnceLock};

use pyo3::prelude::*;

type Release = Box<dyn FnOnce() + Send>;

/// Runs `release` (which needs the interpreter) with the interpreter attached: now, or on
/// the release thread when called from one of tensorferry's threads. If the interpreter is
/// gone, `release` is leaked: the only safe choice then.
pub fn attached(release: impl FnOnce() + Send + 'static) {
    let on_engine_thread = std::thread::current()
        .name()
        .is_some_and(|name| name.starts_with("tensorferry"));
    if on_engine_thread {
        if let Some(queue) = queue() {
            if let Ok(tx) = queue.lock() {
                if let Err(returned) = tx.send(Box::new(release)) {
                    std::mem::forget(returned.0);
                }
                return;
            }
        }
    }
    run_attached(Box::new(release));
}

fn run_attached(release: Release) {
    let mut slot = Some(release);
    if Python::try_attach(|_| slot.take().map(|f| f())).is_none() {
        std::mem::forget(slot.take());
    }
}

/// The release thread's queue, started on first use (None if no thread could start).
fn queue() -> Option<&'static Mutex<Sender<Release>>> {
    static QUEUE: OnceLock<Option<Mutex<Sender<Release>>>> = OnceLock::new();
    QUEUE
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Release>();
            std::thread::Builder::new()
                .name("python-release".into())
                .spawn(move || {
                    for release in rx {
                        run_attached(release);
                    }
                })
                .ok()
                .map(|_| Mutex::new(tx))
        })
        .as_ref()
}
