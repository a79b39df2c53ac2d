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
use std::io::Read;
use std::path::{Path, PathBuf};

use super::commit::{commit_sharded, commit_single, save_id, Place, StagedShard};
use super::index::{read_index, Index, INDEX_SUFFIX, SAVE_ID_KEY};
use crate::error::{Error, Result};
use crate::io::format::header_writer::Walked;
use crate::io::format::tree_decode::{decode, TensorSource};
use crate::io::format::tree_meta::TREE_METADATA_KEY;
use crate::io::format::{header_writer, tree_census, tree_meta};
use crate::io::read::{load_file, LoadOptions, Loaded};
use crate::io::write::{stage_node, stage_walked, SaveOptions};
use crate::tensor::Tensor;
use crate::tree::{KeyPath, Node, TensorDict};

/// Shards read at once.
pub(crate) const READERS: usize = 8;

/// [`crate::io::save_sharded`] to files: `root` checked, `max_shard_bytes` positive.
pub(crate) fn save_sharded_files(
    root: &Node,
    path: &Path,
    options: &SaveOptions,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    // One walk gives what a single file and the shards both need: the tensors in tree
    // order, their names (checked as a single file's are) and the tree record.
    let walked = header_writer::walk_node_recorded(root);
    let paths = || root.tensors().into_iter().map(|(p, _)| p).collect();
    let place = Place::of(path)?;
    let mut shard_options = options.clone();
    let Some(plan) = plan_save(&walked, paths, &mut shard_options, max_shard_bytes)? else {
        write_walked(walked, paths, &place.single, &shard_options)?;
        return Ok(vec![place.single]);
    };
    let count = plan.shards.len();
    let mut staged = Vec::with_capacity(count);
    for (i, (shard, names)) in plan.shards.into_iter().enumerate() {
        let file = place.dir.join(place.shard_name(i + 1, count));
        let file = stage_node(&shard, &file, &shard_options)?;
        staged.push(StagedShard { file, names });
    }
    commit_sharded(&place, &plan.id, staged, plan.metadata, options.fsync)
}

/// The shards of a sharded save and its index.
pub(crate) struct SavePlan {
    /// The save's id ([`save_id`]).
    pub(crate) id: String,
    /// Each shard, in order: a dict of its tensors by name, and those names.
    pub(crate) shards: Vec<(Node, Vec<String>)>,
    /// The index's `metadata`: the total size, the tree record and the save's id.
    pub(crate) metadata: serde_json::Value,
}

/// Plans the save of `walked` (recorded; `paths` its tensors' key paths) in shards of at
/// most `max` bytes, `options` becoming the options of each file (the format, and for
/// shards the save's id, recorded). `None` when the tensors fit one file; else shards
/// whose names are checked as a single file's are.
pub(crate) fn plan_save(
    walked: &Walked<'_>,
    paths: impl FnOnce() -> Vec<KeyPath>,
    options: &mut SaveOptions,
    max: u64,
) -> Result<Option<SavePlan>> {
    let groups = plan_shards(walked.tensors.iter().map(|t| t.nbytes() as u64), max);
    options
        .metadata
        .entry("format".into())
        .or_insert_with(|| "pt".into());
    if groups.len() <= 1 {
        return Ok(None);
    }
    let id = save_id();
    options.metadata.insert(SAVE_ID_KEY.into(), id.clone());
    header_writer::check_names(walked, paths)?;
    let shards = groups
        .iter()
        .map(|group| {
            let mut shard = TensorDict::new();
            let mut names = Vec::with_capacity(group.len());
            for &at in group {
                let name = walked.name(at);
                shard.insert(name.to_string(), Node::Tensor(walked.tensors[at].clone()));
                names.push(name.to_string());
            }
            (Node::Dict(shard), names)
        })
        .collect();
    let total: u64 = walked.tensors.iter().map(|t| t.nbytes() as u64).sum();
    let metadata = serde_json::json!({
        "total_size": total,
        TREE_METADATA_KEY: walked.record(),
        SAVE_ID_KEY: id,
    });
    Ok(Some(SavePlan {
        id,
        shards,
        metadata,
    }))
}

/// Checks the names of a walked tree, builds its header and writes the file as the
/// checkpoint at `path`, replacing whatever checkpoint of that name was there
/// ([`super::commit`]).
pub(crate) fn write_walked(
    walked: Walked<'_>,
    paths: impl FnOnce() -> Vec<KeyPath>,
    path: &Path,
    options: &SaveOptions,
) -> Result<()> {
    let place = Place::of(path)?;
    let staged = stage_walked(walked, paths, &place.single, options)?;
    commit_single(&place, staged, options.fsync)
}

/// Groups tensor sizes, in order, into shards of at most `max` bytes (a larger tensor
/// alone): the indexes of each shard's tensors.
pub(crate) fn plan_shards(sizes: impl Iterator<Item = u64>, max: u64) -> Vec<Vec<usize>> {
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

/// What a load of a path reads.
pub(crate) enum Target {
    /// An index of shards.
    Index(PathBuf),
    /// One safetensors file (the path itself, or the one file in a folder).
    File(PathBuf),
}

/// What a load of `path` should read: `path` itself when it names an index or a file;
/// for `x.safetensors` (or `x`) that does not exist but whose index
/// `x.safetensors.index.json` does (a sharded save to that path), that index; for a folder, the checkpoint in it
/// (see [`in_folder`]).
pub(crate) fn resolve(path: &Path) -> Result<Target> {
    if path.to_str().is_some_and(|p| p.ends_with(INDEX_SUFFIX)) {
        return Ok(Target::Index(path.to_path_buf()));
    }
    if path.is_dir() {
        return in_folder(path);
    }
    if !path.exists() {
        // A sharded save to `dir/stem.safetensors` (or `dir/stem`) wrote
        // `dir/stem.safetensors.index.json`.
        let mut index = path.as_os_str().to_owned();
        if !path.to_str().is_some_and(|p| p.ends_with(".safetensors")) {
            index.push(".safetensors");
        }
        index.push(".index.json");
        let index = PathBuf::from(index);
        if index.is_file() {
            return Ok(Target::Index(index));
        }
    }
    Ok(Target::File(path.to_path_buf()))
}

/// The checkpoint in the folder `dir`, as [`choose_in_folder`] chooses it from its files.
fn in_folder(dir: &Path) -> Result<Target> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))? {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    match choose_in_folder(&names, &format!("{dir:?}"), "files", "the file")? {
        Some(Chosen::File(name)) => Ok(Target::File(dir.join(name))),
        Some(Chosen::Index(name)) => Ok(Target::Index(dir.join(name))),
        // The error opening a folder as a file gives (EISDIR), with what was looked for.
        None => Err(Error::io(
            "find a checkpoint (a *.safetensors file or a *.safetensors.index.json) in",
            dir,
            std::fs::File::open(dir)
                .and_then(|mut f| f.read(&mut [0u8; 1]))
                .err()
                .unwrap_or_else(|| std::io::ErrorKind::IsADirectory.into()),
        )),
    }
}

/// The checkpoint a folder holds, by name.
pub(crate) enum Chosen {
    /// A single safetensors file (or object).
    File(String),
    /// An index of shards.
    Index(String),
}

/// The checkpoint among the `names` a folder holds, in transformers' order:
/// `model.safetensors`, else `model.safetensors.index.json`; else the one index (or the
/// single file of the same name beside it, which a reader takes first), else the one
/// safetensors file; `None` when there is neither. A folder with several is an error
/// naming it as `folder`, what it holds as `things` ("files") and what to name as `one`
/// ("the file").
pub(crate) fn choose_in_folder(
    names: &[&str],
    folder: &str,
    things: &str,
    one: &str,
) -> Result<Option<Chosen>> {
    let indexes: Vec<&str> = names
        .iter()
        .filter_map(|n| n.strip_suffix(INDEX_SUFFIX))
        .collect();
    let files: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    let choose = |stem: &str| {
        let single = format!("{stem}.safetensors");
        match files.contains(&single.as_str()) {
            true => Chosen::File(single),
            false => Chosen::Index(format!("{stem}{INDEX_SUFFIX}")),
        }
    };
    if files.contains(&"model.safetensors") || indexes.contains(&"model") {
        return Ok(Some(choose("model")));
    }
    let many = |reason: String| {
        Err(Error::InvalidValue {
            key: String::new(),
            reason,
        })
    };
    if indexes.is_empty() && names.contains(&".metadata") {
        // Its *.safetensors files are ranks' pieces, each of a part of the tensors.
        return many(format!(
            "{folder} is a PyTorch distributed checkpoint (it holds .metadata): read it with \
             torch.distributed.checkpoint and tensorferry.dcp.TensorferryReader, or make one \
             file of it with tensorferry.dcp.consolidate"
        ));
    }
    match (indexes.as_slice(), files.as_slice()) {
        ([stem], _) => Ok(Some(choose(stem))),
        ([], [file]) => Ok(Some(Chosen::File(file.to_string()))),
        ([], []) => Ok(None),
        ([], n) => many(format!(
            "{folder} holds {} *.safetensors {things} and no index: name {one} to load",
            n.len()
        )),
        (n, _) => many(format!(
            "{folder} holds {} *{INDEX_SUFFIX} {things}: name one",
            n.len()
        )),
    }
}

/// Loads every shard an index names as one tree (shards read in parallel). The metadata
/// is the first shard's; [`Loaded::direct_fallback`] gives every shard's distinct reason.
pub fn load_sharded(index_path: impl AsRef<Path>, options: LoadOptions) -> Result<Loaded> {
    load_sharded_with(index_path.as_ref(), READERS, |file| {
        load_file(file, options)
    })
}

/// Loads every shard an index names with `load_one`, up to `readers` at once, as one
/// tree. Each tensor comes from the shard the index names for it.
pub(crate) fn load_sharded_with(
    index_path: &Path,
    readers: usize,
    load_one: impl Fn(&Path) -> Result<Loaded> + Sync,
) -> Result<Loaded> {
    let index = read_index(index_path)?;
    let dir = index_path.parent().unwrap_or(Path::new("."));
    load_index_with(index, index_path, readers, |name| load_one(&dir.join(name)))
}

/// Loads every shard `index` names with `load_one` (given the shard's file name), up to
/// `readers` at once, as one tree; `index_path` names the index in messages.
pub(crate) fn load_index_with(
    index: Index,
    index_path: &Path,
    readers: usize,
    load_one: impl Fn(&str) -> Result<Loaded> + Sync,
) -> Result<Loaded> {
    let dir = index_path.parent().unwrap_or(Path::new("."));
    let shards: Vec<&str> = index.files().collect();
    let loaded = load_in_parallel(&shards, readers, load_one)?;
    let mut metadata = BTreeMap::new();
    let mut found: HashMap<&str, Tensor> = HashMap::with_capacity(index.weight_map.len());
    let mut fallbacks: Vec<String> = Vec::new();
    for (i, mut shard) in loaded.into_iter().enumerate() {
        let id = shard.metadata.remove(SAVE_ID_KEY);
        if index.save_id.is_some() && id != index.save_id {
            return Err(Error::Format {
                at: format!("{:?}", dir.join(shards[i])),
                reason: format!(
                    "the shard was written by another save than its index {index_path:?} \
                     (the checkpoint changed while it was read, or a file was replaced by hand)"
                ),
            });
        }
        if i == 0 {
            metadata = shard.metadata;
        }
        if let Some(why) = shard.direct_fallback {
            if !fallbacks.contains(&why) {
                fallbacks.push(why);
            }
        }
        for (path, t) in shard.root.tensors() {
            let name = path.dotted();
            if let Some((name, file)) = index.weight_map.get_key_value(&name) {
                if file == shards[i] {
                    found.insert(name.as_str(), t.clone());
                }
            }
        }
    }
    let mut by_name = HashMap::with_capacity(index.weight_map.len());
    for (name, file) in &index.weight_map {
        let t = found.remove(name.as_str()).ok_or_else(|| {
            Error::format_in(
                name,
                format!("the index names it in {file:?}, which does not hold it"),
            )
        })?;
        by_name.insert(name.clone(), t);
    }
    let root = match index.record {
        Some(text) => {
            let census = tree_census::count(&text)?;
            let mut source = Named(by_name);
            let root = decode(&text, &census, &mut source)?;
            // As for one file: every tensor stored must be in the tree.
            if let Some(name) = source.0.keys().min() {
                return Err(tree_meta::bad(format!(
                    "tensor {name:?} is in the index but not in the recorded tree"
                )));
            }
            root
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

/// The shard files of the sharded checkpoint at `path` (an index, or a folder or path
/// that `super::load` reads an index from), each once in the index's order of first
/// mention, with the index; `None` when `path` is one safetensors file. Reads the index
/// alone, so that a caller can read the shards' headers without their tensors.
pub fn shard_files(path: impl AsRef<Path>) -> Result<Option<(PathBuf, Vec<PathBuf>)>> {
    let Target::Index(index_path) = resolve(path.as_ref())? else {
        return Ok(None);
    };
    let dir = index_path.parent().unwrap_or(Path::new("."));
    let files = read_index(&index_path)?
        .files()
        .map(|f| dir.join(f))
        .collect();
    Ok(Some((index_path, files)))
}

/// The path of the first shard the index at `index_path` names.
pub(crate) fn first_shard(index_path: &Path) -> Result<PathBuf> {
    let index = read_index(index_path)?;
    let first = index.files().next().ok_or_else(|| Error::Format {
        at: format!("{index_path:?}"),
        reason: "the index names no shard".into(),
    })?;
    Ok(index_path.parent().unwrap_or(Path::new(".")).join(first))
}

/// Loads `files` with `load_one` on up to `readers` threads, in order; the
/// first failure (in order) is the error, and no new shard is started after a failure.
fn load_in_parallel(
    files: &[&str],
    readers: usize,
    load_one: impl Fn(&str) -> Result<Loaded> + Sync,
) -> Result<Vec<Loaded>> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let mut slots: Vec<Option<Result<Loaded>>> = (0..files.len()).map(|_| None).collect();
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results = std::sync::Mutex::new(&mut slots);
    std::thread::scope(|s| {
        for _ in 0..readers.clamp(1, files.len().max(1)) {
            s.spawn(|| loop {
                if failed.load(Ordering::Relaxed) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(file) = files.get(i) else { break };
                let loaded = load_one(file);
                if loaded.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(loaded);
            });
        }
    });
    // Shards are claimed in order, so one never started follows a failure, and the
    // collection stops at that failure.
    slots
        .into_iter()
        .map(|r| r.expect("a shard not started follows a failure"))
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
    fn places_come_from_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let place = Place::of(&dir.path().join("model.safetensors")).unwrap();
        assert_eq!(
            (place.dir.as_path(), place.stem.as_str()),
            (dir.path(), "model")
        );
        assert_eq!(Place::of(&dir.path().join("ckpt")).unwrap().stem, "ckpt");
        assert_eq!(place.shard_name(2, 13), "model-00002-of-00013.safetensors");
        let folder = dir.path().join("new/");
        let place = Place::of(&folder).unwrap();
        assert!(folder.is_dir(), "a folder path is created");
        assert_eq!(place.single, folder.join("model.safetensors"));
        assert!(Place::of(&dir.path().join("missing/x.safetensors")).is_err());
    }
}
