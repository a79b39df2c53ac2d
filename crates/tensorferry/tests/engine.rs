//! The transfer engine's suite: one body per behaviour, run on every available device
//! (candle's `test_device!` pattern): `cpu` and `emu` everywhere, `cuda` when a driver is
//! present — a real GPU, or the fake driver of `crates/fake-cuda` that `scripts/test.sh`
//! runs this suite against. Without one the `cuda` variants say why they skip, unless
//! `TENSORFERRY_EXPECT_CUDA=1`, which makes a missing driver a failure.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensorferry::internal::backend::emulated::{self, EmuConfig};
use tensorferry::{Device, Error, MoveOptions, Node, Staging, Tensor, TensorDict};

macro_rules! test_device {
    ($name:ident, $body:ident) => {
        mod $name {
            use super::*;
            #[test]
            fn cpu() {
                $body(Device::Cpu);
            }
            #[test]
            fn emu() {
                $body(Device::Emulated(0));
            }
            #[test]
            fn cuda() {
                if cuda_missing() {
                    return;
                }
                $body(Device::Cuda(0));
            }
        }
    };
}

/// True (after saying why) when no CUDA driver is present; panics instead when
/// `TENSORFERRY_EXPECT_CUDA=1`, so that a run meant for a GPU cannot pass by skipping.
fn cuda_missing() -> bool {
    match Device::Cuda(0).ensure_available() {
        Ok(()) => false,
        Err(e) if std::env::var("TENSORFERRY_EXPECT_CUDA").as_deref() == Ok("1") => {
            panic!("TENSORFERRY_EXPECT_CUDA=1 but {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            true
        }
    }
}

/// Return before the copies run (sharing what is on the device already).
fn non_blocking() -> MoveOptions {
    MoveOptions {
        non_blocking: true,
        ..Default::default()
    }
}

/// Always copy, and return before the copies run.
fn copy_non_blocking() -> MoveOptions {
    MoveOptions {
        copy: true,
        ..non_blocking()
    }
}

/// Polls until `done` holds, for at most 2 s.
fn eventually(mut done: impl FnMut() -> bool) {
    for _ in 0..400 {
        if done() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn sample() -> Node {
    sample_dict().into()
}

fn sample_dict() -> TensorDict {
    let mut d = TensorDict::new();
    let m = Tensor::from_slice(&(0..12).map(|x| x as f32).collect::<Vec<_>>(), &[3, 4]).unwrap();
    d.insert_path(&["model", "layer.0.weight"], m.clone())
        .unwrap();
    d.insert_path(&["model", "t"], m.transpose(0, 1).unwrap())
        .unwrap();
    d.insert("ids", Tensor::from_slice(&[1i64, 2, 3], &[3]).unwrap());
    d.insert(
        "empty",
        Tensor::zeros(tensorferry::DType::F16, &[0, 2]).unwrap(),
    );
    d.insert("scalar", Tensor::from_slice(&[7u8], &[]).unwrap());
    d.insert("tag", "run-1");
    d
}

fn host_values(d: &Node) -> Vec<(String, Vec<u8>)> {
    d.tensors()
        .into_iter()
        .map(|(p, t)| {
            let h = t.to(Device::Cpu, false).unwrap();
            (
                p.to_string(),
                h.deep_copy().unwrap().contiguous_bytes().unwrap().to_vec(),
            )
        })
        .collect()
}

fn round_trip_keeps_every_value(dev: Device) {
    let d = sample();
    let there = d.to(dev, false).unwrap();
    assert_eq!(there.device(), Some(dev));
    let back = there.to(Device::Cpu, false).unwrap();
    assert_eq!(host_values(&back), host_values(&d));
    assert!(matches!(back.get_path(&["tag"]), Some(Node::Value(_))));
}
test_device!(round_trip, round_trip_keeps_every_value);

fn same_device_shares_unless_copy(dev: Device) {
    let there = sample().to(dev, false).unwrap();
    let again = there.to(dev, false).unwrap();
    let a = there.tensor(&["ids"]).unwrap();
    assert!(Arc::ptr_eq(
        a.storage(),
        again.tensor(&["ids"]).unwrap().storage()
    ));
    let copied = there.to(dev, true).unwrap();
    assert!(!Arc::ptr_eq(
        a.storage(),
        copied.tensor(&["ids"]).unwrap().storage()
    ));
    assert_eq!(host_values(&copied), host_values(&there));
}
test_device!(no_copy_on_the_same_device, same_device_shares_unless_copy);

fn one_plan_per_dictionary(dev: Device) {
    let d = sample();
    let there = d.to(dev, true).unwrap();
    let storages: Vec<_> = there
        .tensors()
        .iter()
        .map(|(_, t)| Arc::as_ptr(t.storage()))
        .collect();
    assert!(
        storages.windows(2).all(|w| w[0] == w[1]),
        "every tensor in one buffer"
    );
    for (_, t) in there.tensors() {
        assert_eq!(t.offset() % 64, 0);
        assert!(t.is_contiguous());
    }
}
test_device!(one_buffer, one_plan_per_dictionary);

fn non_blocking_results_read_correctly(dev: Device) {
    let d = sample();
    let opts = copy_non_blocking();
    let there = d.to_with(dev, opts).unwrap();
    let back = there.to_with(Device::Cpu, opts).unwrap();
    // No wait() call: reading must wait by itself.
    assert_eq!(host_values(&back), host_values(&d));
    back.wait().unwrap();
    assert!(back.is_ready());
}
test_device!(non_blocking, non_blocking_results_read_correctly);

/// Held by the tests that use a device's pinned pool (pinned results, staging rings), so
/// that the one counting the pool's misses sees no other test's.
static POOL: Mutex<()> = Mutex::new(());

fn pool_lock() -> std::sync::MutexGuard<'static, ()> {
    POOL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The pinned pool of `dev`'s backend.
fn pinned_pool(dev: Device) -> Arc<tensorferry::internal::memory::PinnedPool> {
    tensorferry::internal::backend::backend_for(dev)
        .unwrap()
        .pinned_pool()
        .unwrap()
}

/// Buffers the pool has handed out so far, cached or newly pinned.
fn pool_takes(pool: &tensorferry::internal::memory::PinnedPool) -> u64 {
    let s = pool.stats();
    s.hits + s.misses
}

fn many_tensors(count: usize) -> Node {
    let mut d = TensorDict::new();
    for i in 0..count {
        let n = 1 + (i * 37) % 300;
        let data: Vec<f32> = (0..n * 2).map(|x| (x + i) as f32).collect();
        let t = Tensor::from_slice(&data, &[n, 2]).unwrap();
        // Every third tensor strided: several runs per tensor.
        let t = if i % 3 == 0 {
            t.transpose(0, 1).unwrap()
        } else {
            t
        };
        d.insert(format!("t{i}"), t);
    }
    d.into()
}

fn many_tensors_keep_their_values_both_ways(dev: Device) {
    let d = many_tensors(500);
    let opts = copy_non_blocking();
    let there = d.to_with(dev, opts).unwrap();
    let back = there.to_with(Device::Cpu, opts).unwrap();
    assert_eq!(host_values(&back), host_values(&d));
}
test_device!(many_tensors_move, many_tensors_keep_their_values_both_ways);

fn asking_too_much_is_out_of_memory_with_the_numbers(dev: Device) {
    if dev.is_host() {
        return; // host memory has no device backend
    }
    let backend = tensorferry::internal::backend::backend_for(dev).unwrap();
    let asked = 1usize << 50;
    match backend.alloc(asked) {
        Err(
            e @ Error::OutOfMemory {
                requested, total, ..
            },
        ) => {
            assert_eq!(requested, asked);
            assert!(total > 0 && total < asked);
            // On a GPU the message says what the driver's free count leaves out.
            let says_why = e.to_string().contains("torch.cuda.empty_cache()");
            assert_eq!(says_why, matches!(dev, Device::Cuda(_)), "{e}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Nothing was lost: an ordinary move still works.
    let back = sample()
        .to(dev, false)
        .unwrap()
        .to(Device::Cpu, false)
        .unwrap();
    assert_eq!(host_values(&back), host_values(&sample()));
}
test_device!(
    out_of_memory,
    asking_too_much_is_out_of_memory_with_the_numbers
);

fn a_repeated_pinned_transfer_pins_nothing_new(dev: Device) {
    let _pool = pool_lock();
    if dev.is_host() {
        return; // pinned results come from a device's pool
    }
    let pool = pinned_pool(dev);
    let opts = MoveOptions {
        pinned: true,
        ..Default::default()
    };
    let there = many_tensors(64).to(dev, false).unwrap();
    drop(there.to_with(Device::Cpu, opts).unwrap());
    let before = pool.stats();
    let again = there.to_with(Device::Cpu, opts).unwrap();
    assert_eq!(host_values(&again), host_values(&many_tensors(64)));
    let after = pool.stats();
    assert_eq!(after.misses, before.misses, "nothing new pinned");
    assert_eq!(after.pinned_bytes, before.pinned_bytes);
    assert!(after.hits > before.hits);
}
test_device!(
    pinned_pool_reuse,
    a_repeated_pinned_transfer_pins_nothing_new
);

fn a_mixed_dictionary_comes_home_whole(dev: Device) {
    let mut d = sample_dict();
    let on_device = many_tensors(5).to(dev, false).unwrap();
    let on_emu = many_tensors(3).to(Device::Emulated(0), false).unwrap();
    d.insert("dev", on_device);
    d.insert("emu", on_emu);
    let home = Node::from(d).to(Device::Cpu, false).unwrap();
    assert_eq!(home.device(), Some(Device::Cpu));
    let mut expected = sample_dict();
    expected.insert("dev", many_tensors(5));
    expected.insert("emu", many_tensors(3));
    assert_eq!(host_values(&home), host_values(&Node::from(expected)));
}
test_device!(mixed_devices, a_mixed_dictionary_comes_home_whole);

/// A ring small enough that a test dictionary spans many chunks and reuses every buffer.
const SMALL_RING: Staging = Staging::Ring {
    chunk_bytes: 4096,
    depth: 2,
};

fn staged(non_blocking: bool) -> MoveOptions {
    MoveOptions {
        copy: true,
        non_blocking,
        staging: SMALL_RING,
        ..Default::default()
    }
}

fn the_staging_ring_keeps_every_value_both_ways(dev: Device) {
    let _pool = pool_lock();
    let d = many_tensors(300);
    let there = d.to_with(dev, staged(false)).unwrap();
    let back = there.to_with(Device::Cpu, staged(false)).unwrap();
    assert_eq!(host_values(&back), host_values(&d));
}
test_device!(staging_ring, the_staging_ring_keeps_every_value_both_ways);

fn chained_non_blocking_transfers_wait_for_each_other(dev: Device) {
    let _pool = pool_lock();
    // Each transfer depends on the one before; none may block a stream the previous one
    // still needs (staged and direct, in both orders).
    let d = many_tensors(200);
    let direct = copy_non_blocking();
    let a = d.to_with(dev, staged(true)).unwrap();
    let b = a.to_with(Device::Cpu, direct).unwrap();
    let c = b.to_with(dev, direct).unwrap();
    let e = c.to_with(Device::Cpu, staged(true)).unwrap();
    assert_eq!(host_values(&e), host_values(&d));
}
test_device!(
    chained_non_blocking,
    chained_non_blocking_transfers_wait_for_each_other
);

fn staged_sources_dropped_at_once_are_still_copied(dev: Device) {
    let _pool = pool_lock();
    let there = many_tensors(100).to_with(dev, staged(true)).unwrap();
    let back = there.to_with(Device::Cpu, staged(true)).unwrap();
    drop(there);
    assert_eq!(host_values(&back), host_values(&many_tensors(100)));
}
test_device!(
    staged_sources_dropped,
    staged_sources_dropped_at_once_are_still_copied
);

fn large_staged_transfers_keep_every_value(dev: Device) {
    let _pool = pool_lock();
    // Chunks of 16 MiB: large enough that several host threads share each chunk's copy.
    let mut d = TensorDict::new();
    for i in 0..5 {
        let data: Vec<u32> = (0..2_000_000u32).map(|x| x ^ (i << 24)).collect();
        d.insert(
            format!("big{i}"),
            Tensor::from_slice(&data, &[2000, 1000]).unwrap(),
        );
    }
    d.insert("strided", many_tensors(3));
    let options = MoveOptions {
        staging: Staging::Ring {
            chunk_bytes: 16 << 20,
            depth: 2,
        },
        ..Default::default()
    };
    let d = Node::from(d);
    let there = d.to_with(dev, options).unwrap();
    let back = there.to_with(Device::Cpu, options).unwrap();
    assert_eq!(host_values(&back), host_values(&d));
}
test_device!(large_staged, large_staged_transfers_keep_every_value);

fn transposed_tensors_keep_their_values_both_ways(dev: Device) {
    let data: Vec<f32> = (0..300 * 200).map(|x| x as f32).collect();
    let m = Tensor::from_slice(&data, &[300, 200]).unwrap();
    let mut d = TensorDict::new();
    d.insert("t", m.transpose(0, 1).unwrap()); // 60,000 runs of 4 bytes
    d.insert("every_other_row", m.step(0, 2).unwrap()); // 150 runs of 800 bytes
    let d = Node::from(d);
    let expected = host_values(&d);
    let there = d.to(dev, false).unwrap();
    assert_eq!(host_values(&there), expected);
    // A strided view of device memory back to the host.
    let mut on_dev = TensorDict::new();
    let whole = m.to(dev, false).unwrap();
    on_dev.insert("t", whole.transpose(0, 1).unwrap());
    on_dev.insert("every_other_row", whole.step(0, 2).unwrap());
    let back = Node::from(on_dev).to(Device::Cpu, false).unwrap();
    assert_eq!(host_values(&back), expected);
}
test_device!(transposed, transposed_tensors_keep_their_values_both_ways);

fn a_device_dictionary_saves_and_loads(dev: Device) {
    let _pool = pool_lock(); // the streamed save takes its ring from the pool
    let d = sample();
    let opts = copy_non_blocking();
    let there = d.to_with(dev, opts).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    tensorferry::save(&there, &path, &Default::default()).unwrap();
    let back = tensorferry::load(&path, Default::default()).unwrap().root;
    assert_eq!(host_values(&back), host_values(&d));
    assert!(matches!(back.get_path(&["tag"]), Some(Node::Value(_))));
}
test_device!(save_from_device, a_device_dictionary_saves_and_loads);

#[test]
fn a_transposed_matrix_is_not_one_device_copy_per_element() {
    with_emu1("", || {
        let emu = emulated::device(1).unwrap();
        let data: Vec<f32> = (0..300 * 200).map(|x| x as f32).collect();
        let m = Tensor::from_slice(&data, &[300, 200]).unwrap();
        let before = emu.ops();
        let there = m.transpose(0, 1).unwrap().to(EMU1_DEV, false).unwrap();
        assert_eq!(emu.ops() - before, 1, "packed on the host first");
        let before = emu.ops();
        let back = m
            .to(EMU1_DEV, false)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .to(Device::Cpu, false)
            .unwrap();
        assert_eq!(
            emu.ops() - before,
            2,
            "one copy there, one of the span back"
        );
        assert_eq!(
            back.to_vec::<f32>().unwrap(),
            there
                .to(Device::Cpu, false)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        );
    });
}

#[test]
fn a_failing_chunk_fails_the_staged_transfer_and_frees_everything() {
    with_emu1("fail_copy=3", || {
        let pool = pinned_pool(EMU1_DEV);
        let before_used = used();
        let d = many_tensors(100);
        let err = d.to_with(EMU1_DEV, staged(false)).unwrap_err();
        assert!(err.to_string().contains("injected fault"), "{err}");
        assert_eq!(host_values(&d), host_values(&many_tensors(100)));
        // The ring's buffers are back in the pool and the device memory is released once
        // the chunks already queued have run.
        eventually(|| {
            used() == before_used && pool.stats().cached_bytes == pool.stats().pinned_bytes
        });
        assert_eq!(used(), before_used);
        let stats = pool.stats();
        assert_eq!(stats.cached_bytes, stats.pinned_bytes, "{stats:?}");
        // The next staged transfer works and pins nothing new.
        let misses = stats.misses;
        let there = d.to_with(EMU1_DEV, staged(false)).unwrap();
        let back = there.to_with(Device::Cpu, staged(false)).unwrap();
        assert_eq!(host_values(&back), host_values(&d));
        assert_eq!(pool.stats().misses, misses);
    });
}

#[test]
fn a_dictionary_moves_between_two_gpus() {
    if cuda_missing() {
        return;
    }
    if let Err(e) = Device::Cuda(1).ensure_available() {
        eprintln!("skipped: {e}");
        return;
    }
    let d = many_tensors(50);
    let on0 = d.to(Device::Cuda(0), false).unwrap();
    let on1 = on0.to(Device::Cuda(1), false).unwrap();
    assert_eq!(on1.device(), Some(Device::Cuda(1)));
    let back = on1.to(Device::Cpu, false).unwrap();
    assert_eq!(host_values(&back), host_values(&d));
}

#[test]
fn cuda_batches_use_the_batched_copy_where_the_driver_has_it() {
    use tensorferry::internal::backend::cuda::{status, CudaStatus};
    use tensorferry::internal::backend::cuda_device::{
        CopyPath, BATCHED_COPY_DRIVER, COPY_PATH_VAR,
    };
    if cuda_missing() || std::env::var(COPY_PATH_VAR).is_ok_and(|v| v != "auto") {
        return;
    }
    let CudaStatus::Available { driver_version, .. } = status() else {
        unreachable!("cuda is available")
    };
    let dev = tensorferry::internal::backend::cuda_device::device(0).unwrap();
    let expected = if *driver_version >= BATCHED_COPY_DRIVER {
        CopyPath::Batched
    } else {
        CopyPath::PerCopy
    };
    assert_eq!(dev.copy_path(), expected, "driver {driver_version}");
    // A many-tensor batch keeps the path (no fallback happened).
    many_tensors_keep_their_values_both_ways(Device::Cuda(0));
    assert_eq!(dev.copy_path(), expected);
}

// Fault injection and timing on emu:1, one test at a time (its settings are global).
static EMU1: Mutex<()> = Mutex::new(());

fn with_emu1(config: &str, f: impl FnOnce()) {
    let _guard = EMU1.lock().unwrap_or_else(|p| p.into_inner());
    emulated::configure(1, EmuConfig::parse(config).unwrap()).unwrap();
    f();
    emulated::configure(1, EmuConfig::default()).unwrap();
}

const EMU1_DEV: Device = Device::Emulated(1);

fn used() -> usize {
    emulated::device(1).unwrap().used()
}

#[test]
fn a_failing_allocation_is_out_of_memory_and_leaves_the_source_intact() {
    with_emu1("fail_alloc=1", || {
        let d = sample();
        let before = host_values(&d);
        let err = d.to(EMU1_DEV, false).unwrap_err();
        assert!(
            matches!(err, Error::OutOfMemory { requested, .. } if requested > 0),
            "{err}"
        );
        assert_eq!(host_values(&d), before);
        assert_eq!(used(), 0);
    });
}

#[test]
fn exceeding_capacity_reports_bytes_asked_free_and_total() {
    with_emu1("capacity_bytes=100", || {
        let err = sample().to(EMU1_DEV, false).unwrap_err().to_string();
        assert!(err.contains("emu:1") && err.contains("100"), "{err}");
    });
}

#[test]
fn a_failing_copy_mid_transfer_returns_the_error_and_frees_everything() {
    with_emu1("fail_copy=2", || {
        let d = sample();
        let mut first = TensorDict::new();
        first.insert("x", Tensor::from_slice(&[1.0f32], &[1]).unwrap());
        let kept = Node::from(first).to(EMU1_DEV, false).unwrap(); // copy 1 succeeds
        let err = d.to(EMU1_DEV, false).unwrap_err(); // copy 2 fails
        assert!(err.to_string().contains("injected fault"), "{err}");
        assert_eq!(used(), kept.nbytes().next_multiple_of(64));
        assert_eq!(host_values(&d), host_values(&sample()));
    });
}

#[test]
fn non_blocking_returns_before_the_copy_and_reads_wait_for_it() {
    with_emu1("latency_us=300000", || {
        let d = sample();
        let opts = non_blocking();
        let there = d.to_with(EMU1_DEV, opts).unwrap();
        assert!(
            !there.is_ready(),
            "a 300 ms copy cannot have finished already"
        );
        let back = there.to(Device::Cpu, false).unwrap();
        assert_eq!(host_values(&back), host_values(&d));
        assert!(there.is_ready());
    });
}

#[test]
fn sources_dropped_at_once_stay_alive_until_copied() {
    with_emu1("latency_us=100000", || {
        let src = Tensor::from_slice(&[5u32, 6, 7], &[3]).unwrap();
        let opts = non_blocking();
        let moved = tensorferry::move_tensors(&[&src], EMU1_DEV, opts).unwrap();
        drop(src);
        let back = moved[0].to(Device::Cpu, false).unwrap();
        assert_eq!(back.to_vec::<u32>().unwrap(), vec![5, 6, 7]);
    });
}

#[test]
fn results_dropped_before_their_copy_runs_are_freed_safely() {
    with_emu1("latency_us=50000", || {
        let opts = non_blocking();
        drop(sample().to_with(EMU1_DEV, opts).unwrap());
        emulated::device(1).unwrap(); // the stream keeps running
        let again = sample().to(EMU1_DEV, false).unwrap();
        assert_eq!(host_values(&again), host_values(&sample()));
    });
}

#[test]
fn a_whole_dictionary_is_one_batch_each_way() {
    with_emu1("", || {
        let d = sample();
        let there = d.to(EMU1_DEV, false).unwrap();
        assert_eq!(emulated::device(1).unwrap().batches(), 1);
        there.to(Device::Cpu, false).unwrap();
        assert_eq!(emulated::device(1).unwrap().batches(), 2);
    });
}

#[test]
fn moving_between_emulated_devices_keeps_values() {
    let _guard = EMU1.lock().unwrap_or_else(|p| p.into_inner());
    let d = sample();
    let a = d.to(Device::Emulated(0), false).unwrap();
    let b = a.to(EMU1_DEV, false).unwrap();
    assert_eq!(b.device(), Some(EMU1_DEV));
    assert_eq!(host_values(&b), host_values(&d));
}

#[test]
fn cuda_without_a_driver_is_unavailable_with_the_reason() {
    if Device::Cuda(0).ensure_available().is_ok() {
        return;
    }
    let err = sample().to(Device::Cuda(0), false).unwrap_err();
    assert!(
        matches!(err, Error::DeviceUnavailable { ref reason, .. } if !reason.is_empty()),
        "{err}"
    );
}

// ------------------------------------------------------------------ failures and waits

/// A 12×8 host matrix, every value distinct and non-zero (a read of zeros is wrong).
fn matrix() -> Tensor {
    let data: Vec<f32> = (0..96).map(|x| x as f32 + 1.0).collect();
    Tensor::from_slice(&data, &[12, 8]).unwrap()
}

/// The result of a non-blocking move from emu:1 to the host whose copy failed: call
/// inside `with_emu1("fail_copy=2")` (copy 1 fills emu:1, copy 2 fails).
fn failed_host_result() -> Tensor {
    let there = matrix().to(EMU1_DEV, false).unwrap();
    let opts = copy_non_blocking();
    let back = tensorferry::move_tensors(&[&there], Device::Cpu, opts).unwrap();
    back.into_iter().next().unwrap()
}

/// Checks that `result` is the injected failure of emu:1: a failed copy (not an unavailable
/// device), named as emu:1's (not as the host the result was meant for).
#[track_caller]
fn assert_emu1_failure<T: std::fmt::Debug>(what: &str, result: tensorferry::Result<T>) {
    let err = result.expect_err(what);
    assert!(
        matches!(&err, Error::Copy { device, reason } if device == "emu:1" && reason.contains("injected fault")),
        "{what}: {err:?}"
    );
    assert!(
        err.to_string()
            .starts_with("a copy on emu:1 failed: injected fault"),
        "{what}: {err}"
    );
}

/// Every way of reading `t` fails with emu:1's injected fault (never gives zeros).
#[track_caller]
fn assert_every_host_read_fails(what: &str, t: &Tensor) {
    assert_emu1_failure(&format!("{what}: wait"), t.wait());
    assert_emu1_failure(
        &format!("{what}: wait_timeout"),
        t.wait_timeout(Duration::from_secs(30)),
    );
    assert!(t.is_ready(), "{what}: a failed copy is finished");
    assert_emu1_failure(&format!("{what}: to_vec"), t.to_vec::<f32>());
    assert_emu1_failure(&format!("{what}: deep_copy"), t.deep_copy());
    assert_emu1_failure(&format!("{what}: for_each_run"), t.for_each_run(|_| Ok(())));
    if t.is_contiguous() {
        assert_emu1_failure(
            &format!("{what}: try_contiguous_bytes"),
            t.try_contiguous_bytes(),
        );
        assert!(t.contiguous_bytes().is_none(), "{what}: no bytes");
    } else {
        assert_emu1_failure(&format!("{what}: to_contiguous"), t.to_contiguous());
    }
    assert_emu1_failure(
        &format!("{what}: pack"),
        tensorferry::internal::consolidate::pack(&[t]),
    );
    let mut d = TensorDict::new();
    d.insert("x", t.clone());
    let d = Node::from(d);
    assert_emu1_failure(
        &format!("{what}: consolidate"),
        tensorferry::consolidate(&d),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("failed.safetensors");
    assert_emu1_failure(
        &format!("{what}: save"),
        tensorferry::save(&d, &path, &Default::default()),
    );
    assert!(!path.exists(), "{what}: nothing saved");
}

/// `t` moved to `dev` (copied): blocking, non-blocking, and staged, every one fails.
#[track_caller]
fn assert_every_move_fails(what: &str, t: &Tensor, dev: Device) {
    assert_emu1_failure(&format!("{what}: to {dev}"), t.to(dev, true));
    let moved = tensorferry::move_tensors(&[t], dev, copy_non_blocking());
    // Known to have failed already: the move may say so at once, or its result when read.
    if let Ok(moved) = moved {
        assert_emu1_failure(&format!("{what}: non-blocking to {dev}"), moved[0].wait());
        assert_emu1_failure(
            &format!("{what}: read after a non-blocking move to {dev}"),
            moved[0]
                .to(Device::Cpu, false)
                .and_then(|h| h.to_vec::<f32>()),
        );
        let again = moved[0].to(Device::Emulated(0), true);
        assert_emu1_failure(&format!("{what}: a move of that result"), again);
    }
    let mut d = TensorDict::new();
    d.insert("x", t.clone());
    d.insert("ok", matrix());
    let d = Node::from(d);
    assert_emu1_failure(
        &format!("{what}: staged to {dev}"),
        d.to_with(dev, staged(false)),
    );
}

fn every_read_of_a_failed_non_blocking_result_fails(dev: Device) {
    let _pool = pool_lock();
    with_emu1("fail_copy=2", || {
        let failed = failed_host_result();
        let views = [
            ("the result", failed.clone()),
            ("its transpose", failed.transpose(0, 1).unwrap()),
            ("every other row", failed.step(0, 2).unwrap()),
        ];
        for (what, t) in &views {
            assert_every_host_read_fails(what, t);
            assert_every_move_fails(what, t, dev);
        }
    });
}
test_device!(
    failed_result_reads,
    every_read_of_a_failed_non_blocking_result_fails
);

fn a_device_result_whose_copy_failed_fails_every_move(dev: Device) {
    let _pool = pool_lock();
    with_emu1("fail_copy=1", || {
        let there = tensorferry::move_tensors(&[&matrix()], EMU1_DEV, copy_non_blocking())
            .unwrap()
            .remove(0);
        assert_emu1_failure("wait", there.wait());
        for (what, t) in [
            ("the result", there.clone()),
            // Fragmented: its device span is fetched and gathered on the host.
            ("its transpose", there.transpose(0, 1).unwrap()),
        ] {
            assert_every_move_fails(what, &t, dev);
            assert_every_move_fails(what, &t, Device::Cpu);
        }
    });
}
test_device!(
    failed_device_result_moves,
    a_device_result_whose_copy_failed_fails_every_move
);

#[test]
fn a_failed_copy_names_the_device_that_failed_in_every_direction() {
    let _pool = pool_lock();
    let d = sample();
    // Host → emu:1.
    with_emu1("fail_copy=1", || {
        assert_emu1_failure("host to emu:1", d.to(EMU1_DEV, false));
    });
    // emu:1 → host, blocking, non-blocking and staged.
    with_emu1("fail_copy=2", || {
        let there = d.to(EMU1_DEV, false).unwrap();
        assert_emu1_failure("emu:1 to host", there.to(Device::Cpu, true));
    });
    with_emu1("fail_copy=2", || {
        let there = d.to(EMU1_DEV, false).unwrap();
        let back = there.to_with(Device::Cpu, copy_non_blocking()).unwrap();
        assert_emu1_failure("emu:1 to host, non-blocking", back.wait());
    });
    with_emu1("fail_copy=2", || {
        let there = d.to(EMU1_DEV, false).unwrap();
        assert_emu1_failure(
            "emu:1 to host, staged",
            there.to_with(Device::Cpu, staged(false)),
        );
    });
    // emu:0 → emu:1 (the copy runs on emu:1), and on from a failed emu:1 result to emu:0.
    with_emu1("fail_copy=1", || {
        let on0 = d.to(Device::Emulated(0), false).unwrap();
        assert_emu1_failure("emu:0 to emu:1", on0.to(EMU1_DEV, true));
    });
    with_emu1("fail_copy=1", || {
        let failed = d.to_with(EMU1_DEV, copy_non_blocking()).unwrap();
        assert_emu1_failure("emu:1 to emu:0", failed.to(Device::Emulated(0), true));
    });
}

#[test]
fn a_panicking_copy_fails_its_waiters_and_the_device_keeps_working() {
    let _pool = pool_lock();
    let d = many_tensors(20);
    let internal = |what: &str, r: tensorferry::Result<Node>| {
        let err = r.expect_err(what).to_string();
        assert!(
            err.contains("emu:1") && err.contains("internal error: injected panic"),
            "{what}: {err}"
        );
    };
    with_emu1("panic_copy=1", || {
        internal("blocking", d.to(EMU1_DEV, false));
        let there = d.to(EMU1_DEV, false).unwrap();
        assert_eq!(host_values(&there), host_values(&d));
    });
    with_emu1("panic_copy=2", || {
        let there = d.to(EMU1_DEV, false).unwrap();
        let back = there.to_with(Device::Cpu, copy_non_blocking()).unwrap();
        internal("non-blocking", back.wait().map(|()| back.clone()));
        assert_eq!(host_values(&there), host_values(&d));
    });
    with_emu1("panic_copy=2", || {
        // A staged transfer whose second chunk panics.
        internal("staged", d.to_with(EMU1_DEV, staged(false)));
        let there = d.to_with(EMU1_DEV, staged(false)).unwrap();
        assert_eq!(host_values(&there), host_values(&d));
    });
}

#[test]
fn a_bandwidth_too_small_for_any_copy_is_refused_naming_the_key() {
    let _guard = EMU1.lock().unwrap_or_else(|p| p.into_inner());
    let err = EmuConfig::parse("bandwidth_gbps=1e-300").unwrap_err();
    assert!(err.to_string().contains("bandwidth_gbps=1e-300"), "{err}");
    let tiny = EmuConfig {
        bandwidth_gbps: Some(1e-300),
        ..EmuConfig::default()
    };
    let err = emulated::configure(1, tiny).unwrap_err();
    assert!(err.to_string().contains("bandwidth_gbps"), "{err}");
    // Refused, so the device keeps its settings and works.
    let there = sample().to(EMU1_DEV, false).unwrap();
    assert_eq!(host_values(&there), host_values(&sample()));
}

/// Waits for every result of `d` in slices of `slice`; how many slices timed out.
fn wait_in_slices(d: &Node, slice: Duration) -> tensorferry::Result<usize> {
    let mut timeouts = 0;
    for (_, t) in d.tensors() {
        while !t.wait_timeout(slice)? {
            timeouts += 1;
        }
    }
    Ok(timeouts)
}

#[test]
fn a_non_blocking_move_can_be_waited_for_in_slices_and_abandoned() {
    let _pool = pool_lock();
    let d = many_tensors(5); // one chunk of the small ring
    for options in [copy_non_blocking(), staged(true)] {
        with_emu1("latency_us=100000", || {
            let there = d.to_with(EMU1_DEV, options).unwrap();
            let timeouts = wait_in_slices(&there, Duration::from_millis(5)).unwrap();
            assert!(timeouts > 0, "a 100 ms copy outlasts a 5 ms slice");
            let back = there.to_with(Device::Cpu, options).unwrap();
            wait_in_slices(&back, Duration::from_millis(5)).unwrap();
            assert_eq!(host_values(&back), host_values(&d));
            // Interrupted: the results are dropped while their copies still run.
            let before = used();
            let abandoned = d.to_with(EMU1_DEV, options).unwrap();
            let t = abandoned.tensors()[0].1.clone();
            assert!(!t.wait_timeout(Duration::from_millis(1)).unwrap());
            drop((abandoned, t));
            eventually(|| used() == before);
            assert_eq!(used(), before, "released once the copy has run");
        });
        with_emu1("fail_copy=1,latency_us=20000", || {
            let there = d.to_with(EMU1_DEV, options).unwrap();
            assert_emu1_failure(
                "sliced wait",
                wait_in_slices(&there, Duration::from_millis(2)),
            );
        });
    }
}

#[test]
fn non_blocking_moves_of_sources_still_being_filled_return_at_once() {
    with_emu1("latency_us=300000", || {
        let data: Vec<f32> = (0..300 * 200).map(|x| x as f32).collect();
        let m = Tensor::from_slice(&data, &[300, 200]).unwrap();
        let expected = m.transpose(0, 1).unwrap().to_vec::<f32>().unwrap();
        let opts = copy_non_blocking();
        let move_one =
            |t: &Tensor, to: Device| tensorferry::move_tensors(&[t], to, opts).unwrap().remove(0);
        // Device → host of a fragmented view: its span is fetched, then gathered.
        let on_dev = move_one(&m, EMU1_DEV);
        let gathered = move_one(&on_dev.transpose(0, 1).unwrap(), Device::Cpu);
        assert!(!gathered.is_ready(), "the gather waits for the fetch");
        // Host → host of a pending result, and host → device of a fragmented view of it.
        let pending = move_one(&on_dev, Device::Cpu);
        let copied = move_one(&pending, Device::Cpu);
        assert!(!copied.is_ready(), "the host copy waits for its source");
        let packed = move_one(&pending.transpose(0, 1).unwrap(), Device::Emulated(0));
        assert!(!packed.is_ready(), "the host pack waits for its source");
        assert_eq!(gathered.to_vec::<f32>().unwrap(), expected);
        assert_eq!(copied.to_vec::<f32>().unwrap(), data);
        let back = packed.to(Device::Cpu, false).unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), expected);
    });
}

// ------------------------------------------------ CUDA copy faults, in a child process

/// Set in the child processes that run the fake driver's fault-injection tests.
const CHILD_VAR: &str = "TENSORFERRY_ENGINE_CHILD";
/// What a child test prints once it has run to the end.
const CHILD_RAN: &str = "child test ran to the end";

/// True inside a child started by [`run_in_child`].
fn in_child() -> bool {
    std::env::var(CHILD_VAR).as_deref() == Ok("1")
}

/// True when cuda:0 is the fake driver of `crates/fake-cuda` (whose faults can be
/// injected), after saying why not otherwise.
fn fake_cuda_present() -> bool {
    use tensorferry::internal::backend::cuda::{status, CudaStatus};
    if cuda_missing() {
        return false;
    }
    let fake = matches!(status(), CudaStatus::Available { gpus, .. }
        if gpus[0].starts_with("tensorferry fake CUDA device"));
    if !fake {
        eprintln!("skipped: needs the fake CUDA driver (faults are injected into it)");
    }
    fake
}

/// Runs the test `name` of this file alone in a child process with `env` set (the fake
/// driver reads its settings once per process), and checks that it ran to the end.
fn run_in_child(name: &str, env: &[(&str, &str)]) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains(CHILD_RAN),
        "child {name}:\n{text}"
    );
}

/// `n` contiguous tensors: one copy each, so copy calls can be counted.
fn contiguous_tensors(n: usize) -> Node {
    let mut d = TensorDict::new();
    for i in 0..n {
        let data: Vec<u32> = (0..1000).map(|x| x * 31 + i as u32 + 1).collect();
        d.insert(format!("c{i}"), Tensor::from_slice(&data, &[1000]).unwrap());
    }
    d.into()
}

#[test]
fn a_cuda_copy_failing_mid_batch_frees_nothing_a_queued_copy_still_uses() {
    if !fake_cuda_present() {
        return;
    }
    // One driver call per copy, each queued copy taking 20 ms: memory released before
    // they run is caught by the fake driver (a sticky illegal-address error).
    run_in_child(
        "child_cuda_copy_calls_3_and_14_fail",
        &[
            ("TENSORFERRY_CUDA_COPY", "per-copy"),
            ("TF_FAKE_CUDA_FAIL_COPY", "3,14"),
            ("TF_FAKE_CUDA_DELAY_US", "20000"),
        ],
    );
}

#[test]
fn child_cuda_copy_calls_3_and_14_fail() {
    if !in_child() {
        return;
    }
    let d = contiguous_tensors(8);
    let cuda = Device::Cuda(0);
    // Calls 1 and 2 are queued when call 3 fails.
    let err = d.to(cuda, false).unwrap_err().to_string();
    assert!(
        err.contains("a copy on cuda:0 failed")
            && err.contains("copy 3 of 8")
            && err.contains("CUDA_ERROR_UNKNOWN"),
        "{err}"
    );
    // Calls 4 to 11: the device still works (no queued copy met freed memory).
    let there = d.to(cuda, false).unwrap();
    // Calls 12 to 14, back to the host: the error names the GPU, not the host.
    let err = there.to(Device::Cpu, false).unwrap_err().to_string();
    assert!(
        err.contains("a copy on cuda:0 failed") && err.contains("copy 3 of 8"),
        "{err}"
    );
    let back = there.to(Device::Cpu, false).unwrap();
    assert_eq!(host_values(&back), host_values(&d));
    println!("{CHILD_RAN}");
}

#[test]
fn a_batched_cuda_copy_failing_part_way_is_queued_again_copy_by_copy() {
    if !fake_cuda_present() {
        return;
    }
    run_in_child(
        "child_cuda_copy_call_1_fails",
        &[("TF_FAKE_CUDA_FAIL_COPY", "1")],
    );
}

#[test]
fn child_cuda_copy_call_1_fails() {
    use tensorferry::internal::backend::cuda_device::CopyPath;
    if !in_child() {
        return;
    }
    let gpu = tensorferry::internal::backend::cuda_device::device(0).unwrap();
    let d = contiguous_tensors(8);
    if gpu.copy_path() == CopyPath::Batched {
        // Half the batch was queued when the call failed: it is queued again, one call
        // per copy, and the GPU stays on that path.
        let there = d.to(Device::Cuda(0), false).unwrap();
        assert_eq!(gpu.copy_path(), CopyPath::PerCopy);
        let reason = gpu.copy_fallback().unwrap();
        assert!(reason.contains("CUDA_ERROR_UNKNOWN"), "{reason}");
        let back = there.to(Device::Cpu, false).unwrap();
        assert_eq!(host_values(&back), host_values(&d));
    } else {
        let err = d.to(Device::Cuda(0), false).unwrap_err().to_string();
        assert!(
            err.contains("a copy on cuda:0 failed") && err.contains("copy 1 of 8"),
            "{err}"
        );
    }
    println!("{CHILD_RAN}");
}

#[path = "engine/save_streamed.rs"]
mod save_streamed;

/// Host memory page-locked by another library (PyTorch's `pin_memory()`, a registered
/// NumPy array) is copied to the GPU straight from where it lies, as the pool's own pinned
/// memory is: the staging ring, which only adds a host copy for such memory, is skipped.
#[test]
fn page_locked_memory_of_another_library_skips_the_staging_ring() {
    if cuda_missing() {
        return;
    }
    let _pool = pool_lock();
    let gpu = Device::Cuda(0);
    let pool = pinned_pool(gpu);
    let values: Vec<f32> = (0..50_000).map(|x| x as f32).collect();
    let source = Tensor::from_slice(&values, &[values.len()]).unwrap();
    let pinned = MoveOptions {
        pinned: true,
        ..Default::default()
    };
    // Pinned memory handed to tensorferry as foreign memory, as a framework's tensor is.
    let locked = tensorferry::move_tensors(&[&source.to(gpu, false).unwrap()], Device::Cpu, pinned)
        .unwrap()
        .pop()
        .unwrap();
    // SAFETY: `locked`'s bytes are host memory valid while it lives; the foreign memory
    // owns a clone of it, and nothing writes to it.
    let foreign = unsafe {
        Tensor::from_foreign(
            locked.data_ptr() as *mut u8,
            Device::Cpu,
            true,
            Box::new(locked.clone()),
            tensorferry::DType::F32,
            vec![values.len()],
            vec![1],
        )
    }
    .unwrap();
    let through_ring = MoveOptions {
        staging: SMALL_RING,
        ..Default::default()
    };
    for (tensor, page_locked) in [(&foreign, true), (&source, false)] {
        let before = pool_takes(&pool);
        let there = tensorferry::move_tensors(&[tensor], gpu, through_ring).unwrap();
        let back = there[0].to(Device::Cpu, false).unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), values);
        let ring_used = pool_takes(&pool) > before;
        assert_eq!(ring_used, !page_locked, "page-locked: {page_locked}");
    }
}

/// A small non-blocking move between a GPU and ordinary memory goes through the staging
/// ring (the driver's own copies with ordinary memory would hold the caller until the GPU
/// got to them); a blocking one, or one whose caller waits at once, stays direct.
#[test]
fn small_non_blocking_moves_never_wait_for_the_gpu_in_the_driver() {
    if cuda_missing() {
        return;
    }
    let _pool = pool_lock();
    let gpu = Device::Cuda(0);
    let pool = pinned_pool(gpu);
    let d = many_tensors(50);
    let there = d.to(gpu, false).unwrap();
    let ring_used = |from: &Node, to: Device, non_blocking: bool, waits_at_once: bool| {
        let before = pool_takes(&pool);
        let moved = from
            .to_with(
                to,
                MoveOptions {
                    non_blocking,
                    waits_at_once,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(host_values(&moved), host_values(&d));
        pool_takes(&pool) > before
    };
    for (from, to) in [(&there, Device::Cpu), (&d, gpu)] {
        assert!(ring_used(from, to, true, false), "non-blocking to {to}");
        assert!(!ring_used(from, to, false, false), "blocking to {to}");
        assert!(!ring_used(from, to, true, true), "waited at once to {to}");
    }
}
