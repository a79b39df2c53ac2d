//! `tensorferry info`.

use std::io::Write;

use tensorferry::internal::backend::cuda::{self, CudaStatus};

use crate::escape::controls_escaped;
use crate::out::{Failure, Out};

/// Prints the version, the devices and the CUDA driver's state. GPU names and reasons
/// come from the driver and the system: printed with control characters escaped.
pub fn run(out: &mut Out<impl Write>) -> Result<(), Failure> {
    writeln!(out, "tensorferry {}", env!("CARGO_PKG_VERSION"))?;
    let devices: Vec<String> = tensorferry::available_devices()
        .iter()
        .map(|d| d.to_string())
        .collect();
    writeln!(out, "devices: {}", devices.join(", "))?;
    match cuda::status() {
        CudaStatus::Available {
            driver_version,
            gpus,
        } => {
            writeln!(
                out,
                "cuda: driver {}",
                cuda::version_string(*driver_version)
            )?;
            for (i, name) in gpus.iter().enumerate() {
                let name = controls_escaped(name);
                match tensorferry::internal::backend::cuda_device::device(i) {
                    Ok(d) => {
                        writeln!(out, "  cuda:{i}: {name}; copies: {}", d.copy_path())?;
                        if let Some(reason) = d.copy_fallback() {
                            let reason = controls_escaped(&reason).into_owned();
                            writeln!(out, "    batched copies given up: {reason}")?;
                        }
                    }
                    Err(e) => {
                        let e = controls_escaped(&e.to_string()).into_owned();
                        writeln!(out, "  cuda:{i}: {name}; unusable: {e}")?;
                    }
                }
            }
        }
        CudaStatus::Unavailable { reason } => {
            writeln!(out, "cuda: unavailable: {}", controls_escaped(reason))?
        }
    }
    Ok(())
}
