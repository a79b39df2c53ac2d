//! Reading safetensors files: validated headers, then zero-copy views of a memory map
//! or one read into fresh aligned memory. Never allocates more than the file's size.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use super::header::{header_len, parse_header, Header};
use super::{tree_meta, TREE_METADATA_KEY};
use crate::error::{Error, Result};
use crate::memory::AlignedBuffer;
use crate::storage::Storage;
use crate::tensor::Tensor;
use crate::tree::{Node, TensorDict};

/// How to load.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// Map the file and hand out read-only views of it (cost proportional to the header),
    /// instead of reading it into fresh memory. Default true.
    pub mmap: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { mmap: true }
    }
}

/// What a file holds.
#[derive(Debug)]
pub struct Loaded {
    /// The tree as saved (or a flat dict of names for files tensorferry did not write).
    pub root: Node,
    /// The user metadata, without tensorferry's reserved key.
    pub metadata: BTreeMap<String, String>,
}

/// Loads a file whose root is a dictionary (every file of other tools is).
pub fn load(
    path: impl AsRef<Path>,
    options: LoadOptions,
) -> Result<(TensorDict, BTreeMap<String, String>)> {
    let loaded = load_node(path, options)?;
    match loaded.root {
        Node::Dict(d) => Ok((d, loaded.metadata)),
        _ => Err(Error::InvalidValue {
            key: String::new(),
            reason: "the file holds a list or tuple at its root; use load_node".into(),
        }),
    }
}

/// Loads the tree saved in the file at `path`.
pub fn load_node(path: impl AsRef<Path>, options: LoadOptions) -> Result<Loaded> {
    let path = path.as_ref();
    let (mut file, file_len) = open(path)?;
    let (header, storage, base) = if options.mmap {
        map_file(&file, path, file_len)?
    } else {
        read_file(&mut file, path, file_len)?
    };
    build(header, storage, base)
}

/// Reads and validates only the header of the file at `path` (cost proportional to it).
pub fn read_header(path: impl AsRef<Path>) -> Result<Header> {
    let path = path.as_ref();
    let (mut file, file_len) = open(path)?;
    header_of(&mut file, path, file_len)
}

/// The file and its length.
fn open(path: &Path) -> Result<(File, u64)> {
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    Ok((file, len))
}

/// Reads and validates the header at the start of `file`, leaving the file positioned at
/// the data section.
fn header_of(file: &mut File, path: &Path, file_len: u64) -> Result<Header> {
    let mut prefix = [0u8; 8];
    if file_len >= 8 {
        file.read_exact(&mut prefix)
            .map_err(|e| Error::io("read", path, e))?;
    }
    let n = header_len(&prefix, file_len)?;
    let mut header_bytes = vec![0u8; n as usize];
    file.read_exact(&mut header_bytes)
        .map_err(|e| Error::io("read", path, e))?;
    parse_header(&header_bytes, file_len - 8 - n)
}

/// Loads from bytes in memory (copied into aligned memory first); the same validation
/// as files. For data that never touched a disk, and for fuzzing the reader.
pub fn load_bytes(bytes: &[u8]) -> Result<Loaded> {
    let n = header_len(bytes, bytes.len() as u64)?;
    let data_start = 8 + n as usize;
    let header = parse_header(&bytes[8..data_start], (bytes.len() - data_start) as u64)?;
    let data = AlignedBuffer::copy_from(&bytes[data_start..])?;
    build(header, Arc::new(Storage::Owned(data)), 0)
}

/// Maps the file; tensors view the map at `data_start + begin`.
fn map_file(file: &File, path: &Path, file_len: u64) -> Result<(Header, Arc<Storage>, usize)> {
    if file_len < 8 {
        header_len(&[], file_len)?;
    }
    // SAFETY: the map is read-only. Like every memory map it assumes nobody truncates or
    // rewrites the file while it is mapped; tensorferry's own writes replace files by
    // rename, which leaves an existing map of the old file valid.
    let map = unsafe { Mmap::map(file) }.map_err(|e| Error::io("map", path, e))?;
    let n = header_len(&map[..8], map.len() as u64)?;
    let data_start = 8 + n as usize;
    let header = parse_header(&map[8..data_start], (map.len() - data_start) as u64)?;
    Ok((header, Arc::new(Storage::Mapped(map)), data_start))
}

/// Reads the header, then the data section in one read into aligned memory.
fn read_file(file: &mut File, path: &Path, file_len: u64) -> Result<(Header, Arc<Storage>, usize)> {
    let header = header_of(file, path, file_len)?;
    let data_len = file_len - header.data_start;
    let mut data = AlignedBuffer::zeroed(data_len as usize)?;
    file.read_exact(data.as_mut_slice())
        .map_err(|e| Error::io("read", path, e))?;
    Ok((header, Arc::new(Storage::Owned(data)), 0))
}

fn build(header: Header, storage: Arc<Storage>, base: usize) -> Result<Loaded> {
    let mut metadata = header.metadata;
    let recorded = metadata.remove(TREE_METADATA_KEY);
    let mut views = Vec::with_capacity(header.tensors.len());
    for e in header.tensors {
        let t = Tensor::contiguous_view(storage.clone(), base + e.begin, e.dtype, e.shape)
            .map_err(|err| Error::format_in(&e.name, err.to_string()))?;
        views.push((e.name, t));
    }
    let root = match recorded {
        Some(text) => tree_meta::decode(&text, views.into_iter().collect::<HashMap<_, _>>())?,
        None => Node::Dict(
            views
                .into_iter()
                .map(|(name, t)| (name, Node::Tensor(t)))
                .collect(),
        ),
    };
    Ok(Loaded { root, metadata })
}
