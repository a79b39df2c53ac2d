//! The one asynchronous runtime the object-storage client runs on, created on first use
//! and driven from the blocking API: callers block on it from their own threads (never
//! from one of its workers), as Python's load and save do with the GIL released.
//!
//! A process forked after the runtime started has none of its threads: the child gets a
//! runtime of its own on first use (the parent's is left to the parent).

use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::runtime::{Builder, Runtime};

use crate::error::{Error, Result};

/// Worker threads: the client's I/O needs few; copies into buffers run on the caller.
const WORKERS: usize = 4;

static RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);

/// This process's runtime, created on first use.
fn runtime() -> Result<Arc<Runtime>> {
    let mut slot = RUNTIME.lock().unwrap_or_else(|p| p.into_inner());
    let pid = std::process::id();
    if let Some((owner, rt)) = slot.as_ref() {
        if *owner == pid {
            return Ok(rt.clone());
        }
        // Forked: the parent's workers do not exist here. Its runtime is leaked, not
        // dropped: dropping would wait for threads that will never answer.
        std::mem::forget(slot.take());
    }
    install_tls_provider();
    let rt = Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .thread_name("tensorferry-object")
        .enable_all()
        .build()
        .map_err(|e| Error::io("start the object-storage runtime", "", e))?;
    let rt = Arc::new(rt);
    *slot = Some((pid, rt.clone()));
    Ok(rt)
}

/// Runs `future` to completion on the runtime, blocking this thread. Called from inside
/// an asynchronous runtime (a Rust caller's own), where blocking the thread is refused, it
/// blocks a helper thread instead.
pub(crate) fn block_on<F>(future: F) -> Result<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    if tokio::runtime::Handle::try_current().is_err() {
        return Ok(rt.block_on(future));
    }
    std::thread::scope(|s| s.spawn(|| rt.block_on(future)).join()).map_err(|_| {
        Error::io(
            "run an object-storage request",
            "",
            std::io::Error::other("the request's thread panicked"),
        )
    })
}

/// Starts `future` on the runtime's workers and returns at once with its handle (waited
/// for with [`block_on`]; aborted, or left to finish, when the caller gives up).
pub(crate) fn spawn<F>(future: F) -> Result<tokio::task::JoinHandle<F::Output>>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    Ok(runtime()?.spawn(future))
}

/// Makes ring the TLS provider of this process's `rustls`, unless one was chosen already
/// (by tensorferry or by the application).
pub(crate) fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
