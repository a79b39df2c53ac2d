//! Where a tensor lives: parsed from and shown as strings ("cpu", "cuda", "cuda:1").
//! What is present on this machine is the backends' to say (`crate::backend::probe`:
//! [`Device::ensure_available`], [`crate::available_devices`]), so that this module, at the
//! bottom of the layers, depends on none above it.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The forms [`Device::from_str`] accepts, for error messages.
pub const ACCEPTED_DEVICE_FORMS: &str =
    "\"cpu\" (or \"cpu:0\"), \"cuda\", \"cuda:N\", \"emu\", \"emu:N\" (N = 0, 1, …)";

/// A place a tensor's memory can live.
///
/// ```
/// use tensorferry::Device;
///
/// assert_eq!("cuda:1".parse::<Device>()?, Device::Cuda(1));
/// assert_eq!(Device::Emulated(0).to_string(), "emu:0");
/// assert!("tpu".parse::<Device>().is_err());
/// # Ok::<(), tensorferry::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// The memory of CUDA device N.
    Cuda(usize),
    /// Emulated device N: a GPU stand-in in host memory, with its own stream (the
    /// backend `emulated`).
    Emulated(usize),
}

impl Device {
    /// True for host memory.
    pub const fn is_host(self) -> bool {
        matches!(self, Device::Cpu)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Emulated(i) => write!(f, "emu:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Parses "cpu", "cuda" (device 0) or "cuda:N".
    fn from_str(s: &str) -> Result<Self> {
        let invalid = || Error::InvalidDevice {
            input: s.to_string(),
            accepted: ACCEPTED_DEVICE_FORMS,
        };
        let trimmed = s.trim();
        match trimmed {
            // The host is one device; PyTorch and JAX also call it "cpu:0".
            "cpu" | "cpu:0" => return Ok(Device::Cpu),
            "cuda" => return Ok(Device::Cuda(0)),
            "emu" => return Ok(Device::Emulated(0)),
            _ => {}
        }
        let (kind, index): (fn(usize) -> Device, &str) =
            if let Some(i) = trimmed.strip_prefix("cuda:") {
                (Device::Cuda, i)
            } else if let Some(i) = trimmed.strip_prefix("emu:") {
                (Device::Emulated, i)
            } else {
                return Err(invalid());
            };
        if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid());
        }
        index.parse().map(kind).map_err(|_| invalid())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_accepted_forms() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cpu:0".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!("emu".parse::<Device>().unwrap(), Device::Emulated(0));
        assert_eq!("emu:1".parse::<Device>().unwrap(), Device::Emulated(1));
        assert_eq!(Device::Emulated(1).to_string(), "emu:1");
    }

    #[test]
    fn shows_the_canonical_form() {
        assert_eq!(Device::Cpu.to_string(), "cpu");
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn rejects_bad_strings_listing_the_accepted_forms() {
        for bad in [
            "gpu", "cuda:", "cuda:-1", "cuda:x", "CPU0", "", "cuda:1:2", "emu:", "cpu:1",
        ] {
            let err = bad.parse::<Device>().unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("cuda:N"), "{bad:?} gave {msg}");
            assert!(matches!(err, Error::InvalidDevice { .. }));
        }
    }
}
