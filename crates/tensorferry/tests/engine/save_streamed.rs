//! Saves of device tensors stream through a ring of pinned buffers into the file: the
//! same bytes as a save of host copies, no more pinned memory than the ring, and a copy
//! failing half-way fails the save and keeps the previous file.

use super::*;
use tensorferry::SaveOptions;

const RING: Staging = Staging::Ring {
    chunk_bytes: 12_295, // odd, so chunks cut tensors and runs anywhere
    depth: 2,
};

fn ring_save() -> SaveOptions {
    SaveOptions {
        fsync: false,
        staging: RING,
        ..Default::default()
    }
}

/// Tensors larger and smaller than a chunk, strided, transposed (gathered on the host),
/// empty, and host tensors between device ones.
fn mixed_on(dev: Device) -> (Node, Node) {
    let mut host = TensorDict::new();
    let values: Vec<f32> = (0..40_000).map(|x| x as f32 * 0.5).collect();
    // Views of storages of their own: views that overlap cannot be saved (a file stores
    // each tensor's bytes apart).
    let [big, rows_of, columns_of] =
        [(); 3].map(|()| Tensor::from_slice(&values, &[200, 200]).unwrap());
    host.insert("a.big", big.clone());
    host.insert("b.rows", rows_of.step(0, 3).unwrap());
    host.insert("c.transposed", columns_of.transpose(0, 1).unwrap());
    host.insert(
        "d.empty",
        Tensor::zeros(tensorferry::DType::F16, &[0, 3]).unwrap(),
    );
    host.insert("e.ids", Tensor::from_slice(&[5i64, 6, 7], &[3]).unwrap());
    for (k, t) in many_tensors(40).tensors() {
        host.insert(format!("f.{}", k.dotted()), t.clone());
    }
    host.insert("g.tag", "kept");
    let Node::Dict(mut there) = Node::from(host.clone()).to(dev, false).unwrap() else {
        unreachable!("a dict moves as a dict")
    };
    // Some tensors stay on the host, between device ones in the file's order.
    there.insert("e.ids", host.tensor(&["e.ids"]).unwrap().clone());
    there.insert("f.t7", host.tensor(&["f.t7"]).unwrap().clone());
    // Views of device memory, strided and transposed.
    let rows_there = rows_of.to(dev, false).unwrap();
    let columns_there = columns_of.to(dev, false).unwrap();
    there.insert("b.rows", rows_there.step(0, 3).unwrap());
    there.insert("c.transposed", columns_there.transpose(0, 1).unwrap());
    (host.into(), there.into())
}

fn a_device_dictionary_streams_into_the_same_bytes_as_its_host_copy(dev: Device) {
    // Streamed saves take the device's ring from its pinned pool, whose counts another
    // test reads.
    let _pool = pool_lock();
    let (host, there) = mixed_on(dev);
    let dir = tempfile::tempdir().unwrap();
    let (from_host, from_device) = (dir.path().join("h"), dir.path().join("d"));
    let plain = SaveOptions {
        fsync: false,
        ..Default::default()
    };
    tensorferry::save(&host, &from_host, &plain).unwrap();
    tensorferry::save(&there, &from_device, &ring_save()).unwrap();
    assert_eq!(
        std::fs::read(&from_device).unwrap(),
        std::fs::read(&from_host).unwrap()
    );
    // The automatic ring and no ring at all write the same bytes too.
    for staging in [Staging::Auto, Staging::Off] {
        let opts = SaveOptions {
            staging,
            ..plain.clone()
        };
        tensorferry::save(&there, &from_device, &opts).unwrap();
        assert_eq!(
            std::fs::read(&from_device).unwrap(),
            std::fs::read(&from_host).unwrap(),
            "{staging:?}"
        );
    }
}
test_device!(
    save_streams_through_the_ring,
    a_device_dictionary_streams_into_the_same_bytes_as_its_host_copy
);

fn a_streamed_save_pins_no_more_than_its_ring(dev: Device) {
    if dev.is_host() {
        return; // nothing to stream
    }
    let _pool = pool_lock();
    let pool = pinned_pool(dev);
    let data: Vec<f32> = (0..2_000_000).map(|x| x as f32).collect(); // 8 MB
    let mut d = TensorDict::new();
    d.insert("w", Tensor::from_slice(&data, &[2_000_000]).unwrap());
    let d = Node::from(d);
    let there = d.to(dev, false).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let ring = SaveOptions {
        fsync: false,
        staging: Staging::Ring {
            chunk_bytes: 1 << 20,
            depth: 2,
        },
        ..Default::default()
    };
    let before = pool.stats();
    tensorferry::save(&there, &path, &ring).unwrap();
    let after = pool.stats();
    let taken = (after.hits + after.misses) - (before.hits + before.misses);
    assert_eq!(taken, 2, "the ring's two buffers, reused for all 8 chunks");
    assert!(
        after.pinned_bytes - before.pinned_bytes <= 2 * (2 << 20),
        "pinned {} bytes more for an 8 MB save through a 2 x 1 MiB ring",
        after.pinned_bytes - before.pinned_bytes
    );
    let back = tensorferry::load(&path, Default::default()).unwrap().root;
    assert_eq!(host_values(&back), host_values(&d));
}
test_device!(
    save_streams_in_bounded_memory,
    a_streamed_save_pins_no_more_than_its_ring
);

#[test]
fn a_copy_failing_mid_stream_fails_the_save_and_keeps_the_previous_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let data: Vec<f32> = (0..100_000).map(|x| x as f32).collect();
    let mut d = TensorDict::new();
    d.insert("w", Tensor::from_slice(&data, &[100_000]).unwrap());
    let d = Node::from(d);
    tensorferry::save(&d, &path, &ring_save()).unwrap();
    let previous = std::fs::read(&path).unwrap();
    with_emu1("fail_copy=3", || {
        let there = d.to(EMU1_DEV, false).unwrap(); // copy 1
                                                    // Chunks of 12,295 bytes: copy 2 is the first chunk, copy 3 the second.
        let err = tensorferry::save(&there, &path, &ring_save()).unwrap_err();
        assert!(err.to_string().contains("injected fault"), "{err}");
    });
    assert_eq!(std::fs::read(&path).unwrap(), previous);
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
}

#[test]
fn a_save_waits_for_device_copies_still_filling_its_tensors() {
    let d = many_tensors(30);
    with_emu1("latency_us=20000", || {
        let there = d.to_with(EMU1_DEV, copy_non_blocking()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        tensorferry::save(&there, &path, &ring_save()).unwrap();
        let back = tensorferry::load(&path, Default::default()).unwrap().root;
        assert_eq!(host_values(&back), host_values(&d));
    });
}
