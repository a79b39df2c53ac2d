//! The engine's host work runs on one bounded pool of worker threads: however many staged
//! transfers run at once, from however many threads, the process does not grow a thread per
//! transfer. Its own test binary, so that the threads counted are this test's alone.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use tensorferry::internal::backend::emulated::{configure, EmuConfig};
use tensorferry::{move_tensors, Device, MoveOptions, Staging, Tensor};

/// Threads of this process now, as Linux lists them.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

/// Most worker threads the pool may hold (its cap: the cores, at most 16).
const POOL_CAP: usize = 16;
/// Callers, each with this many staged transfers in flight at once.
const CALLERS: usize = 64;
const IN_FLIGHT: usize = 3;

fn staged_non_blocking() -> MoveOptions {
    MoveOptions {
        non_blocking: true,
        staging: Staging::Ring {
            chunk_bytes: 64 << 10,
            depth: 2,
        },
        ..Default::default()
    }
}

#[test]
fn many_concurrent_staged_transfers_run_on_a_bounded_number_of_threads() {
    if !std::path::Path::new("/proc/self/task").exists() {
        eprintln!("skipped: no /proc/self/task to count threads");
        return;
    }
    let dev = Device::Emulated(0);
    // Slow copies, so that every caller's transfers are in flight together.
    let slow = EmuConfig {
        latency_us: 1000,
        ..EmuConfig::default()
    };
    configure(0, slow).unwrap();
    let data: Vec<u8> = (0..256 << 10).map(|i| (i % 251) as u8).collect();
    let source = Tensor::from_slice(&data, &[data.len()]).unwrap();
    // The device's own threads (stream, completer) and a first worker start here.
    let warm = move_tensors(&[&source], dev, staged_non_blocking()).unwrap();
    warm[0].wait().unwrap();
    let before = threads();

    let most = Arc::new(AtomicUsize::new(before));
    let running = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (most, running) = (most.clone(), running.clone());
        std::thread::spawn(move || {
            while running.load(Ordering::Relaxed) {
                most.fetch_max(threads(), Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
    };
    let start = Arc::new(Barrier::new(CALLERS));
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (start, source) = (start.clone(), source.clone());
            std::thread::spawn(move || {
                start.wait();
                let moved: Vec<Tensor> = (0..IN_FLIGHT)
                    .flat_map(|_| move_tensors(&[&source], dev, staged_non_blocking()).unwrap())
                    .collect();
                for t in &moved {
                    t.wait().unwrap();
                }
                moved
            })
        })
        .collect();
    let results: Vec<Tensor> = callers
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    running.store(false, Ordering::Relaxed);
    sampler.join().unwrap();
    configure(0, EmuConfig::default()).unwrap();

    let most = most.load(Ordering::Relaxed);
    // The callers and the sampler are this test's own; beyond them, only the pool's.
    let bound = before + CALLERS + 1 + POOL_CAP;
    eprintln!("threads: {before} before, at most {most} during, bound {bound}");
    assert!(
        most <= bound,
        "{most} threads for {} staged transfers at once (before: {before}, bound: {bound})",
        CALLERS * IN_FLIGHT
    );
    for t in results.iter().step_by(37) {
        let back = t.to(Device::Cpu, false).unwrap();
        assert_eq!(back.to_vec::<u8>().unwrap(), data);
    }
}
