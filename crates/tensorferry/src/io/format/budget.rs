//! How much memory reading a file may take, decided before anything is built.
//!
//! What a load builds from a header (names, shapes, strides, a tree of nodes) takes
//! several times the bytes of JSON that describe it, so a hostile header of a few
//! megabytes could make a load allocate hundreds. From the counts of [`super::header`],
//! [`load_cost`] bounds from above what a load allocates at its peak (the file's bytes
//! read into memory included), and a file whose cost is over [`allowed`] — four times its
//! size plus 4 MiB — is refused before anything is built. The writer checks the header it
//! builds the same way, so it never writes a file that tensorferry would refuse to read.

use std::mem::size_of;

use super::header::{HeaderCensus, TensorEntry};
use crate::error::{Error, Result};
use crate::tree::Node;

/// A load may allocate this many times the file's size…
pub(crate) const MEMORY_FACTOR: u64 = 4;
/// …plus this many bytes.
pub(crate) const MEMORY_SLACK: u64 = 4 << 20;

/// The most a load of a file of `file_len` bytes may allocate.
pub(crate) fn allowed(file_len: u64) -> u64 {
    MEMORY_FACTOR
        .saturating_mul(file_len)
        .saturating_add(MEMORY_SLACK)
}

/// An upper bound of the bytes a load of the header `census` counted allocates at its
/// peak, for a data section of `data_len` bytes; also bounds a header read.
pub(crate) fn load_cost(c: &HeaderCensus, data_len: u64) -> u64 {
    let word = size_of::<usize>() as u64;
    let string = size_of::<String>() as u64;
    let node = size_of::<Node>() as u64;
    let entry = size_of::<TensorEntry>() as u64;
    // A dict entry: the hash, key and node, and the index table's share: at most 16/7
    // slots of one word and one control byte per entry.
    let dict_entry = word + string + node + 3 * (word + 1);
    // A dict's smallest index table (8 slots and a group of control bytes), and rounding.
    let dict = 8 * (word + 1) + 32;
    // A metadata pair in a B-tree: two strings in a node at least 5/11 full, and the
    // share of its parents.
    let metadata_pair = 3 * 2 * string;
    let read = c.header_bytes + data_len + 3 * c.longest_string;
    // The entries, their names, and the references sorted to find duplicate names.
    let entries = c.entries * (entry + 2 * word) + c.name_bytes;
    // The shapes, the strides, and the longest shape's growth as it is read (its vector
    // and the one it grows into, at most three times its length together).
    let dims = 2 * word * c.dims + 2 * word * c.max_ndim;
    let metadata = c.metadata_pairs * metadata_pair + c.metadata_bytes;
    let tree = match &c.tree {
        Some(Ok(t)) => {
            t.dicts * dict
                + t.dict_entries * dict_entry
                + t.items * node
                + t.string_bytes
                + 3 * t.longest_string
                + 3 * 4 * (t.dicts + t.sequences)
                + c.entries
                + node
        }
        _ => dict + c.entries * dict_entry,
    };
    read + entries + dims + metadata + tree
}

/// Refuses the file whose header `census` counted if loading it could allocate more
/// than [`allowed`].
pub(crate) fn check(census: &HeaderCensus, data_len: u64) -> Result<()> {
    let file_len = 8 + census.header_bytes + data_len;
    let cost = load_cost(census, data_len);
    let limit = allowed(file_len);
    if cost <= limit {
        return Ok(());
    }
    Err(Error::format_at(8, over_budget(census, cost, file_len)))
}

/// Why a header is over budget, in words.
pub(crate) fn over_budget(c: &HeaderCensus, cost: u64, file_len: u64) -> String {
    let nodes = match &c.tree {
        Some(Ok(t)) => t.dict_entries + t.items,
        _ => 0,
    };
    format!(
        "the header describes {} tensors with {} dimensions in all, {} metadata entries and \
         a tree of {nodes} nodes: loading them could take {cost} bytes of memory, more than \
         {MEMORY_FACTOR} times the file's {file_len} bytes plus {MEMORY_SLACK}",
        c.entries, c.dims, c.metadata_pairs
    )
}
