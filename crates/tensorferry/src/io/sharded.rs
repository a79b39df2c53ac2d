//! Sharded checkpoints as the Hugging Face ecosystem writes them: tensors spread over
//! `model-00001-of-0000N.safetensors` files, and `model.safetensors.index.json` mapping
//! each tensor name to its file (`weight_map`) with the total size
//! (`metadata.total_size`), which `transformers.from_pretrained` reads.
//!
//! Each shard is an ordinary safetensors file written atomically; the index is written
//! last, so a reader never finds an index naming a shard that is not complete. The index
//! also carries tensorferry's tree record (`metadata.tensorferry`), so the nesting and
//! plain values of the saved tree come back; indexes of other tools load as a flat dict
//! of names. Shards are read in parallel.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::file_kind::open_regular;
use super::read::{load_node, LoadOptions, Loaded};
use super::replace::write_atomically;
use super::tree_decode::{decode, TensorSource};
use super::write::{check_root, save_node, write_walked, SaveOptions};
use super::{header_writer, tree_census, tree_meta, TREE_METADATA_KEY};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::tree::{Node, TensorDict};

/// The suffix of an index file.
pub const INDEX_SUFFIX: &str = ".safetensors.index.json";

/// Largest index file read (a million tensor names fit in far less).
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// Shards read at once.
const READERS: usize = 8;

/// Saves `root` as shards of at most `max_shard_bytes` of tensor data each (a tensor
/// larger than that gets a shard of its own), plus the index, next to `path`:
/// `dir/model.safetensors` gives `dir/model-00001-of-0000N.safetensors` and
/// `dir/model.safetensors.index.json`. A tree that fits one shard is saved as `path`
/// itself, as Hugging Face does. Every shard's metadata holds `"format": "pt"` unless
/// `options.metadata` names a format (transformers requires the key). Shards of an
/// earlier save with the same stem that the new index does not name are removed once the
/// index is written. Returns the files written, the index last.
pub fn save_sharded(
    root: &Node,
    path: impl AsRef<Path>,
    options: &SaveOptions,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    let path = path.as_ref();
    if max_shard_bytes == 0 {
        return Err(Error::InvalidValue {
            key: String::new(),
            reason: "max_shard_size must be positive".into(),
        });
    }
    check_root(root, options)?;
    // One walk gives what a single file and the shards both need: the tensors in tree
    // order, their names (checked as a single file's are) and the tree record.
    let walked = header_writer::walk_node_recorded(root);
    let paths = || root.tensors().into_iter().map(|(p, _)| p).collect();
    let groups = plan_shards(
        walked.tensors.iter().map(|t| t.nbytes() as u64),
        max_shard_bytes,
    );
    let mut shard_options = options.clone();
    shard_options
        .metadata
        .entry("format".into())
        .or_insert_with(|| "pt".into());
    if groups.len() <= 1 {
        write_walked(walked, paths, path, &shard_options)?;
        return Ok(vec![path.to_path_buf()]);
    }
    header_writer::check_names(&walked, paths)?;
    let (dir, stem) = dir_and_stem(path)?;
    let count = groups.len();
    let mut written = Vec::with_capacity(count + 1);
    let mut weight_map = BTreeMap::new();
    for (i, group) in groups.iter().enumerate() {
        let file = shard_name(&stem, i + 1, count);
        let mut shard = TensorDict::new();
        for &at in group {
            let name = walked.name(at);
            shard.insert(name.to_string(), Node::Tensor(walked.tensors[at].clone()));
            weight_map.insert(name.to_string(), file.clone());
        }
        let shard_path = dir.join(&file);
        save_node(&Node::Dict(shard), &shard_path, &shard_options)?;
        written.push(shard_path);
    }
    let total: u64 = walked.tensors.iter().map(|t| t.nbytes() as u64).sum();
    let index = serde_json::json!({
        "metadata": { "total_size": total, TREE_METADATA_KEY: walked.record() },
        "weight_map": weight_map,
    });
    let text = serde_json::to_vec_pretty(&index).expect("an index always serialises");
    let index_path = dir.join(format!("{stem}{INDEX_SUFFIX}"));
    write_atomically(&index_path, options.fsync, |out| {
        out.write_all(&text)
            .map_err(|e| Error::io("write", &index_path, e))
    })?;
    remove_stale_shards(&dir, &stem, count);
    written.push(index_path);
    Ok(written)
}

/// Groups tensor sizes, in order, into shards of at most `max` bytes (a larger tensor
/// alone): the indexes of each shard's tensors.
fn plan_shards(sizes: impl Iterator<Item = u64>, max: u64) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut filled = 0u64;
    for (i, size) in sizes.enumerate() {
        match groups.last_mut() {
            Some(group) if filled.saturating_add(size) <= max => group.push(i),
            _ => {
                groups.push(vec![i]);
                filled = 0;
            }
        }
        filled = filled.saturating_add(size);
    }
    groups
}

fn shard_name(stem: &str, i: usize, count: usize) -> String {
    format!("{stem}-{i:05}-of-{count:05}.safetensors")
}

/// The folder and the stem of `dir/stem.safetensors` (or `dir/stem`).
fn dir_and_stem(path: &Path) -> Result<(PathBuf, String)> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::InvalidValue {
            key: String::new(),
            reason: format!("{path:?} does not end in a file name"),
        })?;
    let stem = name.strip_suffix(".safetensors").unwrap_or(name);
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((dir, stem.to_string()))
}

/// Removes `stem-NNNNN-of-MMMMM.safetensors` files of other shard counts: what an
/// earlier, differently sharded save left. Best effort: a file that cannot be removed
/// stays (the index does not name it).
fn remove_stale_shards(dir: &Path, stem: &str, count: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name
            .strip_prefix(stem)
            .and_then(|r| r.strip_prefix('-'))
            .and_then(|r| r.strip_suffix(".safetensors"))
        else {
            continue;
        };
        let Some((i, n)) = rest.split_once("-of-") else {
            continue;
        };
        let numbered = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
        if numbered(i) && numbered(n) && n.parse::<usize>().ok() != Some(count) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// What a load of a path reads.
pub(crate) enum Target {
    /// An index of shards.
    Index(PathBuf),
    /// One safetensors file (the path itself, or the one file in a folder).
    File(PathBuf),
}

/// What a load of `path` should read: `path` itself when it names an index or a file;
/// for a folder, the one index in it, else its one safetensors file. A folder with
/// neither stays as it is (reading it is then the operating system's `EISDIR`).
pub(crate) fn resolve(path: &Path) -> Result<Target> {
    if path.to_str().is_some_and(|p| p.ends_with(INDEX_SUFFIX)) {
        return Ok(Target::Index(path.to_path_buf()));
    }
    if !path.is_dir() {
        return Ok(Target::File(path.to_path_buf()));
    }
    let mut indexes = Vec::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| Error::io("list", path, e))? {
        let entry = entry.map_err(|e| Error::io("list", path, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(INDEX_SUFFIX) {
            indexes.push(entry.path());
        } else if name.ends_with(".safetensors") {
            files.push(entry.path());
        }
    }
    match (indexes.len(), files.len()) {
        (1, _) => Ok(Target::Index(indexes.remove(0))),
        (0, 1) => Ok(Target::File(files.remove(0))),
        (0, _) => Ok(Target::File(path.to_path_buf())),
        (n, _) => Err(Error::InvalidValue {
            key: String::new(),
            reason: format!("{path:?} holds {n} *{INDEX_SUFFIX} files: name one"),
        }),
    }
}

/// Loads every shard an index names as one tree (shards read in parallel). The metadata
/// is the first shard's; [`Loaded::direct_fallback`] gives every shard's distinct reason.
pub fn load_sharded(index_path: impl AsRef<Path>, options: LoadOptions) -> Result<Loaded> {
    load_sharded_with(index_path.as_ref(), READERS, |file| {
        load_node(file, options)
    })
}

/// Loads every shard an index names with `load_one`, up to `readers` at once, as one tree.
pub(crate) fn load_sharded_with(
    index_path: &Path,
    readers: usize,
    load_one: impl Fn(&Path) -> Result<Loaded> + Sync,
) -> Result<Loaded> {
    let index = read_index(index_path)?;
    let dir = index_path.parent().unwrap_or(Path::new("."));
    let mut shards: Vec<&str> = Vec::new();
    for file in index.weight_map.values() {
        if !shards.contains(&file.as_str()) {
            shards.push(file);
        }
    }
    let loaded = load_in_parallel(dir, &shards, readers, load_one)?;
    let mut metadata = BTreeMap::new();
    let mut found: HashMap<String, Tensor> = HashMap::new();
    let mut fallbacks: Vec<String> = Vec::new();
    for (i, shard) in loaded.into_iter().enumerate() {
        if i == 0 {
            metadata = shard.metadata;
        }
        if let Some(why) = shard.direct_fallback {
            if !fallbacks.contains(&why) {
                fallbacks.push(why);
            }
        }
        for (path, t) in shard.root.tensors() {
            found.insert(path.dotted(), t.clone());
        }
    }
    let mut by_name = HashMap::with_capacity(index.weight_map.len());
    for (name, file) in &index.weight_map {
        let t = found.remove(name).ok_or_else(|| {
            Error::format_in(
                name,
                format!("the index names it in {file:?}, which does not hold it"),
            )
        })?;
        by_name.insert(name.clone(), t);
    }
    let root = match index.record {
        Some(text) => {
            let census = tree_census::count_tree(&text)?;
            let mut source = Named(by_name);
            decode(&text, &census, &mut source)?
        }
        None => Node::Dict(
            index
                .weight_map
                .keys()
                .map(|name| {
                    (
                        name.clone(),
                        Node::Tensor(by_name.remove(name).expect("found above")),
                    )
                })
                .collect(),
        ),
    };
    Ok(Loaded {
        root,
        metadata,
        direct_fallback: (!fallbacks.is_empty()).then(|| fallbacks.join("; ")),
    })
}

struct Index {
    /// Tensor name → shard file, sorted by name.
    weight_map: BTreeMap<String, String>,
    /// tensorferry's tree record, when tensorferry wrote the index.
    record: Option<String>,
}

fn read_index(path: &Path) -> Result<Index> {
    let (mut file, len) = open_regular(path)?;
    if len > MAX_INDEX_BYTES {
        return Err(Error::Format {
            at: format!("{path:?}"),
            reason: format!("an index of {len} bytes is over the {MAX_INDEX_BYTES}-byte limit"),
        });
    }
    let mut text = String::with_capacity(len as usize);
    file.read_to_string(&mut text)
        .map_err(|e| Error::io("read", path, e))?;
    let bad = |reason: String| Error::Format {
        at: format!("{path:?}"),
        reason,
    };
    #[derive(serde::Deserialize)]
    struct Raw {
        #[serde(default)]
        metadata: Option<serde_json::Map<String, serde_json::Value>>,
        weight_map: BTreeMap<String, String>,
    }
    let raw: Raw =
        serde_json::from_str(&text).map_err(|e| bad(format!("not a safetensors index: {e}")))?;
    for file in raw.weight_map.values() {
        let plain = Path::new(file)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain || file.contains('/') || file.contains('\\') || file.is_empty() {
            return Err(bad(format!(
                "shard {file:?} is not a file name in the index's folder"
            )));
        }
    }
    let record = match raw.metadata.as_ref().and_then(|m| m.get(TREE_METADATA_KEY)) {
        None => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(bad(format!(
                "metadata.{TREE_METADATA_KEY} must be a string"
            )))
        }
    };
    Ok(Index {
        weight_map: raw.weight_map,
        record,
    })
}

/// Loads `files` (in `dir`) with `load_one` on up to `readers` threads, in order.
fn load_in_parallel(
    dir: &Path,
    files: &[&str],
    readers: usize,
    load_one: impl Fn(&Path) -> Result<Loaded> + Sync,
) -> Result<Vec<Loaded>> {
    let mut slots: Vec<Option<Result<Loaded>>> = (0..files.len()).map(|_| None).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(&mut slots);
    std::thread::scope(|s| {
        for _ in 0..readers.clamp(1, files.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(file) = files.get(i) else { break };
                let loaded = load_one(&dir.join(file));
                results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(loaded);
            });
        }
    });
    slots
        .into_iter()
        .map(|r| r.expect("every shard was read"))
        .collect()
}

/// The tensors of the shards by name, for the tree record's decoder.
struct Named(HashMap<String, Tensor>);

impl TensorSource for Named {
    fn take(&mut self, name: &str) -> Result<Tensor> {
        self.0.remove(name).ok_or_else(|| {
            tree_meta::bad(format!(
                "the record names tensor {name:?}, which no shard holds"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_fill_up_to_the_limit_and_big_tensors_stand_alone() {
        let plan = plan_shards([4u64, 4, 4, 20, 1, 1].into_iter(), 10);
        assert_eq!(plan, vec![vec![0, 1], vec![2], vec![3], vec![4, 5]]);
    }

    #[test]
    fn stems_come_from_the_path() {
        let (dir, stem) = dir_and_stem(Path::new("/x/model.safetensors")).unwrap();
        assert_eq!((dir, stem.as_str()), (PathBuf::from("/x"), "model"));
        assert_eq!(dir_and_stem(Path::new("ckpt")).unwrap().1, "ckpt");
        assert_eq!(
            shard_name("model", 2, 13),
            "model-00002-of-00013.safetensors"
        );
    }
}
