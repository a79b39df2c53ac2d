//! `O_DIRECT` loads (`LoadOptions::direct`): the same trees as ordinary loads, in fresh
//! page-aligned memory; the page cache with a reason where the filesystem refuses it; and
//! loads straight onto a device through a bounded ring.

use std::path::{Path, PathBuf};

use tensorferry::internal::io::save_sharded;
use tensorferry::load_to;
use tensorferry::{
    load, save, DType, Device, Error, LoadOptions, Node, SaveOptions, Staging, Tensor, TensorDict,
};

const DIRECT: LoadOptions = LoadOptions {
    mmap: tensorferry::Mapping::READ,
    direct: true,
    copy_on_write: false,
};
const READ: LoadOptions = LoadOptions {
    mmap: tensorferry::Mapping::READ,
    direct: false,
    copy_on_write: false,
};

/// Bytes that differ from tensor to tensor and from block to block.
fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ (i >> 12) ^ seed) as u8)
        .collect()
}

/// A tree of u8 tensors of the given sizes (nested, with a plain value beside them).
fn tree_of(sizes: &[usize]) -> Node {
    let mut d = TensorDict::new();
    for (i, &len) in sizes.iter().enumerate() {
        let t = Tensor::from_bytes(DType::U8, vec![len], &pattern(len, i)).unwrap();
        d.insert_path(&["model", &format!("t.{i}")], t).unwrap();
    }
    d.insert("step", 7i64);
    Node::Dict(d)
}

fn saved(dir: &Path, tree: &Node) -> PathBuf {
    let path = dir.join("x.safetensors");
    save(tree, &path, &SaveOptions::default()).unwrap();
    path
}

/// Every tensor's path and bytes (moved to the host first), in tree order.
fn contents(node: &Node) -> Vec<(String, Vec<u8>)> {
    node.tensors()
        .into_iter()
        .map(|(p, t)| {
            let host = t.to(Device::Cpu, false).unwrap();
            (p.dotted(), host.contiguous_bytes().unwrap().to_vec())
        })
        .collect()
}

fn same_as_an_ordinary_load(path: &Path, loaded: &tensorferry::Loaded) {
    let ordinary = load(path, READ).unwrap();
    assert_eq!(contents(&loaded.root), contents(&ordinary.root));
    // The same structure and plain values; the device aside.
    let shape = |n: &Node| format!("{n:?}").replace("device=emu:0", "device=cpu");
    assert_eq!(shape(&loaded.root), shape(&ordinary.root));
    assert_eq!(loaded.metadata, ordinary.metadata);
}

/// True when the filesystem holding `dir` reads files opened with `O_DIRECT`.
fn supports_direct(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let probe = dir.join("direct-probe");
    std::fs::write(&probe, vec![1u8; 4096]).unwrap();
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe);
    let ok = opened.is_ok_and(|f| {
        use std::os::unix::fs::FileExt;
        let mut buf =
            tensorferry::internal::memory::AlignedBuffer::zeroed_page_aligned(4096).unwrap();
        f.read_at(buf.as_mut_slice(), 0).is_ok()
    });
    std::fs::remove_file(probe).unwrap();
    ok
}

#[test]
fn a_direct_load_equals_an_ordinary_one_for_sizes_that_are_not_whole_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree_of(&[1, 4095, 4096, 4097, 3 << 20, 12_345, (5 << 20) + 1]);
    let path = saved(dir.path(), &tree);
    let loaded = load(&path, DIRECT).unwrap();
    same_as_an_ordinary_load(&path, &loaded);
    let t = loaded.root.tensors()[0].1.clone();
    assert!(!t.is_read_only(), "fresh memory, not a map");
}

#[test]
fn a_file_whose_data_section_is_empty_loads_directly() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = TensorDict::new();
    d.insert("empty", Tensor::zeros(DType::F32, &[0, 3]).unwrap());
    d.insert("step", 1i64);
    let path = saved(dir.path(), &Node::Dict(d));
    let loaded = load(&path, DIRECT).unwrap();
    same_as_an_ordinary_load(&path, &loaded);
    assert_eq!(loaded.direct_fallback, None);
}

#[test]
fn many_small_tensors_load_directly() {
    let dir = tempfile::tempdir().unwrap();
    let sizes: Vec<usize> = (0..3000).map(|i| i % 37 + 1).collect();
    let path = saved(dir.path(), &tree_of(&sizes));
    let loaded = load(&path, DIRECT).unwrap();
    same_as_an_ordinary_load(&path, &loaded);
}

#[test]
fn direct_takes_precedence_over_mmap() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(dir.path(), &tree_of(&[10_000]));
    let both = LoadOptions {
        // SAFETY: this test's files live in its own temporary folder; nothing truncates or
        // rewrites them while their tensors are alive.
        mmap: unsafe { tensorferry::Mapping::map() },
        direct: true,
        copy_on_write: false,
    };
    let loaded = load(&path, both).unwrap();
    let t = loaded.root.tensors()[0].1.clone();
    assert!(!t.is_read_only(), "a direct load is never a map");
    assert_eq!(
        t.storage().as_ptr() as usize % 4096,
        0,
        "page-aligned memory"
    );
}

#[test]
fn a_file_shorter_than_its_header_claims_is_a_format_error_with_direct() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(dir.path(), &tree_of(&[10_000, 5000]));
    let len = std::fs::metadata(&path).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(len - 100).unwrap();
    let err = load(&path, DIRECT).unwrap_err();
    assert!(matches!(err, Error::Format { .. }), "{err}");
    let err = load_to(&path, Device::Emulated(0), DIRECT, Staging::Auto).unwrap_err();
    assert!(matches!(err, Error::Format { .. }), "{err}");
}

#[test]
fn a_filesystem_that_supports_o_direct_is_read_directly() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    if !supports_direct(dir.path()) {
        eprintln!("skipped: {} refuses O_DIRECT", dir.path().display());
        return;
    }
    let path = saved(dir.path(), &tree_of(&[100_000, 7]));
    let loaded = load(&path, DIRECT).unwrap();
    assert_eq!(loaded.direct_fallback, None);
    same_as_an_ordinary_load(&path, &loaded);
}

#[test]
fn tmpfs_is_read_directly_or_through_the_page_cache_with_its_reason() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipped: no /dev/shm here");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let path = saved(dir.path(), &tree_of(&[100_000, 7]));
    let loaded = load(&path, DIRECT).unwrap();
    same_as_an_ordinary_load(&path, &loaded);
    match (&loaded.direct_fallback, supports_direct(dir.path())) {
        (None, true) => eprintln!("note: tmpfs accepts O_DIRECT on this kernel (6.6 and later)"),
        (Some(why), false) => assert!(
            why.contains("refused O_DIRECT (EINVAL): read through the page cache"),
            "{why}"
        ),
        (why, supported) => panic!("fallback {why:?}, but the probe says O_DIRECT {supported}"),
    }
}

#[test]
fn a_sharded_checkpoint_loads_directly_shard_by_shard() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree_of(&[5000; 12]);
    let path = dir.path().join("model.safetensors");
    let written = save_sharded(&tree, &path, &SaveOptions::default(), 12_000).unwrap();
    assert!(written.len() > 3, "several shards");
    let loaded = load(dir.path(), DIRECT).unwrap();
    same_as_an_ordinary_load(dir.path(), &loaded);
}

#[test]
fn a_file_streams_onto_a_device_directly_through_a_ring_smaller_than_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(dir.path(), &tree_of(&[1, 300_000, 4097, 70_000]));
    let ring = Staging::Ring {
        chunk_bytes: 64 << 10,
        depth: 2,
    };
    for options in [DIRECT, READ] {
        let loaded = load_to(&path, Device::Emulated(0), options, ring).unwrap();
        for (_, t) in loaded.root.tensors() {
            assert_eq!(t.device(), Device::Emulated(0));
        }
        same_as_an_ordinary_load(&path, &loaded);
    }
}

#[test]
fn a_sharded_checkpoint_streams_onto_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let tree = tree_of(&[5000; 6]);
    let path = dir.path().join("model.safetensors");
    save_sharded(&tree, &path, &SaveOptions::default(), 12_000).unwrap();
    let loaded = load_to(dir.path(), Device::Emulated(0), DIRECT, Staging::Auto).unwrap();
    same_as_an_ordinary_load(dir.path(), &loaded);
}

#[test]
fn an_empty_data_section_streams_onto_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = TensorDict::new();
    d.insert("empty", Tensor::zeros(DType::F32, &[0]).unwrap());
    let path = saved(dir.path(), &Node::Dict(d));
    let loaded = load_to(&path, Device::Emulated(0), DIRECT, Staging::Auto).unwrap();
    same_as_an_ordinary_load(&path, &loaded);
}
