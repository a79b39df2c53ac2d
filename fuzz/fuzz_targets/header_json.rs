//! The header codec against `serde_json`, on any file: what the codec reads is a JSON
//! object to `serde_json` too, with the same tensor names and metadata; a header that is
//! not a JSON object to `serde_json` is refused. Never a panic.
//! Run: cargo +nightly fuzz run header_json fuzz/corpus/read_safetensors
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(len) = data.get(..8).map(|p| u64::from_le_bytes(p.try_into().unwrap())) else {
        return;
    };
    let Some(header) = usize::try_from(len).ok().and_then(|n| data.get(8..8usize.checked_add(n)?)) else {
        return;
    };
    let data_len = (data.len() - 8 - header.len()) as u64;
    let mine = tensorferry::internal::io::parse_header(header, data_len);
    let oracle = std::str::from_utf8(header)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(text).ok())
        .and_then(|v| v.as_object().cloned());
    let Some(object) = oracle else {
        assert!(mine.is_err(), "read a header that is no JSON object");
        return;
    };
    let Ok(mine) = mine else {
        return;
    };
    let mut names: Vec<&str> = mine.tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    let mut keys: Vec<&str> = object.keys().map(String::as_str).filter(|k| *k != "__metadata__").collect();
    keys.sort_unstable();
    assert_eq!(names, keys);
    let metadata: BTreeMap<String, String> = object
        .get("__metadata__")
        .and_then(|m| m.as_object())
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string())).collect())
        .unwrap_or_default();
    assert_eq!(mine.metadata, metadata);
});
