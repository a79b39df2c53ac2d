//! Turning a header's entries into tensors viewing one storage: all of them as a flat
//! dict, or one at a time by name, each once, for a recorded tree.

use std::sync::Arc;

use super::format::header::TensorEntry;
use super::format::tree_decode::TensorSource;
use super::format::tree_meta::{bad, shorten};
use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::tensor::Tensor;
use crate::tree::{Node, TensorDict};

/// The tensor an entry describes (`shape` taken out of it), viewing `storage` at
/// `base + begin`.
fn view(
    storage: &Arc<Storage>,
    base: usize,
    entry: &TensorEntry,
    shape: Vec<usize>,
) -> Result<Tensor> {
    Tensor::contiguous_view(storage.clone(), base + entry.begin, entry.dtype, shape)
        .map_err(|err| Error::format_in(&shorten(&entry.name), err.to_string()))
}

/// The entries as a dict of tensors in header order (names are unique: the header was
/// validated), reserved once at its exact size.
pub(crate) fn flat_dict(
    entries: Vec<TensorEntry>,
    storage: &Arc<Storage>,
    base: usize,
) -> Result<TensorDict> {
    let mut dict = TensorDict::with_capacity(entries.len());
    for mut entry in entries {
        let shape = std::mem::take(&mut entry.shape);
        let t = view(storage, base, &entry, shape)?;
        let fresh = dict.insert_new(entry.name.into(), Node::Tensor(t));
        debug_assert!(fresh, "a validated header names each tensor once");
    }
    Ok(dict)
}

/// The entries, handed out as tensors by name, each once. A record lists its tensors in
/// the order the writer laid them out, so the entry after the last one taken is tried
/// first; other names are found through an index sorted by name, built on first need.
pub(crate) struct Pool {
    entries: Vec<TensorEntry>,
    taken: Vec<bool>,
    /// The entry tried first by the next [`TensorSource::take`].
    next: usize,
    /// Entry indexes sorted by name, once a name was not where expected.
    sorted: Option<Vec<usize>>,
    storage: Arc<Storage>,
    base: usize,
}

impl Pool {
    /// A pool of `entries` (unique names) viewing `storage` at `base`.
    pub(crate) fn new(entries: Vec<TensorEntry>, storage: Arc<Storage>, base: usize) -> Self {
        Pool {
            taken: vec![false; entries.len()],
            entries,
            next: 0,
            sorted: None,
            storage,
            base,
        }
    }

    /// Fails when a tensor was never taken: a file's tensors must all be in its tree.
    pub(crate) fn check_all_taken(&self) -> Result<()> {
        match self.taken.iter().position(|t| !t) {
            None => Ok(()),
            Some(i) => Err(bad(format!(
                "tensor {:?} is in the file but not in the recorded tree",
                shorten(&self.entries[i].name)
            ))),
        }
    }

    /// The index of the entry named `name`, if any.
    fn find(&mut self, name: &str) -> Option<usize> {
        if self.entries.get(self.next).is_some_and(|e| e.name == name) {
            return Some(self.next);
        }
        let entries = &self.entries;
        let sorted = self.sorted.get_or_insert_with(|| {
            let mut order: Vec<usize> = (0..entries.len()).collect();
            order.sort_unstable_by(|&a, &b| entries[a].name.cmp(&entries[b].name));
            order
        });
        sorted
            .binary_search_by(|&i| entries[i].name.as_str().cmp(name))
            .ok()
            .map(|at| sorted[at])
    }
}

impl TensorSource for Pool {
    fn take(&mut self, name: &str) -> Result<Tensor> {
        let Some(i) = self.find(name).filter(|&i| !self.taken[i]) else {
            return Err(bad(format!(
                "tree refers to tensor {:?}, which the file lacks or uses twice",
                shorten(name)
            )));
        };
        self.taken[i] = true;
        self.next = i + 1;
        let shape = std::mem::take(&mut self.entries[i].shape);
        view(&self.storage, self.base, &self.entries[i], shape)
    }
}
