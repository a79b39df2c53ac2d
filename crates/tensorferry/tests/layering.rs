//! The layering of the sources, checked: code that must not know which backends exist
//! names no CUDA type, and the files of each folder ([`FOLDERS`]) import each other
//! without a cycle (a file of `backend/` reaches another through `use super::…` or
//! `crate::backend::…`). Test modules may drive a backend's internals and are not checked.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// A source file without its test module.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    text.split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or("")
        .to_string()
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
    let mut files = rust_files(&src);
    for dir in [
        "transfer",
        "memory",
        "io",
        "io/object",
        "io/format",
        "io/fs",
        "io/checkpoint",
        "tensor",
    ] {
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
        "cuda_event",
        "cuda_copy",
        "cuda_driver",
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

/// The folders whose files must import each other without a cycle.
const FOLDERS: [&str; 4] = ["backend", "io/format", "io/fs", "io/checkpoint"];

/// The files of the folder `folder` (under `src/`) each file imports (by module name;
/// `mod` for mod.rs).
fn imports(folder: &str) -> BTreeMap<String, BTreeSet<String>> {
    let dir = root().join("src").join(folder);
    let in_crate = format!("crate::{}::", folder.replace('/', "::"));
    let files = rust_files(&dir);
    let names: BTreeSet<String> = files
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .filter(|n| n != "ordering_tests")
        .collect();
    let mut graph = BTreeMap::new();
    for name in &names {
        let text = code(&dir.join(format!("{name}.rs")));
        let mut deps = BTreeSet::new();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for prefix in ["super::", in_crate.as_str()] {
                for (i, _) in line.match_indices(prefix) {
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
                        let dep = if names.contains(head) { head } else { "mod" };
                        if dep != name {
                            deps.insert(dep.to_string());
                        }
                    }
                }
            }
        }
        if name == "mod" {
            // The parent reaches its children by name (`cuda_device::device(i)`).
            for child in &names {
                if text.contains(&format!("{child}::")) && child != "mod" {
                    deps.insert(child.clone());
                }
            }
        }
        graph.insert(name.clone(), deps);
    }
    graph
}

#[test]
fn the_files_of_each_folder_import_each_other_without_a_cycle() {
    for folder in FOLDERS {
        if let Some(cycle) = cycle_in(&imports(folder)) {
            panic!("an import cycle in {folder}/: {}", cycle.join(" -> "));
        }
    }
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
