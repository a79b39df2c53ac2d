//! `tensorferry info`.

use tensorferry::backend::cuda::{self, CudaStatus};

/// Prints the version, the devices and the CUDA driver's state.
pub fn run() -> tensorferry::Result<()> {
    println!("tensorferry {}", env!("CARGO_PKG_VERSION"));
    let devices: Vec<String> = tensorferry::available_devices()
        .iter()
        .map(|d| d.to_string())
        .collect();
    println!("devices: {}", devices.join(", "));
    match cuda::status() {
        CudaStatus::Available {
            driver_version,
            gpus,
        } => {
            println!("cuda: driver {}", cuda::version_string(*driver_version));
            for (i, name) in gpus.iter().enumerate() {
                match tensorferry::backend::cuda_device::device(i) {
                    Ok(d) => {
                        println!("  cuda:{i}: {name}; copies: {}", d.copy_path());
                        if let Some(reason) = d.copy_fallback() {
                            println!("    batched copies given up: {reason}");
                        }
                    }
                    Err(e) => println!("  cuda:{i}: {name}; unusable: {e}"),
                }
            }
        }
        CudaStatus::Unavailable { reason } => println!("cuda: unavailable: {reason}"),
    }
    Ok(())
}
