//! What a safetensors header holds, once read: its tensor entries and metadata
//! ([`Header`]), and what it describes, counted before anything is built
//! ([`HeaderCensus`]). [`super::header_reader`] reads a header, [`super::header_writer`]
//! writes one.

use std::collections::BTreeMap;

use super::tree_census::TreeCensus;
use crate::dtype::DType;
use crate::error::Result;

/// One tensor described by a header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// The tensor's name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range inside the data section.
    pub begin: usize,
    /// End of the byte range (exclusive).
    pub end: usize,
}

/// A validated header.
#[derive(Clone, Debug, Default)]
pub struct Header {
    /// The tensors, in the order the header lists them.
    pub tensors: Vec<TensorEntry>,
    /// The `__metadata__` string map.
    pub metadata: BTreeMap<String, String>,
    /// File offset of the data section (8 + header length).
    pub data_start: u64,
}

/// What a header describes, counted.
#[derive(Debug, Default)]
pub(crate) struct HeaderCensus {
    /// Bytes of the header's JSON.
    pub(crate) header_bytes: u64,
    /// Tensor entries.
    pub(crate) entries: u64,
    /// Dimensions of all shapes together.
    pub(crate) dims: u64,
    /// Dimensions of the longest shape.
    pub(crate) max_ndim: u64,
    /// Bytes of all tensor names.
    pub(crate) name_bytes: u64,
    /// Entries of `__metadata__`.
    pub(crate) metadata_pairs: u64,
    /// Bytes of the keys and string values of `__metadata__`.
    pub(crate) metadata_bytes: u64,
    /// Bytes of the longest string the parse copies out.
    pub(crate) longest_string: u64,
    /// The recorded tree, counted, when `__metadata__` holds one (an error when it does not
    /// parse: the load reports it, a header read does not care).
    pub(crate) tree: Option<Result<TreeCensus>>,
}

impl HeaderCensus {
    /// Notes a string of `len` bytes.
    pub(crate) fn saw_string(&mut self, len: usize) {
        self.longest_string = self.longest_string.max(len as u64);
    }
}
