//! A sharded checkpoint's index (`*.safetensors.index.json`) of any content, in a folder
//! holding two valid shards `a.safetensors` (tensors "x", "y") and `b.safetensors` ("z"):
//! a tree or an error, never a panic, never a recursion (an index naming itself or
//! another index), never a path outside the folder; a loaded tree holds what the index
//! names, each once.
//! Run: cargo +nightly fuzz run sharded_index
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorferry::{save, LoadOptions, SaveOptions, Tensor, TensorDict};

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    for (file, names) in [("a.safetensors", &["x", "y"][..]), ("b.safetensors", &["z"])] {
        let mut d = TensorDict::new();
        for name in names {
            d.insert(*name, Tensor::from_slice(&[1.0f32, 2.0], &[2]).unwrap());
        }
        save(&d.into(), dir.path().join(file), &SaveOptions { fsync: false, ..Default::default() }).unwrap();
    }
    let index = dir.path().join("m.safetensors.index.json");
    std::fs::write(&index, data).unwrap();
    if let Ok(loaded) = tensorferry::load(&index, LoadOptions::default()) {
        let mut names: Vec<String> = loaded.root.tensors().iter().map(|(p, _)| p.dotted()).collect();
        names.sort();
        names.dedup();
        assert!(names.iter().all(|n| ["x", "y", "z"].contains(&n.as_str())), "{names:?}");
    }
});
