//! Any bytes given to the safetensors reader give a tree or an error: never a panic, never
//! an allocation larger than the input; the header goes through the one header codec
//! (`io/format/header_reader.rs`). Run: cargo +nightly fuzz run read_safetensors
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(loaded) = tensorferry::internal::io::load_bytes(data) {
        // Whatever parsed must be readable end to end.
        for (_, t) in loaded.root.tensors() {
            let mut n = 0;
            t.for_each_run(|run| {
                n += run.len();
                Ok(())
            })
            .unwrap();
            assert_eq!(n, t.nbytes());
        }
    }
});
