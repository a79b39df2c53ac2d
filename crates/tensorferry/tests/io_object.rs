//! Checkpoints in object storage, against a real S3 server on the loopback interface
//! (`s3s-fs`: SigV4, ranged GETs, multipart uploads over a local folder). Each test starts
//! its own server; the tests take turns, since the client reads its settings from the
//! process's environment. Without the server's binary the tests pass over themselves
//! saying so, unless `TENSORFERRY_REQUIRE_S3=1` (as `scripts/test.sh` sets) makes that a
//! failure.

use std::collections::HashSet;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tensorferry::internal::io::object::{
    cause_of, load_url, load_url_arriving, load_url_to_until, read_header_url, read_into, save_url,
    tensor_names, Cause, ObjectOptions,
};
use tensorferry::{load, save, Device, Node, SaveOptions, Staging, Tensor, TensorDict, Value};

/// The fixed credentials the servers accept.
const ACCESS_KEY: &str = "tensorferry-test";
const SECRET_KEY: &str = "tensorferry-test-secret";

/// An `s3s-fs` server on 127.0.0.1, serving a temporary folder, stopped when dropped.
struct S3Server {
    child: Child,
    port: u16,
    root: tempfile::TempDir,
    _turn: MutexGuard<'static, ()>,
}

/// The server's binary: `TENSORFERRY_S3S_FS`, else the workspace's `target/tools`, else
/// `s3s-fs` on the `PATH`.
fn server_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TENSORFERRY_S3S_FS") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let tools = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/bin/s3s-fs");
    if tools.is_file() {
        return Some(tools);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("s3s-fs"))
            .find(|p| p.is_file())
    })
}

static TURNS: Mutex<()> = Mutex::new(());

impl S3Server {
    /// A server with the bucket `bucket`, the client's environment pointing at it; `None`
    /// (after saying why) when the binary is absent and not required.
    fn start() -> Option<S3Server> {
        let turn = TURNS.lock().unwrap_or_else(|p| p.into_inner());
        let Some(binary) = server_binary() else {
            assert!(
                std::env::var_os("TENSORFERRY_REQUIRE_S3").is_none(),
                "TENSORFERRY_REQUIRE_S3 is set and no s3s-fs binary was found"
            );
            eprintln!("skipped: no s3s-fs binary (bash scripts/s3-server.sh install)");
            return None;
        };
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("bucket")).unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(binary)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(root.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = S3Server {
            child,
            port,
            root,
            _turn: turn,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "s3s-fs did not answer on port {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        for (k, v) in [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ENDPOINT_URL", &format!("http://127.0.0.1:{port}")),
            // Never the instance-metadata address: nothing but loopback.
            ("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9"),
            ("TENSORFERRY_OBJECT_RETRIES", "1"),
            ("TENSORFERRY_OBJECT_RETRY_TIMEOUT", "2"),
        ] {
            std::env::set_var(k, v);
        }
        // Small parts, so that the small trees of these tests still take many requests.
        std::env::set_var("TENSORFERRY_OBJECT_HEADER_BYTES", "64");
        std::env::set_var("TENSORFERRY_OBJECT_PART_BYTES", "4096");
        Some(server)
    }

    /// The file the server keeps for `key` of the bucket.
    fn file(&self, key: &str) -> PathBuf {
        self.root.path().join("bucket").join(key)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = self.port;
    }
}

/// `layers` tensors of 64 KiB (16384 f32) nested under `model`, with plain values.
fn model(layers: usize, salt: f32) -> Node {
    let mut d = TensorDict::new();
    for i in 0..layers {
        let values: Vec<f32> = (0..16384)
            .map(|j| salt + (i * 100_000 + j) as f32)
            .collect();
        d.insert_path(
            &["model", &format!("layer.{i}.weight")],
            Tensor::from_slice(&values, &[128, 128]).unwrap(),
        )
        .unwrap();
    }
    d.insert("step", 42i64);
    d.insert(
        "betas",
        Node::Tuple(vec![
            Node::Value(Value::Float(0.9)),
            Node::Value(Value::Float(0.999)),
        ]),
    );
    Node::Dict(d)
}

fn values(node: &Node) -> Vec<(String, Vec<f32>)> {
    node.tensors()
        .into_iter()
        .map(|(p, t)| (p.dotted(), t.to_vec::<f32>().unwrap()))
        .collect()
}

#[test]
fn a_tree_saved_to_s3_loads_back_the_same_through_the_generic_load() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    let tree = model(3, 0.5);
    let url = "s3://bucket/run/model.safetensors";
    save(&tree, url, &SaveOptions::default()).unwrap();
    let loaded = load(url, Default::default()).unwrap();
    assert_eq!(values(&loaded.root), values(&tree));
    let d = loaded.root.as_dict().unwrap();
    assert!(matches!(d.get("step"), Some(Node::Value(Value::Int(42)))));
}

#[test]
fn a_tree_handed_over_before_its_bytes_are_in_is_read_only_once_they_are() {
    let Some(server) = S3Server::start() else {
        return;
    };
    let tree = model(3, 0.25);
    let url = "s3://bucket/arriving/model.safetensors";
    save(&tree, url, &SaveOptions::default()).unwrap();
    // The loader's test hook holds it once it has handed the tree over.
    let base = server.root.path().join("handed");
    let with = |suffix: &str| PathBuf::from(format!("{}{suffix}", base.display()));
    std::env::set_var("TENSORFERRY_TEST_OBJECT_HANDED", &base);
    let handed = load_url_arriving(url, &ObjectOptions::from_env(), None);
    let deadline = Instant::now() + Duration::from_secs(20);
    // The reading thread looks for the variable once it has handed the tree over, which
    // may be after the call returned: it is removed once the hook is reached (another
    // test's load that meets the hook meanwhile goes on with this one's ".go").
    while !with(".ready").exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::env::remove_var("TENSORFERRY_TEST_OBJECT_HANDED");
    assert!(with(".ready").exists(), "the loader never reached its hook");
    let (loaded, arrival) = handed.unwrap();
    assert!(!arrival.is_done());
    let reader = std::thread::spawn(move || values(&loaded.root));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !reader.is_finished(),
        "a tensor was read before its bytes were all in"
    );
    std::fs::write(with(".go"), b"").unwrap();
    assert_eq!(reader.join().unwrap(), values(&tree));
    arrival.wait().unwrap();
}

#[test]
fn the_bytes_stored_are_the_bytes_a_local_save_writes() {
    let Some(server) = S3Server::start() else {
        return;
    };
    let tree = model(2, 1.0);
    save(&tree, "s3://bucket/a.safetensors", &SaveOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("a.safetensors");
    save(&tree, &local, &SaveOptions::default()).unwrap();
    assert_eq!(
        std::fs::read(server.file("a.safetensors")).unwrap(),
        std::fs::read(&local).unwrap()
    );
}

#[test]
fn a_sharded_save_loads_through_its_index_from_the_folder_and_the_file_name() {
    let Some(server) = S3Server::start() else {
        return;
    };
    let tree = model(4, 2.0);
    let written = save_url(
        &tree,
        "s3://bucket/ckpt/",
        &SaveOptions::default(),
        Some(150_000),
    )
    .unwrap();
    assert_eq!(written.len(), 3, "{written:?}");
    assert!(written
        .last()
        .unwrap()
        .ends_with("model.safetensors.index.json"));
    assert!(server.file("ckpt/model.safetensors.index.json").is_file());
    let options = ObjectOptions::from_env();
    for url in ["s3://bucket/ckpt/", "s3://bucket/ckpt/model.safetensors"] {
        let loaded = load_url(url, &options, None).unwrap();
        assert_eq!(values(&loaded.root), values(&tree), "{url}");
    }
}

#[test]
fn a_subset_fetches_only_its_tensors_and_blanks_the_others_in_place() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    let tree = model(3, 3.0);
    save(&tree, "s3://bucket/s.safetensors", &SaveOptions::default()).unwrap();
    let options = ObjectOptions::from_env();
    let (names, aliased, pinned) = tensor_names("s3://bucket/s.safetensors", &options).unwrap();
    assert_eq!((names.len(), aliased), (3, false));
    // The object as its names were read: the load asks for no header again.
    let options = ObjectOptions {
        pinned: Some(pinned.expect("a URL naming one object pins it")),
        ..options
    };
    let only: HashSet<String> = ["model.layer.1.weight".to_string()].into();
    let loaded = load_url("s3://bucket/s.safetensors", &options, Some(&only)).unwrap();
    let got = values(&loaded.root);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0], values(&tree)[1]);
    let model = loaded
        .root
        .as_dict()
        .unwrap()
        .get("model")
        .unwrap()
        .as_dict()
        .unwrap();
    assert!(matches!(
        model.get("layer.0.weight"),
        Some(Node::Value(Value::None))
    ));
}

#[test]
fn a_missing_object_and_a_missing_bucket_are_told_apart() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    let options = ObjectOptions::from_env();
    let e = load_url("s3://bucket/absent.safetensors", &options, None).unwrap_err();
    assert_eq!(cause_of(&e), Some(Cause::NotFound), "{e}");
    assert!(
        e.to_string().contains("s3://bucket/absent.safetensors"),
        "{e}"
    );
    let e = load_url("s3://no-such-bucket/x.safetensors", &options, None).unwrap_err();
    assert_eq!(cause_of(&e), Some(Cause::NoBucket), "{e}");
}

#[test]
fn refused_credentials_are_named() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "wrong");
    let e = load_url(
        "s3://bucket/x.safetensors",
        &ObjectOptions::from_env(),
        None,
    )
    .unwrap_err();
    assert_eq!(cause_of(&e), Some(Cause::BadCredentials), "{e}");
}

#[test]
fn a_load_called_from_inside_an_async_runtime_blocks_a_helper_thread_not_the_runtime() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    let tree = model(1, 4.0);
    save(
        &tree,
        "s3://bucket/in-async.safetensors",
        &SaveOptions::default(),
    )
    .unwrap();
    let callers_runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let loaded = callers_runtime
        .block_on(async { load("s3://bucket/in-async.safetensors", Default::default()) })
        .unwrap();
    assert_eq!(values(&loaded.root), values(&tree));
}

#[test]
fn an_object_too_short_for_a_header_is_a_format_error_naming_it() {
    let Some(server) = S3Server::start() else {
        return;
    };
    std::fs::write(server.file("empty.safetensors"), b"").unwrap();
    std::fs::write(server.file("short.safetensors"), b"abc").unwrap();
    for name in ["empty.safetensors", "short.safetensors"] {
        let url = format!("s3://bucket/{name}");
        let e = load_url(&url, &ObjectOptions::from_env(), None).unwrap_err();
        assert!(matches!(e, tensorferry::Error::Format { .. }), "{e}");
        assert!(e.to_string().contains(&url), "{e}");
    }
}

/// The values of `node`'s tensors, each brought to the host first.
fn values_on_host(node: &Node) -> Vec<(String, Vec<f32>)> {
    node.tensors()
        .into_iter()
        .map(|(p, t)| {
            let host = t.to(Device::Cpu, false).unwrap();
            (p.dotted(), host.to_vec::<f32>().unwrap())
        })
        .collect()
}

#[test]
fn a_checkpoint_streams_onto_a_device_through_a_ring_smaller_than_it() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    let tree = model(4, 5.0); // 256 KiB of data, through 2 buffers of 8 KiB
    save(&tree, "s3://bucket/d.safetensors", &SaveOptions::default()).unwrap();
    save_url(
        &tree,
        "s3://bucket/sharded/",
        &SaveOptions::default(),
        Some(150_000),
    )
    .unwrap();
    let ring = Staging::Ring {
        chunk_bytes: 8192,
        depth: 2,
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    let options = ObjectOptions::from_env();
    for url in ["s3://bucket/d.safetensors", "s3://bucket/sharded/"] {
        let loaded =
            load_url_to_until(url, Device::Emulated(0), &options, ring, &stop, None).unwrap();
        for (_, t) in loaded.root.tensors() {
            assert_eq!(t.device(), Device::Emulated(0), "{url}");
        }
        assert_eq!(values_on_host(&loaded.root), values(&tree), "{url}");
        let d = loaded.root.as_dict().unwrap();
        assert!(matches!(d.get("step"), Some(Node::Value(Value::Int(42)))));
    }
}

#[test]
fn a_streamed_load_asked_to_stop_is_interrupted_and_a_missing_object_is_named() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    save(
        &model(1, 6.0),
        "s3://bucket/s.safetensors",
        &SaveOptions::default(),
    )
    .unwrap();
    let options = ObjectOptions::from_env();
    let stop = std::sync::atomic::AtomicBool::new(true);
    let e = load_url_to_until(
        "s3://bucket/s.safetensors",
        Device::Emulated(0),
        &options,
        Staging::Auto,
        &stop,
        None,
    )
    .unwrap_err();
    assert!(
        matches!(e, tensorferry::Error::Io { ref source, .. }
            if source.kind() == std::io::ErrorKind::Interrupted),
        "{e}"
    );
    stop.store(false, std::sync::atomic::Ordering::Relaxed);
    let e = load_url_to_until(
        "s3://bucket/absent.safetensors",
        Device::Emulated(0),
        &options,
        Staging::Auto,
        &stop,
        None,
    )
    .unwrap_err();
    assert_eq!(cause_of(&e), Some(Cause::NotFound), "{e}");
}

#[test]
fn byte_ranges_read_from_the_header_come_from_one_version_of_the_object() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    let tree = model(3, 7.0);
    let url = "s3://bucket/r.safetensors";
    save(&tree, url, &SaveOptions::default()).unwrap();
    let options = ObjectOptions::from_env();
    let (header, stored, etag, size) = read_header_url(url, &options).unwrap();
    assert!(etag.is_some());
    assert_eq!(
        stored.len() as u64,
        header.data_start,
        "the 8-byte length and the JSON"
    );
    let ranges: Vec<std::ops::Range<u64>> = header
        .tensors
        .iter()
        .map(|t| header.data_start + t.begin as u64..header.data_start + t.end as u64)
        .collect();
    assert_eq!(ranges.last().unwrap().end, size);
    let mut got: Vec<Vec<u8>> = ranges
        .iter()
        .map(|r| vec![0; (r.end - r.start) as usize])
        .collect();
    let targets = (ranges.iter().map(|r| r.start))
        .zip(got.iter_mut().map(|b| b.as_mut_slice()))
        .collect();
    read_into(url, targets, etag.as_deref(), &options).unwrap();
    let expected = values(&tree);
    for (i, bytes) in got.iter().enumerate() {
        let floats: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let name = &header.tensors[i].name;
        let (_, want) = expected.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!(&floats, want, "{name}");
    }
    let e = read_into(url, vec![(0, &mut [0; 8][..])], Some("\"stale\""), &options).unwrap_err();
    assert_eq!(cause_of(&e), Some(Cause::Changed), "{e}");
    let mut past_the_end = vec![0; size as usize + 1];
    let e = read_into(url, vec![(0, &mut past_the_end[..])], None, &options).unwrap_err();
    assert!(
        e.to_string().contains(&format!("holds {size} bytes")),
        "{e}"
    );
}

#[test]
fn device_tensors_are_uploaded_through_the_ring_beside_host_tensors() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    // 3 MiB on the device, 1 MiB on the host, 3 MiB on the device: two 5 MiB parts.
    let values = |salt: f32, n: usize| -> Vec<f32> { (0..n).map(|i| salt + i as f32).collect() };
    let mut d = TensorDict::new();
    let on_device = |v: &[f32]| {
        Tensor::from_slice(v, &[v.len()])
            .unwrap()
            .to(Device::Emulated(0), false)
            .unwrap()
    };
    d.insert("a", on_device(&values(1.0, 3 << 18)));
    d.insert(
        "b",
        Tensor::from_slice(&values(2.0, 1 << 18), &[1 << 18]).unwrap(),
    );
    d.insert("c", on_device(&values(3.0, 3 << 18)));
    let options = SaveOptions {
        staging: Staging::Ring {
            chunk_bytes: 64 << 10,
            depth: 2,
        },
        ..SaveOptions::default()
    };
    let tree = Node::Dict(d);
    save(&tree, "s3://bucket/dev.safetensors", &options).unwrap();
    let loaded = load("s3://bucket/dev.safetensors", Default::default()).unwrap();
    assert_eq!(values_on_host(&loaded.root), values_on_host(&tree));
}

#[test]
fn a_subset_streams_onto_a_device_into_memory_of_its_own_size() {
    let Some(_server) = S3Server::start() else {
        return;
    };
    let tree = model(4, 8.0);
    save(
        &tree,
        "s3://bucket/sub.safetensors",
        &SaveOptions::default(),
    )
    .unwrap();
    save_url(
        &tree,
        "s3://bucket/subs/",
        &SaveOptions::default(),
        Some(150_000),
    )
    .unwrap();
    let only: HashSet<String> = ["model.layer.1.weight", "model.layer.3.weight"]
        .map(String::from)
        .into();
    let ring = Staging::Ring {
        chunk_bytes: 8192,
        depth: 2,
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    let options = ObjectOptions::from_env();
    let expected: Vec<(String, Vec<f32>)> = values(&tree)
        .into_iter()
        .filter(|(n, _)| only.contains(n))
        .collect();
    for url in ["s3://bucket/sub.safetensors", "s3://bucket/subs/"] {
        let loaded =
            load_url_to_until(url, Device::Emulated(0), &options, ring, &stop, Some(&only))
                .unwrap();
        assert_eq!(values_on_host(&loaded.root), expected, "{url}");
        let storages: HashSet<usize> = loaded
            .root
            .tensors()
            .iter()
            .map(|(_, t)| std::sync::Arc::as_ptr(t.storage()) as usize)
            .collect();
        for (_, t) in loaded.root.tensors() {
            assert_eq!(t.device(), Device::Emulated(0));
            // Each object's device memory holds its wanted tensors only.
            assert!(
                t.storage().len() <= 2 * 65536 && t.storage().len() % 65536 == 0,
                "{url}: {}",
                t.storage().len()
            );
        }
        assert!(!storages.is_empty());
        let model = loaded.root.as_dict().unwrap().get("model").unwrap();
        let layer0 = match model {
            Node::Dict(d) => d.get("layer.0.weight").cloned(),
            _ => None,
        };
        assert!(
            matches!(layer0, Some(Node::Value(Value::None)) | None),
            "{url}"
        );
    }
}
