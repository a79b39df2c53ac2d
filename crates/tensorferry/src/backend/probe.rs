//! What is present on this machine, asked of the backends at run time: whether a device
//! can be used now, and the list of those that can.

use super::{cuda, emulated};
use crate::device::Device;
use crate::error::Result;

impl Device {
    /// Checks that the device can be used now; the error says why not.
    pub fn ensure_available(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Emulated(index) => emulated::device(index).map(drop),
            Device::Cuda(index) => cuda::gpu_present(index).map(drop),
        }
    }
}

/// The devices tensorferry can use on this machine, host first (e.g. `[cpu]`, or
/// `[cpu, cuda:0]`): a GPU the driver reports but tensorferry cannot use is left out
/// (`Device::ensure_available` says why).
///
/// ```
/// use tensorferry::{available_devices, Device};
///
/// assert_eq!(available_devices()[0], Device::Cpu);
/// ```
pub fn available_devices() -> Vec<Device> {
    let mut found = vec![Device::Cpu];
    if let cuda::CudaStatus::Available { gpus, .. } = cuda::status() {
        found.extend(
            (0..gpus.len())
                .map(Device::Cuda)
                .filter(|d| d.ensure_available().is_ok()),
        );
    }
    found.extend((0..emulated::EMULATED_DEVICES).map(Device::Emulated));
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_is_always_present_and_first() {
        assert_eq!(available_devices()[0], Device::Cpu);
        assert!(Device::Cpu.ensure_available().is_ok());
    }
}
