//! What paths can be read and saved to: only regular files, refused at once otherwise,
//! and every I/O failure an `Error::Io` carrying the path and the system's error.
#![cfg(unix)]

mod common;

use common::{every_way, save_dict, save_err};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use tensorferry::internal::io::read_header;
use tensorferry::{load, Error, LoadOptions, SaveOptions, Tensor, TensorDict};

/// Runs `f` on another thread and fails the test if it has not returned within 5 s (the
/// thread is left behind: a blocked open cannot be cancelled).
fn within_five_seconds<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("{what} blocked for 5 s"))
}

/// Every way of reading `path`: load with and without a map, and a header read.
fn read_all_ways(path: &Path) -> Vec<(&'static str, Error)> {
    let p = path.to_path_buf();
    within_five_seconds(&format!("reading {}", path.display()), move || {
        let [mapped, read, _] = every_way();
        vec![
            ("load mmap", load(&p, mapped).unwrap_err()),
            ("load read", load(&p, read).unwrap_err()),
            ("read_header", read_header(&p).unwrap_err()),
        ]
    })
}

fn io_error(err: &Error) -> (&Path, &std::io::Error) {
    match err {
        Error::Io { path, source, .. } => (path.as_path(), source),
        other => panic!("expected Error::Io, got {other:?}"),
    }
}

fn mkfifo(path: &Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success(), "mkfifo failed");
}

fn one_tensor() -> TensorDict {
    let mut d = TensorDict::new();
    d.insert("w", Tensor::from_slice(&[1.0f32, 2.0], &[2]).unwrap());
    d
}

/// The error the kernel itself gives for reading a folder (`EISDIR`).
fn kernel_eisdir(dir: &Path) -> i32 {
    let err = std::fs::File::open(dir)
        .unwrap()
        .read(&mut [0u8; 1])
        .unwrap_err();
    err.raw_os_error().unwrap()
}

/// True when permission checks do not apply to this process (root, CAP_DAC_OVERRIDE).
fn permissions_bypassed(dir: &Path) -> bool {
    let probe = dir.join("probe");
    std::fs::write(&probe, b"x").unwrap();
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o000)).unwrap();
    let bypassed = std::fs::File::open(&probe).is_ok();
    std::fs::remove_file(&probe).unwrap();
    bypassed
}

#[test]
fn a_fifo_is_refused_at_once_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.safetensors");
    mkfifo(&fifo);
    for (how, err) in read_all_ways(&fifo) {
        let (path, source) = io_error(&err);
        assert_eq!(path, fifo, "{how}");
        assert_eq!(source.kind(), ErrorKind::InvalidInput, "{how}");
        let msg = err.to_string();
        assert!(
            msg.contains("is a FIFO, not a regular file"),
            "{how}: {msg}"
        );
        assert!(msg.contains("pipe.safetensors"), "{how}: {msg}");
    }
}

/// A FIFO where a sharded checkpoint's index or one of its shards should be, and a FIFO
/// read with `O_DIRECT`: each refused at once, naming the FIFO, never a blocked read.
#[test]
fn a_fifo_as_an_index_a_shard_or_under_direct_reads_is_refused_at_once() {
    use tensorferry::internal::io::{load_sharded, save_sharded};
    let load = |p: PathBuf, direct: bool| {
        load(
            &p,
            LoadOptions {
                // SAFETY: nothing is mapped: a FIFO is refused before any map or read.
                mmap: if direct {
                    tensorferry::Mapping::READ
                } else {
                    unsafe { tensorferry::Mapping::map() }
                },
                direct,
                copy_on_write: false,
            },
        )
    };
    // O_DIRECT on a FIFO.
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.safetensors");
    mkfifo(&fifo);
    let p = fifo.clone();
    let err = within_five_seconds("a direct read of a FIFO", move || {
        load(p, true).unwrap_err()
    });
    assert_eq!(io_error(&err).0, fifo);
    assert!(
        err.to_string().contains("is a FIFO, not a regular file"),
        "{err}"
    );

    // A sharded checkpoint whose index, then whose second shard, is a FIFO.
    let mut d = TensorDict::new();
    for i in 0..4 {
        d.insert(
            format!("w{i}"),
            Tensor::from_slice(&[i as f32; 256], &[256]).unwrap(),
        );
    }
    let tree = tensorferry::Node::Dict(d);
    for victim in ["index", "shard"] {
        let dir = tempfile::tempdir().unwrap();
        let written = save_sharded(
            &tree,
            dir.path().join("model.safetensors"),
            &SaveOptions::default(),
            2048,
        )
        .unwrap();
        let index = dir.path().join("model.safetensors.index.json");
        assert!(index.exists() && written.len() > 2, "{written:?}");
        let target = if victim == "index" {
            index.clone()
        } else {
            written
                .iter()
                .find(|p| p.to_string_lossy().contains("-00002-of-"))
                .unwrap()
                .clone()
        };
        std::fs::remove_file(&target).unwrap();
        mkfifo(&target);
        let (i, f) = (index.clone(), dir.path().to_path_buf());
        let errs =
            within_five_seconds(&format!("loading with a FIFO as the {victim}"), move || {
                [
                    ("the index", load_sharded(&i, LoadOptions::default()).err()),
                    ("the folder", load(f, false).err()),
                ]
            });
        for (how, err) in errs {
            let err = err.unwrap_or_else(|| panic!("a FIFO as the {victim} loaded through {how}"));
            let msg = err.to_string();
            assert!(
                msg.contains("is a FIFO, not a regular file"),
                "{victim} via {how}: {msg}"
            );
            assert!(
                msg.contains(&*target.file_name().unwrap().to_string_lossy()),
                "{msg}"
            );
        }
    }
}

#[test]
fn character_devices_are_refused_at_once() {
    for dev in ["/dev/zero", "/dev/null", "/dev/tty", "/dev/urandom"] {
        let path = PathBuf::from(dev);
        match std::fs::metadata(&path) {
            Ok(m) if m.file_type().is_char_device() => {}
            _ => continue,
        }
        for (how, err) in read_all_ways(&path) {
            assert!(
                err.to_string()
                    .contains("is a character device, not a regular file"),
                "{dev} {how}: {err}"
            );
            assert_eq!(io_error(&err).0, path);
        }
    }
}

#[test]
fn procfs_files_are_clear_errors_without_blocking() {
    let status = Path::new("/proc/self/status");
    if !status.exists() {
        return;
    }
    for (how, err) in read_all_ways(status) {
        // It looks like a regular file of 0 bytes; it is refused as a file of /proc.
        assert!(
            matches!(err, Error::Io { .. }) && err.to_string().contains("/proc"),
            "{how}: {err:?}"
        );
    }
}

#[test]
fn a_folder_is_an_io_error_with_eisdir() {
    let dir = tempfile::tempdir().unwrap();
    let eisdir = kernel_eisdir(dir.path());
    for (how, err) in read_all_ways(dir.path()) {
        let (path, source) = io_error(&err);
        assert_eq!(path, dir.path(), "{how}");
        assert_eq!(source.raw_os_error(), Some(eisdir), "{how}: {err}");
        assert_eq!(source.kind(), ErrorKind::IsADirectory, "{how}");
    }
    for (how, err) in read_all_ways(dir.path()).into_iter().take(2) {
        assert!(
            err.to_string().contains("find a checkpoint"),
            "{how}: {err}"
        );
    }
}

#[test]
fn saving_to_a_folder_writes_model_safetensors_in_it() {
    let dir = tempfile::tempdir().unwrap();
    save_dict(&one_tensor(), dir.path(), &SaveOptions::default());
    assert!(dir.path().join("model.safetensors").is_file());
    let (loaded, _) = tensorferry::load(dir.path(), LoadOptions::default())
        .unwrap()
        .into_dict()
        .unwrap();
    assert_eq!(loaded.len(), 1);
}

#[test]
fn a_link_to_a_folder_or_fifo_is_refused_like_its_target() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe");
    mkfifo(&fifo);
    let to_fifo = dir.path().join("to_pipe.safetensors");
    std::os::unix::fs::symlink(&fifo, &to_fifo).unwrap();
    for (how, err) in read_all_ways(&to_fifo) {
        assert!(err.to_string().contains("FIFO"), "{how}: {err}");
    }
    // A link to a folder is that folder: its header cannot be read, and a load looks
    // for the checkpoint in it (here two files, neither a checkpoint it can choose).
    let to_dir = dir.path().join("to_dir.safetensors");
    std::os::unix::fs::symlink(dir.path(), &to_dir).unwrap();
    let eisdir = kernel_eisdir(dir.path());
    let err = read_header(&to_dir).unwrap_err();
    assert_eq!(io_error(&err).1.raw_os_error(), Some(eisdir));
    for (how, err) in read_all_ways(&to_dir).into_iter().take(2) {
        assert!(err.to_string().contains("name the file"), "{how}: {err}");
    }
}

#[test]
fn saving_over_a_fifo_is_refused_and_leaves_it() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.safetensors");
    mkfifo(&fifo);
    let target = fifo.clone();
    let err = within_five_seconds("saving over a FIFO", move || {
        save_err(one_tensor(), &target)
    });
    assert!(
        err.to_string().contains("is a FIFO, not a regular file"),
        "{err}"
    );
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file left"
    );
}

#[test]
fn a_missing_file_is_not_found_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.safetensors");
    for (how, err) in read_all_ways(&missing) {
        let (path, source) = io_error(&err);
        assert_eq!(path, missing, "{how}");
        assert_eq!(source.kind(), ErrorKind::NotFound, "{how}");
        assert!(source.raw_os_error().is_some(), "{how}: the errno is kept");
    }
    let in_missing_folder = dir.path().join("nope").join("x.safetensors");
    let err = save_err(one_tensor(), &in_missing_folder);
    let (path, source) = io_error(&err);
    assert_eq!(path, dir.path().join("nope"), "the missing folder is named");
    assert_eq!(source.kind(), ErrorKind::NotFound);
    assert!(source.raw_os_error().is_some(), "the errno is kept");
}

#[test]
fn an_unreadable_file_is_permission_denied() {
    let dir = tempfile::tempdir().unwrap();
    if permissions_bypassed(dir.path()) {
        eprintln!("skipped: this process bypasses permission checks (root)");
        return;
    }
    let path = dir.path().join("secret.safetensors");
    save_dict(&one_tensor(), &path, &SaveOptions::default());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
    for (how, err) in read_all_ways(&path) {
        let (p, source) = io_error(&err);
        assert_eq!(p, path, "{how}");
        assert_eq!(source.kind(), ErrorKind::PermissionDenied, "{how}");
    }
}

#[test]
fn saving_into_a_read_only_folder_is_permission_denied_and_leaves_the_file() {
    let dir = tempfile::tempdir().unwrap();
    if permissions_bypassed(dir.path()) {
        eprintln!("skipped: this process bypasses permission checks (root)");
        return;
    }
    let path = dir.path().join("kept.safetensors");
    std::fs::write(&path, b"previous").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
    let err = save_err(one_tensor(), &path);
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (p, source) = io_error(&err);
    assert_eq!(p, path);
    assert_eq!(source.kind(), ErrorKind::PermissionDenied);
    assert_eq!(std::fs::read(&path).unwrap(), b"previous");
}
