//! What the examples share: a small model to move, and the device to move it to.

use tensorferry::{available_devices, Device, Tensor, TensorDict};

/// Four 256×256 `f32` layers under `model/layer.N.weight` (layer N's values count up from
/// N), and a plain value, `step`.
pub fn small_model() -> tensorferry::Result<TensorDict> {
    let mut d = TensorDict::new();
    for layer in 0..4 {
        let w: Vec<f32> = (0..256 * 256).map(|i| (i + layer) as f32).collect();
        d.insert_path(
            &["model", &format!("layer.{layer}.weight")],
            Tensor::from_slice(&w, &[256, 256])?,
        )?;
    }
    d.insert("step", 1200i64);
    Ok(d)
}

/// The best device present: `cuda:0`, else the emulated `emu:0`.
pub fn best_device() -> Device {
    available_devices()
        .into_iter()
        .find(|d| matches!(d, Device::Cuda(_)))
        .unwrap_or(Device::Emulated(0))
}
