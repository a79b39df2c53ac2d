//! Writing safetensors files: straight from the tensors' memory, atomically (see
//! [`super::replace`]). Tensors on a device stream through a ring of pinned buffers into
//! the file ([`SaveOptions::staging`]): host memory stays bounded by the ring, and the
//! device copies the next chunks while this one is written.
//!
//! Everything tensorferry's reader or the official one would refuse is refused here,
//! before the file is touched: a tensor named `__metadata__`, two paths giving one name,
//! a dtype the format lacks, a tree nested too deep, a header over the format's size
//! limit, or one that would take a load more memory than [`super::budget`] allows.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;

use super::format::header::HeaderCensus;
use super::format::header_reader::MAX_HEADER_BYTES;
use super::format::tree_meta::TREE_METADATA_KEY;
use super::format::{budget, header_writer, tree_meta};
use super::fs::gather_write::GatherWriter;
use super::fs::replace::{stage, Staged};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::transfer::{staging::Ring, stream_to_sink, Staging};
use crate::tree::{KeyPath, Node};

/// How to save.
///
/// ```
/// use tensorferry::SaveOptions;
///
/// let mut options = SaveOptions { fsync: false, ..Default::default() };
/// options.metadata.insert("author".into(), "me".into());
/// ```
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// User metadata (string to string), stored in `__metadata__` beside tensorferry's key.
    pub metadata: BTreeMap<String, String>,
    /// Flush the file and its folder to stable storage before returning (default true).
    pub fsync: bool,
    /// How tensors on a device reach the file. `Auto` (the default) streams them through
    /// a ring of [`crate::transfer::staging::AUTO_DEPTH`] pinned buffers of
    /// [`crate::transfer::staging::AUTO_CHUNK_BYTES`] (host memory bounded by the ring,
    /// whatever their size); `Ring` sets the ring; `Off` copies them to host memory
    /// whole first (host memory the size of the tensors).
    pub staging: Staging,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            metadata: BTreeMap::new(),
            fsync: true,
            staging: Staging::Auto,
        }
    }
}

/// The bytes a save of `root` writes before the tensors' data: the 8-byte length and the
/// JSON header, padded so data starts 64-byte aligned. Refuses what [`crate::save`] refuses
/// before touching a file.
pub fn header_bytes(root: &Node, options: &SaveOptions) -> Result<Vec<u8>> {
    check_root(root, options)?;
    let walked = header_writer::walk_node(root);
    header_writer::check_names(&walked, || {
        root.tensors().into_iter().map(|(p, _)| p).collect()
    })?;
    checked_header(&walked, options).map(|built| built.bytes)
}

/// The bytes before the data and the tensors in file order, refused as [`stage_walked`]
/// refuses: for writers other than files (object storage). As for files, device tensors
/// stay where they are when `options.staging` names a ring (the writer streams them
/// through it), and are copied to the host in one planned transfer otherwise.
pub(crate) fn header_and_tensors(
    walked: header_writer::Walked<'_>,
    paths: impl FnOnce() -> Vec<KeyPath>,
    options: &SaveOptions,
) -> Result<(Vec<u8>, Vec<Tensor>)> {
    header_writer::check_names(&walked, paths)?;
    let built = checked_header(&walked, options)?;
    let hosted = match options.staging.ring_for_stream() {
        Some(_) => None,
        None => on_host(&walked.tensors)?,
    };
    let host = |i: usize| hosted.as_ref().map_or(walked.tensors[i], |h| &h[i]).clone();
    Ok((built.bytes, built.order.iter().map(|&i| host(i)).collect()))
}

/// Saves `root` into a temporary file that will replace `path` once committed.
pub(crate) fn stage_node(root: &Node, path: &Path, options: &SaveOptions) -> Result<Staged> {
    check_root(root, options)?;
    stage_walked(
        header_writer::walk_node(root),
        || root.tensors().into_iter().map(|(p, _)| p).collect(),
        path,
        options,
    )
}

/// Checks the names of a walked tree, builds its header and writes it into a temporary
/// file that will replace `path`.
pub(crate) fn stage_walked(
    walked: header_writer::Walked<'_>,
    paths: impl FnOnce() -> Vec<KeyPath>,
    path: &Path,
    options: &SaveOptions,
) -> Result<Staged> {
    header_writer::check_names(&walked, paths)?;
    let built = checked_header(&walked, options)?;
    let ring = options.staging.ring_for_stream();
    // Same dtypes and shapes: the header holds for the host copies.
    let hosted = match ring {
        Some(_) => None,
        None => on_host(&walked.tensors)?,
    };
    let tensors: Vec<&Tensor> = match &hosted {
        Some(copies) => copies.iter().collect(),
        None => walked.tensors,
    };
    let ordered: Vec<&Tensor> = built.order.iter().map(|&i| tensors[i]).collect();
    stage(path, options.fsync, |out| {
        let io = |e| Error::io("write", path, e);
        out.write_all(&built.bytes).map_err(io)?;
        out.flush().map_err(io)?;
        write_data(out.get_mut(), &ordered, ring, path)
    })
}

/// Writes the tensors' bytes in order: host memory straight from the tensors, many runs
/// per system call; each stretch of tensors on one device through `ring`.
fn write_data(file: &mut File, tensors: &[&Tensor], ring: Option<Ring>, path: &Path) -> Result<()> {
    let io = |e| Error::io("write", path, e);
    for (device, stretch) in device_stretches(tensors) {
        match ring {
            Some(ring) if !device.is_host() => stream_to_sink(device, stretch, ring, |bytes| {
                file.write_all(bytes).map_err(io)
            })?,
            _ => {
                let mut gather = GatherWriter::new(&mut *file);
                for t in stretch {
                    t.for_each_host_run(|run| gather.push(run).map_err(io))?;
                }
                gather.finish().map_err(io)?;
            }
        }
    }
    Ok(())
}

/// `tensors` cut into stretches of consecutive tensors on one device, in order.
pub(crate) fn device_stretches<T: std::borrow::Borrow<Tensor>>(
    tensors: &[T],
) -> impl Iterator<Item = (crate::device::Device, &[T])> {
    let mut rest = tensors;
    std::iter::from_fn(move || {
        let device = rest.first()?.borrow().device();
        let n = rest
            .iter()
            .take_while(|t| t.borrow().device() == device)
            .count();
        let (stretch, after) = rest.split_at(n);
        rest = after;
        Some((device, stretch))
    })
}

fn check_options(options: &SaveOptions) -> Result<()> {
    if options.metadata.contains_key(TREE_METADATA_KEY) {
        return Err(Error::InvalidValue {
            key: format!("metadata/{TREE_METADATA_KEY}"),
            reason: "this metadata key is reserved for tensorferry".into(),
        });
    }
    options.staging.validate().map(|_| ())
}

pub(crate) fn check_root(root: &Node, options: &SaveOptions) -> Result<()> {
    if matches!(root, Node::Tensor(_) | Node::Value(_)) {
        return Err(Error::InvalidValue {
            key: String::new(),
            reason: "the object to save must be a dict, list or tuple".into(),
        });
    }
    check_options(options)?;
    check_depth(root, 0)
}

/// The header of a walked tree, refused when over the format's limit or when a load of
/// the file would take more memory than [`budget`] allows.
fn checked_header(
    walked: &header_writer::Walked<'_>,
    options: &SaveOptions,
) -> Result<header_writer::Built> {
    let built = header_writer::build(walked, &options.metadata);
    let data_len = walked.tensors.iter().map(|t| t.nbytes() as u64).sum();
    check_readable(&built.census, data_len)?;
    Ok(built)
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

/// Host copies of the tensors when any is on a device, in one planned transfer; `None`
/// when all are on the host already (nothing is copied or cloned).
fn on_host(tensors: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    if tensors.iter().all(|t| t.device().is_host()) {
        return Ok(None);
    }
    crate::transfer::move_tensors(tensors, crate::device::Device::Cpu, Default::default()).map(Some)
}

/// Refuses a header that a reader would refuse for its size alone (its census counted
/// while it was written), given the `data_len` bytes after it.
fn check_readable(census: &HeaderCensus, data_len: u64) -> Result<()> {
    let refused = |reason: String| Error::InvalidValue {
        key: String::new(),
        reason,
    };
    let json_len = census.header_bytes;
    if json_len > MAX_HEADER_BYTES {
        return Err(refused(format!(
            "the header would be {json_len} bytes, over the format's limit of {MAX_HEADER_BYTES}: \
             store long lists and strings as tensors"
        )));
    }
    let file_len = 8 + json_len + data_len;
    let cost = budget::load_cost(census, data_len);
    if cost > budget::allowed(file_len) {
        return Err(refused(format!(
            "tensorferry would refuse to read the file back: {}; store many small values \
             as one tensor",
            budget::over_budget(census, cost, file_len)
        )));
    }
    Ok(())
}
