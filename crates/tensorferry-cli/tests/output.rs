//! What the command does when its output cannot be written, and how it prints what a
//! hostile file holds: real runs of the built binary.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tensorferry"));
    // A backtrace would hide whether the command itself prints one line or a panic.
    cmd.env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE");
    cmd
}

/// A safetensors file written byte by byte (a hostile file need not come from a
/// well-behaved writer): one float32 scalar per name, and `metadata`.
fn write_safetensors(path: &Path, names: &[String], metadata: &[(&str, &str)]) {
    let mut header = serde_json::Map::new();
    for (i, name) in names.iter().enumerate() {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}),
        );
    }
    if !metadata.is_empty() {
        let meta: serde_json::Map<_, _> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
        header.insert("__metadata__".into(), meta.into());
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut f = File::create(path).unwrap();
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&json).unwrap();
    f.write_all(&vec![0u8; 4 * names.len()]).unwrap();
}

/// A file whose table is megabytes long: far more than a pipe holds.
fn many_tensors(dir: &Path) -> PathBuf {
    let path = dir.join("many.safetensors");
    let names: Vec<String> = (0..20_000)
        .map(|i| format!("model.layers.{i}.self_attention.query_key_value.weight"))
        .collect();
    write_safetensors(&path, &names, &[]);
    path
}

/// Runs `tensorferry args…` with its output to `/dev/full`.
fn into_full_disk(args: &[&str]) -> Output {
    let full = File::options().write(true).open("/dev/full").unwrap();
    bin().args(args).stdout(full).output().unwrap()
}

/// Reads one line of the command's output, closes the pipe, and returns how it ended.
fn close_pipe_after_first_line(args: &[&str]) -> Output {
    let mut child = bin()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    assert!(!first.is_empty(), "no output at all");
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the command hangs on a closed pipe"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_reader_that_stops_early_ends_the_table_quietly_with_status_0() {
    let dir = tempfile::tempdir().unwrap();
    let file = many_tensors(dir.path());
    let out = close_pipe_after_first_line(&["inspect", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(stderr_of(&out), "");
}

#[test]
fn a_reader_that_stops_early_ends_the_json_quietly_with_status_0() {
    let dir = tempfile::tempdir().unwrap();
    let file = many_tensors(dir.path());
    let out = close_pipe_after_first_line(&["inspect", "--json", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(stderr_of(&out), "");
}

/// One line on stderr naming the cause, and status 1.
fn assert_one_line_about_a_full_disk(out: &Output) {
    let err = stderr_of(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("tensorferry: ") && err.contains("No space left on device"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn info_into_a_full_disk_is_one_line_on_stderr_and_status_1() {
    assert_one_line_about_a_full_disk(&into_full_disk(&["info"]));
}

#[test]
fn inspect_into_a_full_disk_is_one_line_on_stderr_and_status_1() {
    let dir = tempfile::tempdir().unwrap();
    let file = many_tensors(dir.path());
    let file = file.to_str().unwrap();
    assert_one_line_about_a_full_disk(&into_full_disk(&["inspect", file]));
    assert_one_line_about_a_full_disk(&into_full_disk(&["inspect", "--json", file]));
}

#[test]
fn help_into_a_full_disk_is_one_line_on_stderr_and_status_1() {
    assert_one_line_about_a_full_disk(&into_full_disk(&["--help"]));
}

#[test]
fn an_error_with_stderr_unwritable_still_exits_1_without_a_panic() {
    let full = File::options().write(true).open("/dev/full").unwrap();
    let out = bin()
        .args(["inspect", "/nonexistent/m.safetensors"])
        .stderr(full)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
}

/// Names and metadata that would recolour the terminal and ring its bell.
fn hostile_names(dir: &Path) -> PathBuf {
    let path = dir.join("hostile.safetensors");
    let names = [
        "red\x1b[31m.weight".to_string(),
        "bell\x07.bias".to_string(),
        "csi\u{9b}31m.del\x7f".to_string(),
    ];
    write_safetensors(
        &path,
        &names,
        &[("author\x1b]0;owned\x07", "me\x1b[2J\r\nfake line")],
    );
    path
}

/// Bytes that a terminal acts on: C0 controls but newline, DEL, C1 controls (UTF-8).
fn raw_controls(text: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(text)
        .chars()
        .filter(|&c| c != '\n' && c.is_control())
        .map(|c| format!("{c:?}"))
        .collect()
}

#[test]
fn inspect_prints_control_characters_of_names_and_metadata_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let file = hostile_names(dir.path());
    let out = bin()
        .args(["inspect", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(raw_controls(&out.stdout), Vec::<String>::new());
    let table = String::from_utf8(out.stdout).unwrap();
    for shown in [
        r"red\u{1b}[31m.weight",
        r"bell\u{7}.bias",
        r"csi\u{9b}31m.del\u{7f}",
        r"metadata author\u{1b}]0;owned\u{7}: me\u{1b}[2J\r\nfake line",
    ] {
        assert!(table.contains(shown), "{shown} missing in\n{table}");
    }
    // The heading, one line per tensor, the totals (all, then the one dtype) and one line
    // per metadata entry: a newline in a value starts none.
    assert_eq!(table.lines().count(), 1 + 3 + 2 + 1, "{table}");
}

#[test]
fn inspect_json_escapes_every_control_character_and_keeps_the_names() {
    let dir = tempfile::tempdir().unwrap();
    let file = hostile_names(dir.path());
    let out = bin()
        .args(["inspect", "--json", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(raw_controls(&out.stdout), Vec::<String>::new());
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut names: Vec<&str> = doc["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "bell\x07.bias",
            "csi\u{9b}31m.del\x7f",
            "red\x1b[31m.weight"
        ]
    );
    assert_eq!(
        doc["metadata"]["author\x1b]0;owned\x07"],
        "me\x1b[2J\r\nfake line"
    );
}

#[test]
fn an_error_about_a_file_prints_control_characters_of_its_name_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad\x1b[31m\x07.safetensors");
    std::fs::write(&file, [1, 2, 3]).unwrap();
    let out = bin()
        .args(["inspect", file.to_str().unwrap()])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(raw_controls(err.as_bytes()), Vec::<String>::new());
    assert!(err.contains(r"bad\u{1b}[31m\u{7}.safetensors"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// Status 134 (an abort) before the library refused an index naming an index: each level
/// loaded on a thread of its own until no thread could start.
#[test]
fn an_index_naming_itself_is_one_line_and_status_1() {
    let dir = tempfile::tempdir().unwrap();
    let index = dir.path().join("m.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"metadata": {}, "weight_map": {"a": "m.safetensors.index.json"}}"#,
    )
    .unwrap();
    let out = bin()
        .args(["inspect", index.to_str().unwrap()])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}
