//! The index of a sharded checkpoint (the Hugging Face layout): which shard holds each
//! tensor, and the keys tensorferry adds to its metadata (the tree record, the save that
//! wrote it, the files it replaced). Read and checked here, trusting nothing in it.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};
use crate::io::format::tree_meta::TREE_METADATA_KEY;
use crate::io::fs::file_kind::open_regular;

/// The suffix of an index file.
pub const INDEX_SUFFIX: &str = ".safetensors.index.json";

/// Largest index file read (a million tensor names fit in far less).
pub const MAX_INDEX_BYTES: u64 = 256 << 20;

/// The metadata key, in a sharded checkpoint's index, of the files of the checkpoint it
/// replaced: a save that dies after its commit leaves them, and the next save removes them.
pub(crate) const REPLACES_KEY: &str = "tensorferry.replaces";
/// The metadata key, in a sharded checkpoint's index and shards, of the save that wrote it.
pub(crate) const SAVE_ID_KEY: &str = "tensorferry.save";

/// A sharded checkpoint's index.
pub struct Index {
    /// Tensor name → shard file, sorted by name.
    pub weight_map: BTreeMap<String, String>,
    /// tensorferry's tree record, when tensorferry wrote the index.
    pub record: Option<String>,
    /// The save that wrote it, when tensorferry did (`SAVE_ID_KEY`).
    pub save_id: Option<String>,
    /// The files of the checkpoint it replaced (`REPLACES_KEY`), plain names only.
    pub replaces: Vec<String>,
}

impl Index {
    /// The tensor names it maps, sorted.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.weight_map.keys().map(String::as_str)
    }

    /// The shard files it names, each once, in order of first mention.
    pub(crate) fn files(&self) -> impl Iterator<Item = &str> {
        let mut seen = std::collections::HashSet::new();
        self.weight_map
            .values()
            .map(String::as_str)
            .filter(move |f| seen.insert(*f))
    }
}

/// Whether `file` is a plain file name (no folder, no `..`), as an index may name.
fn is_plain_name(file: &str) -> bool {
    let plain = Path::new(file)
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_)));
    plain && !file.contains('/') && !file.contains('\\') && !file.is_empty()
}

/// Whether `file` is a plain name of a safetensors file.
fn is_plain_shard_name(file: &str) -> bool {
    is_plain_name(file) && file.ends_with(".safetensors")
}

/// The text of an index whose `metadata` is `metadata`, naming `files[i]` for each of
/// `names[i]`.
pub(crate) fn index_bytes(
    metadata: &serde_json::Value,
    files: &[String],
    names: &[Vec<String>],
) -> Vec<u8> {
    let mut weight_map = BTreeMap::new();
    for (file, names) in files.iter().zip(names) {
        for name in names {
            weight_map.insert(name.as_str(), file.as_str());
        }
    }
    serde_json::to_vec_pretty(&serde_json::json!({
        "metadata": metadata,
        "weight_map": weight_map,
    }))
    .expect("an index always serialises")
}

/// Reads and checks the index at `path`: JSON of at most [`MAX_INDEX_BYTES`], in UTF-8,
/// whose shards are safetensors files in its own folder (an index naming an index, or a
/// path, is refused: loading never recurses).
pub(crate) fn read_index(path: &Path) -> Result<Index> {
    let (mut file, len) = open_regular(path)?;
    check_index_len(len, path)?;
    let mut bytes = Vec::with_capacity(len as usize);
    file.read_to_end(&mut bytes)
        .map_err(|e| Error::io("read", path, e))?;
    parse_index(&bytes, path)
}

/// Refuses an index of `len` bytes over [`MAX_INDEX_BYTES`].
pub(crate) fn check_index_len(len: u64, path: &Path) -> Result<()> {
    if len > MAX_INDEX_BYTES {
        return Err(Error::Format {
            at: format!("{path:?}"),
            reason: format!("an index of {len} bytes is over the {MAX_INDEX_BYTES}-byte limit"),
        });
    }
    Ok(())
}

/// Checks the index bytes read from `path` (a file or an object), as `read_index` does:
/// every reader of an index, Python's included, checks it here.
pub fn parse_index(bytes: &[u8], path: &Path) -> Result<Index> {
    let bad = |reason: String| Error::Format {
        at: format!("{path:?}"),
        reason,
    };
    let text = std::str::from_utf8(bytes)
        .map_err(|e| bad(format!("not a safetensors index: not UTF-8 text ({e})")))?;
    #[derive(serde::Deserialize)]
    struct Raw {
        #[serde(default)]
        metadata: Option<serde_json::Map<String, serde_json::Value>>,
        pub(crate) weight_map: BTreeMap<String, String>,
    }
    let raw: Raw =
        serde_json::from_str(text).map_err(|e| bad(format!("not a safetensors index: {e}")))?;
    let mut checked = std::collections::HashSet::new();
    for file in raw.weight_map.values() {
        if !checked.insert(file.as_str()) {
            continue;
        }
        if !is_plain_name(file) {
            return Err(bad(format!(
                "shard {file:?} is not a file name in the index's folder"
            )));
        }
        if file.ends_with(".json") {
            return Err(bad(format!(
                "shard {file:?} is an index, not a safetensors file: an index names only shards"
            )));
        }
    }
    let string = |key: &str| match raw.metadata.as_ref().and_then(|m| m.get(key)) {
        None => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("metadata.{key} must be a string"))),
    };
    let record = string(TREE_METADATA_KEY)?;
    let save_id = string(SAVE_ID_KEY)?;
    // Only a hint for the next save's clean-up: anything but plain shard names is ignored.
    let replaces = match raw.metadata.as_ref().and_then(|m| m.get(REPLACES_KEY)) {
        Some(serde_json::Value::Array(names)) => names
            .iter()
            .filter_map(|n| n.as_str())
            .filter(|n| is_plain_shard_name(n))
            .map(str::to_string)
            .collect(),
        _ => Vec::new(),
    };
    Ok(Index {
        weight_map: raw.weight_map,
        record,
        save_id,
        replaces,
    })
}
