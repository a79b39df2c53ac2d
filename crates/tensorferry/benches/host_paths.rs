//! Criterion benchmarks of the host paths: packing a dictionary into one buffer, and
//! saving and loading it, on a many-small-tensors dictionary and a few-large one.
//! Run: cargo bench -p tensorferry --bench host_paths

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tensorferry::{
    consolidate, load, save, DType, LoadOptions, Node, SaveOptions, Tensor, TensorDict,
};

fn dict(count: usize, elems: usize) -> Node {
    let mut d = TensorDict::new();
    for i in 0..count {
        let bytes: Vec<u8> = (0..elems * 4).map(|j| (i + j) as u8 | 1).collect();
        d.insert(
            format!("layer.{i}.weight"),
            Tensor::from_bytes(DType::F32, vec![elems], &bytes).unwrap(),
        );
    }
    d.into()
}

fn host_paths(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    for (name, d) in [
        ("2000x4KiB", dict(2000, 1024)),
        ("8x4MiB", dict(8, 1 << 20)),
    ] {
        let mut g = c.benchmark_group(name);
        g.throughput(Throughput::Bytes(d.nbytes() as u64));
        g.sample_size(20);
        g.bench_function(BenchmarkId::new("consolidate", name), |b| {
            b.iter(|| consolidate(&d).unwrap())
        });
        let path = dir.path().join(format!("{name}.safetensors"));
        let opts = SaveOptions {
            fsync: false,
            ..Default::default()
        };
        g.bench_function(BenchmarkId::new("save", name), |b| {
            b.iter(|| save(&d, &path, &opts).unwrap())
        });
        for mmap in [true, false] {
            g.bench_function(
                BenchmarkId::new(if mmap { "load_mmap" } else { "load_read" }, name),
                |b| {
                    b.iter(|| {
                        load(
                            &path,
                            LoadOptions {
                                // SAFETY: this test's files live in its own temporary folder; nothing truncates or
                                // rewrites them while their tensors are alive.
                                mmap: if mmap {
                                    unsafe { tensorferry::Mapping::map() }
                                } else {
                                    tensorferry::Mapping::READ
                                },
                                ..Default::default()
                            },
                        )
                        .unwrap()
                    })
                },
            );
        }
        g.finish();
    }
}

criterion_group!(benches, host_paths);
criterion_main!(benches);
