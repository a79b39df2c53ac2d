//! Hostile and broken files: every one is a clear `Format` error, never a panic.

mod common;

use common::every_way;

use std::path::PathBuf;

use tensorferry::{load, Error, LoadOptions};

fn corpus() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 25, "the corpus is missing");
    files
}

#[test]
fn every_broken_file_is_a_format_error_every_way() {
    for path in corpus() {
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        for options in every_way() {
            let result = load(&path, options);
            if name.starts_with("valid_") {
                assert!(result.is_ok(), "{name} ({options:?}): {:?}", result.err());
            } else {
                match result {
                    Err(Error::Format { at, reason }) => {
                        assert!(!at.is_empty() && !reason.is_empty(), "{name}")
                    }
                    other => panic!("{name} ({options:?}) gave {other:?}"),
                }
            }
        }
    }
}

#[test]
fn errors_name_the_offset_or_the_tensor_at_fault() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let msg = |f: &str| {
        load(dir.join(f), LoadOptions::default())
            .unwrap_err()
            .to_string()
    };
    assert!(msg("header_past_end.safetensors").contains("byte 0"));
    assert!(msg("gap_between_tensors.safetensors").contains("gap of 2 bytes"));
    assert!(msg("trailing_bytes.safetensors").contains("7 trailing bytes"));
    assert!(msg("shape_times_dtype_mismatch.safetensors").contains("tensor \"a\""));
    assert!(msg("overlapping_offsets.safetensors").contains("\"b\""));
}

#[test]
fn a_missing_file_is_an_io_error_naming_it() {
    let err = load("/nonexistent/x.safetensors", LoadOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Io { .. }));
    assert!(err.to_string().contains("/nonexistent/x.safetensors"));
}

#[test]
fn format_errors_name_the_file_they_came_from() {
    for path in corpus() {
        if path
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .starts_with("valid_")
        {
            continue;
        }
        for result in [
            load(&path, every_way()[0]).map(drop),
            tensorferry::internal::io::read_header(&path).map(drop),
        ] {
            if let Err(err @ Error::Format { .. }) = result {
                assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");
            }
        }
    }
}
