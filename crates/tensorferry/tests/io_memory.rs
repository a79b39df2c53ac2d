//! Hostile headers never make the reader allocate more than a small multiple of the
//! file's size: a counting global allocator measures the peak of each load.
//!
//! Every test here takes one lock, so no other test's allocations are counted.

mod common;

use common::every_way;
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use tensorferry::internal::io::read_header;
use tensorferry::{load, save, DType, Node, SaveOptions, Tensor, Value};

/// The system allocator, counting the bytes in use and their peak.
struct Counting;

static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = IN_USE.fetch_add(by, Ordering::SeqCst) + by;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every method forwards to the system allocator unchanged; the counters only
// observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) };
        IN_USE.fetch_sub(layout.size(), Ordering::SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Counted as a fresh block before the old one is freed: a realloc that cannot grow
        // in place holds both for a moment.
        grew(new_size);
        // SAFETY: forwarded with the caller's guarantees.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            IN_USE.fetch_sub(new_size, Ordering::SeqCst);
        } else {
            IN_USE.fetch_sub(layout.size(), Ordering::SeqCst);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Bytes allocated at the peak of `f`, above what was in use when it started (what `f`
/// returns is dropped inside the measurement).
fn peak_of<R>(f: impl FnOnce() -> R) -> usize {
    let base = IN_USE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    drop(f());
    PEAK.load(Ordering::SeqCst) - base
}

/// Allowed: four times the file plus a small constant (the library's own limit, 4 MiB).
fn allowed(file_len: usize) -> usize {
    4 * file_len + (4 << 20)
}

/// Writes the file of `header` and `data_len` zero bytes; returns its length.
fn write_file(path: &Path, header: &str, data_len: usize) -> usize {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data_len, 0);
    std::fs::write(path, &bytes).unwrap();
    bytes.len()
}

/// A way of reading a file, named; true when it succeeded.
type ReadingWay<'a> = (&'static str, Box<dyn Fn() -> bool + 'a>);

/// Loads `path` every way (mapped, read, read with `O_DIRECT`) and reads its header; each peak must stay within [`allowed`].
/// Returns whether the loads succeeded.
fn assert_bounded(path: &Path, file_len: usize, what: &str) -> bool {
    let [mapped, read, direct] = every_way();
    let cases: [ReadingWay; 4] = [
        (
            "load with mmap",
            Box::new(move || load(path, mapped).is_ok()),
        ),
        (
            "load without mmap",
            Box::new(move || load(path, read).is_ok()),
        ),
        (
            "load with O_DIRECT",
            Box::new(move || load(path, direct).is_ok()),
        ),
        ("read_header", Box::new(|| read_header(path).is_ok())),
    ];
    let mut all_ok = true;
    for (how, f) in cases {
        let mut ok = false;
        let peak = peak_of(|| ok = f());
        all_ok &= ok;
        eprintln!(
            "{what}: {how}: ok={ok}, peak {peak} bytes for a file of {file_len} ({:.2}x)",
            peak as f64 / file_len as f64
        );
        assert!(
            peak <= allowed(file_len),
            "{what}: {how} (ok={ok}) peaked at {peak} bytes for a file of {file_len}"
        );
    }
    all_ok
}

/// A hostile file as made by `make(pad)` (a header and its data length, `pad` bytes of
/// data that a tensor covers), checked twice: as is, and padded with the least data that
/// makes it acceptable, where the load must succeed and still stay within the limit.
fn check_with_and_without_padding(what: &str, make: impl Fn(usize) -> (String, usize)) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hostile.safetensors");
    let write = |pad: usize| {
        let (header, data_len) = make(pad);
        write_file(&path, &header, data_len)
    };
    let len = write(0);
    assert_bounded(&path, len, what);

    // The least padding accepted: each byte of data adds one to what a load may take
    // and four to what it is allowed, so the refusal's numbers say how much is missing.
    let Err(refusal) = read_header(&path) else {
        return; // Accepted as it is: checked above.
    };
    let cost = cost_in(&refusal.to_string());
    let pad = (cost + 4096 - allowed(len).min(cost)).div_ceil(3);
    assert!(read_header(&path).is_err());
    write(pad.saturating_sub(8192));
    assert!(
        read_header(&path).is_err(),
        "{what}: accepted below the computed limit"
    );
    let len = write(pad);
    let ok = assert_bounded(&path, len, &format!("{what}, padded with {pad} bytes"));
    assert!(ok, "{what}: a file the budget accepts must load");
}

/// The cost a refusal's message names ("… could take N bytes …").
fn cost_in(message: &str) -> usize {
    let after = message
        .split("could take ")
        .nth(1)
        .unwrap_or_else(|| panic!("not a refusal for memory: {message}"));
    after.split(' ').next().unwrap().parse().unwrap()
}

/// A header entry of `pad` zero bytes from data offset `at`.
fn pad_entry(at: usize, pad: usize) -> String {
    format!(
        r#""pad":{{"dtype":"U8","shape":[{pad}],"data_offsets":[{at},{}]}}"#,
        at + pad
    )
}

/// One tensor of `n` dimensions of 1, written densely (`1,1,…`).
fn check_a_tensor_of_dimensions(n: usize, label: &str) {
    let dims = vec!["1"; n].join(",");
    check_with_and_without_padding(label, |pad| {
        let header = format!(
            r#"{{"a":{{"dtype":"U8","shape":[{dims}],"data_offsets":[0,1]}},{}}}"#,
            pad_entry(1, pad)
        );
        (header, 1 + pad)
    });
}

#[test]
fn a_tensor_of_a_million_dimensions_stays_within_four_times_the_file() {
    check_a_tensor_of_dimensions(1_000_000, "1,000,000 dims");
}

#[test]
fn two_million_dimensions_in_four_megabytes_stay_within_four_times_the_file() {
    check_a_tensor_of_dimensions(2_000_000, "2,000,000 dims");
}

#[test]
fn two_hundred_thousand_tiny_entries_stay_within_four_times_the_file() {
    let mut entries = String::new();
    for i in 0..200_000 {
        entries.push_str(&format!(
            r#""{i}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}},"#
        ));
    }
    check_with_and_without_padding("200,000 entries", |pad| {
        (format!("{{{entries}{}}}", pad_entry(0, pad)), pad)
    });
}

#[test]
fn many_metadata_pairs_stay_within_four_times_the_file() {
    let pairs: Vec<String> = (0..400_000).map(|i| format!(r#""{i}":"""#)).collect();
    let pairs = pairs.join(",");
    check_with_and_without_padding("400,000 metadata pairs", |pad| {
        let header = format!(r#"{{"__metadata__":{{{pairs}}},{}}}"#, pad_entry(0, pad));
        (header, pad)
    });
}

/// A header whose tree record holds `items` (JSON nodes) and the tensor "pad".
fn record_header(items: &str, pad: usize) -> String {
    let record = format!(r#"{{"format":1,"tree":{{"list":[{{"tensor":"pad"}},{items}]}}}}"#);
    format!(
        r#"{{"__metadata__":{{"tensorferry":{}}},{}}}"#,
        serde_json::to_string(&record).unwrap(),
        pad_entry(0, pad)
    )
}

#[test]
fn a_tree_record_of_many_values_stays_within_four_times_the_file() {
    let items = vec![r#"{"int":1}"#; 300_000].join(",");
    check_with_and_without_padding("300,000 values", |pad| (record_header(&items, pad), pad));
}

#[test]
fn a_tree_record_of_many_dicts_stays_within_four_times_the_file() {
    let items = vec![r#"{"dict":[["k",{"none":null}]]}"#; 100_000].join(",");
    check_with_and_without_padding("100,000 dicts", |pad| (record_header(&items, pad), pad));
}

#[test]
fn a_long_escaped_string_stays_within_four_times_the_file() {
    // Escaped twice (in the record, then in the header): the parser's scratch space.
    let long = serde_json::to_string(&"\"\\".repeat(500_000)).unwrap();
    let items = format!(r#"{{"str":{long}}}"#);
    check_with_and_without_padding("a long escaped string", |pad| {
        (record_header(&items, pad), pad)
    });
}

#[test]
fn a_legitimate_file_of_many_tensors_loads() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("many.safetensors");
    let items: Vec<Node> = (0..20_000)
        .map(|_| Node::Tensor(Tensor::zeros(DType::F32, &[4, 4]).unwrap()))
        .chain([Node::Value(Value::Int(3))])
        .collect();
    save(&Node::List(items), &path, &SaveOptions::default()).unwrap();
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    assert!(assert_bounded(&path, len, "20,000 tensors"));
}
