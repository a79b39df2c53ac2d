//! Writing safetensors files: straight from the tensors' memory, atomically.
//!
//! The file is written to a temporary file in the same folder, synced, and renamed
//! over the target, so a failure at any point leaves the previous file untouched and
//! no temporary file behind.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{tree_meta, TREE_METADATA_KEY};
use crate::error::{Error, Result};
use crate::memory::HOST_ALIGNMENT;
use crate::tensor::Tensor;
use crate::tree::{KeyPath, Node, TensorDict};

/// How to save.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// User metadata (string to string), stored in `__metadata__` beside tensorferry's key.
    pub metadata: BTreeMap<String, String>,
    /// Flush the file and its folder to stable storage before returning (default true).
    pub fsync: bool,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            metadata: BTreeMap::new(),
            fsync: true,
        }
    }
}

/// Saves a dictionary; see [`save_node`].
pub fn save(dict: &TensorDict, path: impl AsRef<Path>, options: &SaveOptions) -> Result<()> {
    save_node(&Node::Dict(dict.clone()), path, options)
}

/// Saves a tree (dict, list or tuple at the root) as a safetensors file at `path`.
///
/// Tensor names are the key paths joined with "."; two paths giving one name or a dtype
/// the format cannot hold are errors, raised before the file is touched. Tensors on a
/// device are copied to the host first, all in one planned transfer.
pub fn save_node(root: &Node, path: impl AsRef<Path>, options: &SaveOptions) -> Result<()> {
    let path = path.as_ref();
    if matches!(root, Node::Tensor(_) | Node::Value(_)) {
        return Err(Error::InvalidValue {
            key: String::new(),
            reason: "the object to save must be a dict, list or tuple".into(),
        });
    }
    if options.metadata.contains_key(TREE_METADATA_KEY) {
        return Err(Error::InvalidValue {
            key: format!("metadata/{TREE_METADATA_KEY}"),
            reason: "this metadata key is reserved for tensorferry".into(),
        });
    }
    check_depth(root, 0)?;
    let tensors = root.tensors();
    let names = checked_names(&tensors)?;
    let header = build_header(root, &tensors, &names, &options.metadata);
    // Same paths, dtypes and shapes: the header holds for the host copies.
    let hosted = on_host(&tensors)?;
    let tensors: Vec<(KeyPath, &Tensor)> = tensors
        .iter()
        .zip(&hosted)
        .map(|((p, _), t)| (p.clone(), t))
        .collect();
    write_atomically(path, options.fsync, |out| {
        out.write_all(&header)
            .map_err(|e| Error::io("write", path, e))?;
        for (_, t) in order_for_file(&tensors) {
            t.for_each_run(|run| out.write_all(run).map_err(|e| Error::io("write", path, e)))?;
        }
        Ok(())
    })
}

fn check_depth(node: &Node, depth: usize) -> Result<()> {
    if depth > tree_meta::MAX_DEPTH {
        return Err(Error::InvalidValue {
            key: String::new(),
            reason: format!("nested deeper than {} levels", tree_meta::MAX_DEPTH),
        });
    }
    match node {
        Node::Dict(d) => d.iter().try_for_each(|(_, v)| check_depth(v, depth + 1)),
        Node::List(items) | Node::Tuple(items) => {
            items.iter().try_for_each(|v| check_depth(v, depth + 1))
        }
        _ => Ok(()),
    }
}

/// The tensors with those on a device copied to the host, in one planned transfer (host
/// tensors are shared, not copied).
fn on_host(tensors: &[(KeyPath, &Tensor)]) -> Result<Vec<Tensor>> {
    let all: Vec<&Tensor> = tensors.iter().map(|(_, t)| *t).collect();
    if all.iter().all(|t| t.device().is_host()) {
        return Ok(all.into_iter().cloned().collect());
    }
    crate::transfer::move_tensors(&all, crate::Device::Cpu, Default::default())
}

/// The dotted name of each tensor; collisions and unsupported dtypes fail.
fn checked_names(tensors: &[(KeyPath, &Tensor)]) -> Result<Vec<String>> {
    let mut seen: HashMap<String, &KeyPath> = HashMap::with_capacity(tensors.len());
    let mut names = Vec::with_capacity(tensors.len());
    for (path, t) in tensors {
        if t.dtype().safetensors_code().is_none() {
            return Err(Error::UnsupportedDType {
                key: path.to_string(),
                dtype: t.dtype().to_string(),
                reason: "the safetensors format has no code for it".into(),
            });
        }
        let name = path.dotted();
        if let Some(first) = seen.insert(name.clone(), path) {
            return Err(Error::NameCollision {
                name,
                first: first.to_string(),
                second: path.to_string(),
            });
        }
        names.push(name);
    }
    Ok(names)
}

/// Tensors in the order their bytes go to the file: widest elements first (stable), so
/// that every tensor starts at a multiple of its element size.
fn order_for_file<'a>(tensors: &[(KeyPath, &'a Tensor)]) -> Vec<(usize, &'a Tensor)> {
    let mut order: Vec<(usize, &Tensor)> = tensors.iter().map(|(_, t)| *t).enumerate().collect();
    order.sort_by_key(|(_, t)| std::cmp::Reverse(t.dtype().size()));
    order
}

/// The 8-byte length and the JSON header, padded with spaces so data starts 64-byte aligned.
fn build_header(
    root: &Node,
    tensors: &[(KeyPath, &Tensor)],
    names: &[String],
    user: &BTreeMap<String, String>,
) -> Vec<u8> {
    let mut metadata = user.clone();
    metadata.insert(
        TREE_METADATA_KEY.into(),
        tree_meta::encode(root, &mut names.iter().cloned()),
    );
    let mut json = String::from("{\"__metadata__\":");
    json.push_str(&serde_json::to_string(&metadata).expect("strings serialise"));
    let mut at = 0usize;
    for (i, t) in order_for_file(tensors) {
        let end = at + t.nbytes();
        json.push(',');
        json.push_str(&serde_json::to_string(&names[i]).expect("strings serialise"));
        json.push_str(&format!(
            ":{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{at},{end}]}}",
            t.dtype().safetensors_code().expect("checked"),
            t.shape()
        ));
        at = end;
    }
    json.push('}');
    let padded = (8 + json.len()).next_multiple_of(HOST_ALIGNMENT) - 8;
    let mut out = Vec::with_capacity(8 + padded);
    out.extend_from_slice(&(padded as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(8 + padded, b' ');
    out
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "tensors".into());
    let unique = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.tf-tmp-{}-{unique}", std::process::id()))
}

/// Runs `write` into a temporary file beside `path`, then syncs and renames it over
/// `path`; on any failure the temporary file is removed and `path` left as it was.
pub(crate) fn write_atomically(
    path: &Path,
    fsync: bool,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<()>,
) -> Result<()> {
    if path.is_dir() {
        return Err(Error::io(
            "save to",
            path,
            std::io::Error::new(std::io::ErrorKind::IsADirectory, "the path is a folder"),
        ));
    }
    let tmp = temp_path(path);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| Error::io("create", &tmp, e))?;
    let result = (|| {
        let mut out = BufWriter::with_capacity(1 << 20, file);
        write(&mut out)?;
        let file = out
            .into_inner()
            .map_err(|e| Error::io("write", path, e.into_error()))?;
        if fsync {
            file.sync_all().map_err(|e| Error::io("sync", &tmp, e))?;
        }
        drop(file);
        fs::rename(&tmp, path).map_err(|e| Error::io("rename into", path, e))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
        return result;
    }
    if fsync {
        sync_parent(path)?;
    }
    Ok(())
}

fn sync_parent(path: &Path) -> Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(parent)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("sync folder", parent, e))
}
