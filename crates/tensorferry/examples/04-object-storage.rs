//! Save a checkpoint to object storage and load it back: to the host, streamed onto the
//! best device present (`cuda:0`, else the emulated `emu:0`) through the staging ring, and
//! one tensor of it alone (only its bytes are fetched). The URL is the first argument;
//! credentials and the endpoint come from the usual environment (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL` for S3-compatible servers).
//! Run: cargo run -p tensorferry --example 04-object-storage -- s3://bucket/prefix/

use std::collections::HashSet;
use std::sync::atomic::AtomicBool;

mod common;

use tensorferry::internal::io::object::{load_url, load_url_to_until, ObjectOptions};
use tensorferry::{save, Device, Node, SaveOptions, Staging};

fn main() -> tensorferry::Result<()> {
    let Some(url) = std::env::args().nth(1) else {
        eprintln!("usage: 04-object-storage s3://bucket/prefix/");
        std::process::exit(2);
    };
    // A URL ending in `/` means `model.safetensors` in that folder.
    save(
        &Node::Dict(common::small_model()?),
        &url,
        &SaveOptions::default(),
    )?;

    let options = ObjectOptions::from_env();
    let host = load_url(&url, &options, None)?;
    println!("loaded {} tensors to the host", host.root.tensors().len());

    let device = common::best_device();
    let stop = AtomicBool::new(false); // set from another thread to give up between chunks
    let there = load_url_to_until(&url, device, &options, Staging::Auto, &stop, None)?;
    println!(
        "streamed {} tensors onto {device}",
        there.root.tensors().len()
    );

    let only: HashSet<String> = ["model.layer.3.weight".to_string()].into();
    let one = load_url_to_until(&url, device, &options, Staging::Auto, &stop, Some(&only))?;
    let w = one.root.tensors()[0].1.to(Device::Cpu, false)?;
    assert_eq!(w.to_vec::<f32>()?[..3], [3.0, 4.0, 5.0]);
    println!("fetched model.layer.3.weight alone onto {device}");
    Ok(())
}
