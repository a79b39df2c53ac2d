//! The cost of a sharded save grows linearly with its shards, and a folder of unrelated
//! files costs one scan of it. Its own test binary, so that the CPU time counted is this
//! test's alone (not that of tests running beside it).

use tensorferry::internal::io::save_sharded;
use tensorferry::{Node, SaveOptions, Tensor, TensorDict};

/// User and system CPU seconds this process has used so far, all its threads.
fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `getrusage` fills the `rusage` it is given; RUSAGE_SELF is always valid.
    let usage = unsafe {
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()), 0);
        usage.assume_init()
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// CPU seconds (user and system, every thread of this process) of the cheapest of five
/// sharded saves of `tensors` one-tensor shards into a fresh folder holding `unrelated`
/// files of another program (left untouched).
fn sharded_save_seconds(tensors: usize, unrelated: usize) -> f64 {
    let mut d = TensorDict::new();
    for i in 0..tensors {
        d.insert(
            format!("t{i}"),
            Tensor::from_slice(&[i as f32], &[1]).unwrap(),
        );
    }
    let tree = Node::Dict(d);
    let options = SaveOptions {
        fsync: false,
        ..SaveOptions::default()
    };
    // CPU time, not wall time: a busy machine (other builds on two cores) stretches the
    // wall time of single runs by 10x and more, not the work the save does; the best of
    // five runs leaves out a page-cache writeback that lands in one of them.
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..unrelated {
            std::fs::write(dir.path().join(format!("photo-{i}.jpg")), b"").unwrap();
        }
        let started = cpu_seconds();
        let written =
            save_sharded(&tree, dir.path().join("model.safetensors"), &options, 1).unwrap();
        best = best.min(cpu_seconds() - started);
        assert!(written.len() > tensors, "{} files", written.len());
        let others = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("photo-")
            })
            .count();
        assert_eq!(others, unrelated, "a save touched files it did not write");
    }
    best
}

#[test]
fn a_sharded_save_costs_linear_time_in_its_shards_and_one_scan_of_its_folder() {
    // A scan of the folder per shard (quadratic) took 47 s for 16,000 shards. Four times
    // the shards may cost at most about four times as much (quadratic would be 16x), and
    // 10,000 unrelated files in the folder add one scan, not one per shard (12,000,000
    // directory entries read).
    let small = sharded_save_seconds(300, 0);
    let large = sharded_save_seconds(1200, 0);
    assert!(
        large < 8.0 * small.max(0.02),
        "1200 shards took {large:.3} CPU s, 300 took {small:.3}: not linear"
    );
    let crowded = sharded_save_seconds(1200, 10_000);
    assert!(
        crowded < 3.0 * large.max(0.05),
        "1200 shards took {crowded:.3} CPU s beside 10,000 unrelated files, {large:.3} alone"
    );
}
