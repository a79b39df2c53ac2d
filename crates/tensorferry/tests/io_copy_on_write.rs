//! Maps and reads: the safe default reads the file into fresh memory, so that a file
//! truncated under a load is an error or whole data, never a crash; a map is the unsafe
//! opt-in, read-only or copy-on-write (writable views whose writes never reach the file).

mod common;

use common::load_dict;

use tensorferry::{load, save, Error, LoadOptions, Mapping, Node, SaveOptions, Tensor, TensorDict};

/// A map of a file of this test's own temporary folder.
fn mapped(copy_on_write: bool) -> LoadOptions {
    LoadOptions {
        // SAFETY: the file lives in this test's own temporary folder; nothing truncates or
        // rewrites it while its tensors are alive.
        mmap: unsafe { Mapping::map() },
        copy_on_write,
        ..Default::default()
    }
}

/// A file of `{"w": values}` in a temporary folder.
fn saved_values(values: &[f32]) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let mut d = TensorDict::new();
    d.insert("w", Tensor::from_slice(values, &[values.len()]).unwrap());
    save(&Node::from(d), &path, &SaveOptions::default()).unwrap();
    (dir, path)
}

fn saved() -> (tempfile::TempDir, std::path::PathBuf) {
    saved_values(&[1.5, 2.5, 3.5])
}

/// Cuts the file at `path` to `len` bytes, as another program could.
fn truncate(path: &std::path::Path, len: u64) {
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.set_len(len).unwrap();
}

#[test]
fn a_copy_on_write_load_maps_the_file_writable() {
    let (_dir, path) = saved();
    let options = mapped(true);
    let (d, _) = load_dict(&path, options);
    let w = d.tensor(&["w"]).unwrap();
    assert!(w.storage().is_mapped(), "a map, not a copy");
    assert!(!w.is_read_only());
    assert_eq!(w.to_vec::<f32>().unwrap(), [1.5, 2.5, 3.5]);
}

#[test]
fn writes_into_a_copy_on_write_map_never_reach_the_file() {
    let (_dir, path) = saved();
    let before = std::fs::read(&path).unwrap();
    let options = mapped(true);
    let (d, _) = load_dict(&path, options);
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
    let (again, _) = load_dict(&path, LoadOptions::default());
    assert_eq!(
        again.tensor(&["w"]).unwrap().to_vec::<f32>().unwrap(),
        [1.5, 2.5, 3.5]
    );
}

#[test]
fn a_map_without_copy_on_write_stays_read_only() {
    let (_dir, path) = saved();
    let (d, _) = load_dict(&path, mapped(false));
    let w = d.tensor(&["w"]).unwrap();
    assert!(w.storage().is_mapped() && w.is_read_only());
}

#[test]
fn the_default_load_reads_into_fresh_memory_not_a_map() {
    let (_dir, path) = saved();
    assert_eq!(LoadOptions::default().mmap, Mapping::READ);
    let (d, _) = load_dict(&path, LoadOptions::default());
    let w = d.tensor(&["w"]).unwrap();
    assert!(!w.storage().is_mapped(), "fresh memory, not a map");
}

/// A file saved with a tensor large enough that its bytes span many pages, so that a
/// truncation removes pages a map would still hand out.
fn saved_large() -> (tempfile::TempDir, std::path::PathBuf, Vec<f32>) {
    let values: Vec<f32> = (0..64 * 1024).map(|i| i as f32).collect();
    let (dir, path) = saved_values(&values);
    (dir, path, values)
}

/// Truncated by another program after the load: the safe default's tensors hold their own
/// copy and read whole. (With the old default, a map, this read raised SIGBUS and killed
/// the test process.)
#[test]
fn a_file_truncated_after_a_default_load_leaves_the_tensors_whole() {
    let (_dir, path, values) = saved_large();
    let loaded = load(&path, LoadOptions::default()).unwrap();
    truncate(&path, 0);
    let w = loaded.root.tensor(&["w"]).unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), values);
}

/// Truncated before (or while) the default load reads it: an error naming the file, never a
/// crash and never a tree with missing bytes.
#[test]
fn a_truncated_file_is_an_error_under_the_default_load() {
    let (_dir, path, _) = saved_large();
    let len = std::fs::metadata(&path).unwrap().len();
    for keep in [len - 1, len / 2, 100, 9, 3, 0] {
        truncate(&path, keep);
        let err = load(&path, LoadOptions::default())
            .err()
            .unwrap_or_else(|| panic!("kept {keep} of {len} bytes: the load must fail"));
        assert!(
            matches!(err, Error::Io { .. } | Error::Format { .. }),
            "kept {keep}: {err}"
        );
    }
}
