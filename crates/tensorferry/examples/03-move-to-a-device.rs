//! Move a whole dictionary to a device and back as one planned transfer each way:
//! non-blocking (reads wait for the copy by themselves), through the pinned staging ring
//! for ordinary host memory, on the best device present — `cuda:0`, else the emulated
//! device `emu:0`. Run: cargo run -p tensorferry --example 03-move-to-a-device

mod common;

use tensorferry::{Device, MoveOptions, Node, Staging};

fn main() -> tensorferry::Result<()> {
    let device = common::best_device();
    let d = Node::from(common::small_model()?);
    let options = MoveOptions {
        non_blocking: true,
        staging: Staging::Ring {
            chunk_bytes: 1 << 18,
            depth: 2,
        },
        ..Default::default()
    };
    let there = d.to_with(device, options)?;
    println!(
        "queued {} bytes to {device}; ready yet: {}",
        there.nbytes(),
        there.is_ready()
    );
    let back = there.to_with(Device::Cpu, options)?;
    // No wait() needed: reading a result waits for the copy that fills it.
    let w = back.tensor(&["model", "layer.3.weight"]).expect("present");
    assert_eq!(w.to_vec::<f32>()?[..3], [3.0, 4.0, 5.0]);
    back.wait()?;
    println!(
        "back on the host, values checked; plain values kept: {:?}",
        back.get_path(&["step"])
    );
    if let Device::Cuda(i) = device {
        let gpu = tensorferry::internal::backend::cuda_device::device(i)?;
        println!("copies on {device}: {}", gpu.copy_path());
    }
    Ok(())
}
