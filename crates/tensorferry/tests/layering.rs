//! The layering of the sources, checked: code that must not know which backends exist
//! names no CUDA type, no CUDA type or driver call appears outside `backend/cuda/`, and
//! the files of every folder of `src/` (`src/` itself, `backend/`, `backend/cuda/`, `io/`,
//! `io/object/`, …) import each other without a cycle (a file reaches another through
//! `use super::…` or `crate::<folder>::…`; a sub-folder counts as one module of its
//! parent). Test modules may drive a backend's internals and are not checked.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// A source file without its test module (`#[cfg(test)]`, any further attributes, then
/// `mod …`).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let is_test_module = |at: usize| {
        text[at..]
            .lines()
            .skip(1)
            .find(|l| !l.starts_with("#["))
            .is_some_and(|l| l.starts_with("mod "))
    };
    let end = text
        .match_indices("#[cfg(test)]\n")
        .map(|(i, _)| i)
        .find(|&i| is_test_module(i));
    text[..end.unwrap_or(text.len())].to_string()
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect()
}

#[test]
fn backend_neutral_code_names_no_cuda_type() {
    let src = root().join("src");
    // `ordering_tests.rs` drives the fake CUDA driver's hooks.
    let mut files: Vec<PathBuf> = rust_files(&src)
        .into_iter()
        .filter(|p| !p.ends_with("src/ordering_tests.rs"))
        .collect();
    for dir in ["transfer", "memory", "io", "io/object", "tensor"] {
        files.extend(rust_files(&src.join(dir)));
    }
    for file in [
        "event.rs",
        "fence.rs",
        "interface.rs",
        "lane.rs",
        "completer.rs",
        "stream.rs",
        "worker.rs",
        "emulated.rs",
    ] {
        files.push(src.join("backend").join(file));
    }
    files.extend(rust_files(&root().join("../../bindings/python/src")));
    let forbidden = [
        "cudarc",
        "CudaEvent",
        "CUstream",
        "cuda_device",
        "cuda::device",
        "cuda::event",
        "cuda::copy",
        "cuda::driver",
        "cuda::pinned",
        "cuda::freer",
    ];
    let mut found = vec![];
    for file in &files {
        for (n, line) in code(file).lines().enumerate() {
            let line = line.split("//").next().unwrap_or("");
            for word in forbidden.iter().filter(|w| line.contains(**w)) {
                found.push(format!("{}:{}: {word}", file.display(), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "CUDA names in backend-neutral code:\n{}",
        found.join("\n")
    );
}

/// Every Rust file under `dir`, at any depth.
fn rust_files_below(dir: &Path) -> Vec<PathBuf> {
    let mut files = rust_files(dir);
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files_below(&path));
        }
    }
    files
}

#[test]
fn no_cuda_type_or_driver_call_appears_outside_the_cuda_folder() {
    let src = root().join("src");
    let cuda = src.join("backend/cuda");
    let mut found = vec![];
    for file in rust_files_below(&src) {
        if file.starts_with(&cuda) || file.ends_with("src/ordering_tests.rs") {
            continue;
        }
        for (n, line) in code(&file).lines().enumerate() {
            let line = line.split("//").next().unwrap_or("");
            for word in [
                "cudarc", "sys::CU", "sys::cu", "CUresult", "CUstream", "CUevent",
            ] {
                if line.contains(word) {
                    found.push(format!("{}:{}: {word}", file.display(), n + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "CUDA outside backend/cuda/:\n{}",
        found.join("\n")
    );
}

/// The modules of folder `dir` (relative to `src/`; `""` for `src/` itself) each imports
/// (by module name; `mod` for mod.rs, `lib` for lib.rs; a sub-folder is one module with
/// the file of the same name beside it, importing what any of its files imports from
/// `dir`), as `prefixes` name them. A path into the folder's own module that names no
/// child (`crate::io::Header`) reaches the parent module, which re-exports it.
fn imports_in(dir: &str, prefixes: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    let dir = root().join("src").join(dir);
    let parent = if dir == root().join("src").join("") {
        "lib"
    } else {
        "mod"
    };
    // `ordering_tests.rs` is a test module of its own, of the backends and the engine.
    let not_tests = |p: &PathBuf| !p.ends_with("src/ordering_tests.rs");
    let mut sources: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for p in rust_files(&dir).into_iter().filter(not_tests) {
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        sources.entry(name).or_default().push(p);
    }
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let files = rust_files_below(&path).into_iter().filter(not_tests);
            sources.entry(name).or_default().extend(files);
        }
    }
    let names: BTreeSet<String> = sources.keys().cloned().collect();
    let mut graph = BTreeMap::new();
    for (name, files) in &sources {
        let text: String = files.iter().map(|f| code(f)).collect::<Vec<_>>().join("\n");
        let in_folder = files.len() > 1 || files[0].parent() != Some(dir.as_path());
        let mut deps = BTreeSet::new();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for &prefix in prefixes {
                // Inside a sub-folder `super::` names the sub-folder itself.
                if in_folder && prefix == "super::" {
                    continue;
                }
                for (i, _) in line.match_indices(prefix) {
                    // `crate::` is also the tail of `$crate::` and of longer names.
                    if line[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$') {
                        continue;
                    }
                    let rest = &line[i + prefix.len()..];
                    let heads: Vec<&str> = match rest.strip_prefix('{') {
                        Some(group) => group
                            .split('}')
                            .next()
                            .unwrap_or("")
                            .split(',')
                            .map(|p| p.trim().split("::").next().unwrap_or(""))
                            .collect(),
                        None => vec![rest
                            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                            .next()
                            .unwrap_or("")],
                    };
                    for head in heads {
                        let dep = if names.contains(head) { head } else { parent };
                        if dep != name {
                            deps.insert(dep.to_string());
                        }
                    }
                }
            }
        }
        if name == parent {
            // The parent reaches its children by name (`cuda::device::device(i)`).
            for child in &names {
                if child != parent && names_child(&text, child) {
                    deps.insert(child.clone());
                }
            }
        }
        graph.insert(name.clone(), deps);
    }
    graph
}

/// Whether `text` names its child module `child` as a path's first segment
/// (`device::…`, not `cudarc::driver::…`).
/// Comments are not code.
fn names_child(text: &str, child: &str) -> bool {
    let pattern = format!("{child}::");
    text.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .any(|line| {
            line.match_indices(&pattern).any(|(i, _)| {
                let before = &line[..i];
                !before.ends_with("::")
                    && !before
                        .chars()
                        .next_back()
                        .is_some_and(|c| c.is_alphanumeric() || c == '_')
            })
        })
}

#[test]
fn the_files_of_the_cuda_folder_import_each_other_without_a_cycle() {
    let graph = imports_in("backend/cuda", &["super::", "crate::backend::cuda::"]);
    assert!(graph.contains_key("device") && graph.contains_key("driver"));
    assert_no_cycle("backend/cuda/", graph);
}

fn assert_no_cycle(folder: &str, graph: BTreeMap<String, BTreeSet<String>>) {
    if let Some(cycle) = cycle_in(&graph) {
        panic!("an import cycle in {folder}: {}", cycle.join(" -> "));
    }
}

/// Every folder of `src/`, `src/` itself first (as `""`), relative to `src/`.
fn folders() -> Vec<String> {
    fn below(dir: &Path, rel: &str, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                let rel = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                out.push(rel.clone());
                below(&path, &rel, out);
            }
        }
    }
    let mut out = vec![String::new()];
    below(&root().join("src"), "", &mut out);
    out
}

#[test]
fn the_files_of_every_folder_import_each_other_without_a_cycle() {
    let folders = folders();
    for named in [
        "io",
        "io/object",
        "io/format",
        "transfer",
        "memory",
        "backend/cuda",
    ] {
        assert!(folders.iter().any(|f| f == named), "{named}: {folders:?}");
    }
    for folder in folders {
        let in_crate = if folder.is_empty() {
            "crate::".to_string()
        } else {
            format!("crate::{}::", folder.replace('/', "::"))
        };
        let graph = imports_in(&folder, &["super::", in_crate.as_str()]);
        assert_no_cycle(&format!("src/{folder}"), graph);
    }
}

#[test]
fn the_modules_of_io_and_of_the_crate_are_seen() {
    let io = imports_in("io", &["super::", "crate::io::"]);
    assert!(
        io.contains_key("object") && io.contains_key("checkpoint"),
        "{io:?}"
    );
    assert!(io["route"].contains("object"), "{io:?}");
    let top = imports_in("", &["super::", "crate::"]);
    assert!(
        top["io"].contains("tree") && top["lib"].contains("io"),
        "{top:?}"
    );
}

/// An import cycle of `graph`, if it has one.
fn cycle_in(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    // Depth-first search for a back edge.
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let start = path.iter().position(|p| p == n).unwrap();
                let mut cycle = path[start..].to_vec();
                cycle.push(n.to_string());
                return Some(cycle);
            }
            _ => {}
        }
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for d in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, graph, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut state, &mut Vec::new()))
}

#[test]
fn a_cycle_is_found() {
    let edge = |a: &str, b: &str| (a.to_string(), BTreeSet::from([b.to_string()]));
    let graph = BTreeMap::from([edge("a", "b"), edge("b", "c"), edge("c", "a")]);
    assert_eq!(cycle_in(&graph).unwrap(), ["a", "b", "c", "a"]);
    let graph = BTreeMap::from([edge("a", "b"), edge("b", "c")]);
    assert_eq!(cycle_in(&graph), None);
}
