//! `TENSORFERRY_DIRECT_IO=0` turns `O_DIRECT` off: direct loads read through the page
//! cache and say so. A test binary of its own, since it sets the process's environment.

mod common;

use common::save_dict;

use tensorferry::load_to;
use tensorferry::{load, DType, Device, LoadOptions, SaveOptions, Staging, Tensor, TensorDict};

#[test]
fn the_environment_switch_turns_direct_reads_off_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
    let mut d = TensorDict::new();
    d.insert(
        "x",
        Tensor::from_bytes(DType::U8, vec![10_000], &bytes).unwrap(),
    );
    save_dict(&d, &path, &SaveOptions::default());
    std::env::set_var("TENSORFERRY_DIRECT_IO", "0");
    let options = LoadOptions {
        mmap: tensorferry::Mapping::READ,
        direct: true,
        ..Default::default()
    };
    let host = load(&path, options).unwrap();
    let device = load_to(&path, Device::Emulated(0), options, Staging::Auto).unwrap();
    std::env::remove_var("TENSORFERRY_DIRECT_IO");
    for loaded in [&host, &device] {
        assert_eq!(
            loaded.direct_fallback.as_deref(),
            Some("TENSORFERRY_DIRECT_IO=0 turned O_DIRECT off: read through the page cache")
        );
        let t = loaded.root.tensors()[0].1.to(Device::Cpu, false).unwrap();
        assert_eq!(t.contiguous_bytes().unwrap(), &bytes[..]);
    }
    let direct = load(&path, options).unwrap();
    assert!(
        direct.direct_fallback.is_none()
            || !direct
                .direct_fallback
                .unwrap()
                .contains("TENSORFERRY_DIRECT_IO"),
        "the switch is read at each load"
    );
}
