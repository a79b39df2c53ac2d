//! Copy-on-write maps: writable views of a file whose writes never reach it.

use tensorferry::{load, save, LoadOptions, SaveOptions, Tensor, TensorDict};

fn saved() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let mut d = TensorDict::new();
    d.insert("w", Tensor::from_slice(&[1.5f32, 2.5, 3.5], &[3]).unwrap());
    save(&d, &path, &SaveOptions::default()).unwrap();
    (dir, path)
}

#[test]
fn a_copy_on_write_load_maps_the_file_writable() {
    let (_dir, path) = saved();
    let options = LoadOptions {
        copy_on_write: true,
        ..Default::default()
    };
    let (d, _) = load(&path, options).unwrap();
    let w = d.tensor(&["w"]).unwrap();
    assert!(w.storage().is_mapped(), "a map, not a copy");
    assert!(!w.is_read_only());
    assert_eq!(w.to_vec::<f32>().unwrap(), [1.5, 2.5, 3.5]);
}

#[test]
fn writes_into_a_copy_on_write_map_never_reach_the_file() {
    let (_dir, path) = saved();
    let before = std::fs::read(&path).unwrap();
    let options = LoadOptions {
        copy_on_write: true,
        ..Default::default()
    };
    let (d, _) = load(&path, options).unwrap();
    let w = d.tensor(&["w"]).unwrap();
    // SAFETY: the tensor is contiguous, its 12 bytes lie in the private, writable map that
    // `d` keeps alive, and nothing else reads or writes them meanwhile.
    unsafe { std::ptr::write_bytes(w.data_ptr() as *mut u8, 0, w.nbytes()) };
    assert_eq!(
        w.to_vec::<f32>().unwrap(),
        [0.0; 3],
        "the process sees its write"
    );
    assert_eq!(std::fs::read(&path).unwrap(), before, "the file does not");
    let (again, _) = load(&path, LoadOptions::default()).unwrap();
    assert_eq!(
        again.tensor(&["w"]).unwrap().to_vec::<f32>().unwrap(),
        [1.5, 2.5, 3.5]
    );
}

#[test]
fn the_default_map_stays_read_only() {
    let (_dir, path) = saved();
    let (d, _) = load(&path, LoadOptions::default()).unwrap();
    let w = d.tensor(&["w"]).unwrap();
    assert!(w.storage().is_mapped() && w.is_read_only());
}
