//! The fork guard: device threads and CUDA exist only in the process that set them up.

use crate::device::Device;
use crate::error::Result;

/// The process that set up the first device backend.
static OWNER: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// Fails in a process forked after a device backend was set up: their threads (a GPU's
/// completer and freeing thread, an emulated device's stream) exist only in the process that
/// started them, and CUDA cannot be used across `fork` either, so a child would wait
/// forever for copies nobody runs.
pub(crate) fn same_process(device: Device) -> Result<()> {
    let me = std::process::id();
    match OWNER.get() {
        Some(&owner) if owner != me => Err(crate::error::Error::DeviceUnavailable {
            device: device.to_string(),
            reason: format!(
                "this process ({me}) was forked from {owner} after tensorferry used devices \
                 there; device threads and CUDA do not survive fork: start workers with the \
                 'spawn' or 'forkserver' method, or use devices only in the children"
            ),
        }),
        _ => Ok(()),
    }
}

/// Starts a thread of `device` named after `name` that runs `body`; `what` names it in the
/// error when it cannot start.
pub(crate) fn spawn_thread(
    device: Device,
    name: &str,
    what: &str,
    body: impl FnOnce() + Send + 'static,
) -> Result<()> {
    let device_name = device.to_string().replace(':', "");
    std::thread::Builder::new()
        .name(format!("tensorferry-{device_name}-{name}"))
        .spawn(body)
        .map(drop)
        .map_err(|e| crate::error::Error::DeviceUnavailable {
            device: device.to_string(),
            reason: format!("cannot start its {what} thread: {e}"),
        })
}

/// Records that this process set up a device backend (see [`same_process`]).
pub(crate) fn backends_started_here() {
    OWNER.get_or_init(std::process::id);
}
