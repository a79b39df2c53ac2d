//! Saving over a file keeps what a user expects of it: its permission bits, a symbolic
//! link stays a link to the replaced file, any legal name works, and no temporary file
//! is left behind.
#![cfg(unix)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use tensorferry::{load, save, LoadOptions, Node, SaveOptions, Tensor, TensorDict};

/// `{"w": [v, v + 1]}`.
fn tree(v: f32) -> Node {
    let mut d = TensorDict::new();
    d.insert("w", Tensor::from_slice(&[v, v + 1.0], &[2]).unwrap());
    Node::from(d)
}

/// Saves [`tree`]`(v)` at `path`.
fn save_value(path: &Path, v: f32) {
    save(&tree(v), path, &SaveOptions::default()).unwrap();
}

/// The `v` that [`save_value`] saved at `path`.
fn saved_value(path: &Path) -> f32 {
    let (d, _) = load(path, LoadOptions::default())
        .unwrap()
        .into_dict()
        .unwrap();
    d.tensor(&["w"]).unwrap().to_vec::<f32>().unwrap()[0]
}

fn is_link(path: &Path) -> bool {
    std::fs::symlink_metadata(path)
        .unwrap()
        .file_type()
        .is_symlink()
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_replaced_file_keeps_its_permission_bits() {
    let dir = tempfile::tempdir().unwrap();
    for bits in [0o640, 0o600, 0o604, 0o755] {
        let path = dir.path().join(format!("m{bits:o}.safetensors"));
        save_value(&path, 1.0);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(bits)).unwrap();
        save_value(&path, 2.0);
        assert_eq!(mode(&path), bits, "mode {bits:o} was not kept");
        assert_eq!(saved_value(&path), 2.0);
    }
}

#[test]
fn a_new_file_gets_the_permissions_open_gives() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("made_by_open");
    std::fs::File::create(&reference).unwrap();
    let path = dir.path().join("new.safetensors");
    save_value(&path, 1.0);
    assert_eq!(
        mode(&path),
        mode(&reference),
        "0o666 less the umask, as open gives"
    );
}

#[test]
fn saving_through_a_link_replaces_its_target_and_keeps_the_link() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let links = dir.path().join("links");
    std::fs::create_dir_all(&store).unwrap();
    std::fs::create_dir_all(&links).unwrap();
    let target = store.join("real.safetensors");
    save_value(&target, 1.0);
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o640)).unwrap();
    // A relative link, and a link to that link.
    let link = links.join("model.safetensors");
    std::os::unix::fs::symlink("../store/real.safetensors", &link).unwrap();
    let link2 = links.join("latest.safetensors");
    std::os::unix::fs::symlink(&link, &link2).unwrap();

    save_value(&link, 2.0);
    assert!(is_link(&link), "{}", link.display());
    assert_eq!(saved_value(&target), 2.0);
    assert_eq!(mode(&target), 0o640);

    save_value(&link2, 3.0);
    assert!(is_link(&link2), "{}", link2.display());
    assert!(is_link(&link), "{}", link.display());
    assert_eq!(saved_value(&target), 3.0);

    assert_eq!(
        names_in(&store),
        ["real.safetensors"],
        "no temporary file left"
    );
    assert_eq!(
        names_in(&links),
        ["latest.safetensors", "model.safetensors"]
    );
}

#[test]
fn saving_through_a_dangling_link_creates_its_target() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("link.safetensors");
    let target = dir.path().join("target.safetensors");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    save_value(&link, 5.0);
    assert!(is_link(&link), "{}", link.display());
    assert_eq!(saved_value(&target), 5.0);
}

#[test]
fn a_link_loop_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    let err = save(&tree(1.0), &a, &SaveOptions::default()).unwrap_err();
    assert!(matches!(err, tensorferry::Error::Io { .. }), "{err:?}");
}

#[test]
fn a_file_name_of_255_bytes_saves() {
    let dir = tempfile::tempdir().unwrap();
    let name = format!("{}.safetensors", "n".repeat(255 - ".safetensors".len()));
    assert_eq!(name.len(), 255);
    let path = dir.path().join(&name);
    save_value(&path, 1.0);
    save_value(&path, 2.0);
    assert_eq!(saved_value(&path), 2.0);
    assert_eq!(names_in(dir.path()), [name]);
}
