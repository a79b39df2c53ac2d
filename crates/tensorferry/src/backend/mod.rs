//! What a device offers, as one trait the transfer engine is written against: device
//! memory, and batches of copies run in stream order that complete an [`Event`].
//!
//! Implementations: the emulated device ([`emulated`]), which runs everywhere, and CUDA
//! ([`cuda_device`], through the driver loaded at run time; [`cuda`] probes for it).

use crate::device::Device;
use crate::error::Result;

pub(crate) mod completer;
pub mod cuda;
pub use cuda::device as cuda_device;
pub mod emulated;
pub(crate) mod event;
mod fence;
mod interface;
pub(crate) mod lane;
mod probe;
pub(crate) mod process;
pub(crate) mod stream;
pub(crate) mod worker;

pub use event::{Event, Failure, Outcome};
pub use fence::{Fence, StreamHandle};
pub use interface::{Backend, CopyBatch, CopyOp, DeviceMemory, Direction};
pub use probe::available_devices;

// The crate's own backends, the only ones (`Backend` is sealed).
impl interface::sealed::Sealed for emulated::EmulatedDevice {}
impl interface::sealed::Sealed for cuda_device::CudaDevice {}

/// Unit tests that hold streams and queue batches behind host work on a device (the
/// ordering rules of `ordering_tests`), or that use emu:1 and count its pool, run one at a
/// time under this lock, so that none sees another's held or deferred work.
#[cfg(test)]
pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The device that owns device memory at `address`, a pointer another library handed over
/// with no device (the CUDA Array Interface), as the driver reports it.
pub fn pointer_device(address: usize) -> Result<Device> {
    cuda::driver::pointer_device(address).map(Device::Cuda)
}

/// The backend of a device (host memory has none).
pub fn backend_for(device: Device) -> Result<std::sync::Arc<dyn Backend>> {
    match device {
        Device::Emulated(i) => Ok(emulated::device(i)?),
        Device::Cpu => Err(crate::error::Error::InvalidValue {
            key: String::new(),
            reason: "host memory has no device backend".into(),
        }),
        Device::Cuda(i) => Ok(cuda::device::device(i)?),
    }
}
