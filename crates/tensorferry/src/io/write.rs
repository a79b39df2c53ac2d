//! Writing safetensors files: straight from the tensors' memory, atomically (see
//! [`super::replace`]).
//!
//! Everything tensorferry's reader or the official one would refuse is refused here,
//! before the file is touched: a tensor named `__metadata__`, two paths giving one name,
//! a dtype the format lacks, a tree nested too deep, a header over the format's size
//! limit, or one that would take a load more memory than [`super::budget`] allows.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use super::census::count_header;
use super::header::MAX_HEADER_BYTES;
use super::replace::write_atomically;
use super::{budget, tree_meta, TREE_METADATA_KEY};
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
/// Tensor names are the key paths joined with "."; a file no reader would read back (two
/// paths giving one name, a tensor named `__metadata__`, a dtype the format cannot hold,
/// a header over 100 MB, or too many values for the bytes the file holds: see
/// [`crate::io`]) is an error raised before the file is touched. Tensors on a device are
/// copied to the host first, all in one planned transfer.
///
/// The file is replaced atomically and keeps its permission bits; a symbolic link at
/// `path` stays a link to the replaced file. A folder, FIFO or device at `path` is an
/// [`Error::Io`].
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
    let data_len = tensors.iter().map(|(_, t)| t.nbytes() as u64).sum();
    check_readable(&header[8..], data_len)?;
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

pub(crate) fn check_depth(node: &Node, depth: usize) -> Result<()> {
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
pub(crate) fn checked_names(tensors: &[(KeyPath, &Tensor)]) -> Result<Vec<String>> {
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
        if name == "__metadata__" {
            return Err(Error::InvalidValue {
                key: path.to_string(),
                reason: "a tensor named \"__metadata__\" cannot be stored: safetensors \
                         reserves the name for the metadata, and no reader would read the file"
                    .into(),
            });
        }
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

/// Refuses a header (the JSON after the 8-byte length) that a reader would refuse for its
/// size alone, given the `data_len` bytes after it.
fn check_readable(json: &[u8], data_len: u64) -> Result<()> {
    let refused = |reason: String| Error::InvalidValue {
        key: String::new(),
        reason,
    };
    if json.len() as u64 > MAX_HEADER_BYTES {
        return Err(refused(format!(
            "the header would be {} bytes, over the format's limit of {MAX_HEADER_BYTES}: \
             store long lists and strings as tensors",
            json.len()
        )));
    }
    let text = std::str::from_utf8(json).expect("the header is built from strings");
    let census = count_header(text)?;
    let file_len = 8 + json.len() as u64 + data_len;
    let cost = budget::load_cost(&census, data_len);
    if cost > budget::allowed(file_len) {
        return Err(refused(format!(
            "tensorferry would refuse to read the file back: {}; store many small values \
             as one tensor",
            budget::over_budget(&census, cost, file_len)
        )));
    }
    Ok(())
}
