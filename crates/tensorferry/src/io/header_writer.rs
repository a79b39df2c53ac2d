//! Building a header in one pass over the tree, into one buffer, counting on the way what
//! [`super::census`] would count if it parsed the result.
//!
//! The walk gathers each tensor's dotted name into one string (no key path or name is
//! allocated per tensor), writes the tree record as it goes, and the entries are then
//! written by hand. The counts feed [`super::budget`] directly, so the writer refuses a
//! header the reader would refuse without parsing its own output; debug builds parse it
//! anyway and check that the counts agree.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use super::census::HeaderCensus;
use super::name_hash::NameHasher;
use super::scan::special_from;
use super::tree_census::TreeCensus;
use super::tree_meta::FORMAT_VERSION;
use super::TREE_METADATA_KEY;
use crate::error::{Error, Result};
use crate::memory::HOST_ALIGNMENT;
use crate::tensor::Tensor;
use crate::tree::{KeyPath, Node, TensorDict, Value};

/// The tensors of a tree in tree order, their dotted names, and the tree record.
pub(crate) struct Walked<'a> {
    /// The tensors, in tree order.
    pub(crate) tensors: Vec<&'a Tensor>,
    /// All dotted names, one after another.
    names: String,
    /// Where each name ends in `names`.
    ends: Vec<usize>,
    /// The tree record (JSON), as [`super::tree_meta`] describes it.
    record: Vec<u8>,
    /// The record's counts, as [`super::tree_census`] would take them.
    tree: TreeCensus,
    /// The tree is a dict of tensors only: a file listing them in its order reads back as
    /// it without a record, and its names are the dict's keys (unique).
    flat: bool,
}

impl Walked<'_> {
    /// The tree record (JSON), as [`super::tree_meta`] describes it.
    pub(crate) fn record(&self) -> &str {
        std::str::from_utf8(&self.record).expect("the record is written from UTF-8 text")
    }

    /// The dotted name of tensor `i`.
    pub(crate) fn name(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.names[start..self.ends[i]]
    }
}

/// Walks a dict at the root for one file (no record written for a flat dict, which the
/// file does not carry).
pub(crate) fn walk_dict(dict: &TensorDict) -> Walked<'_> {
    let flat = flat_dict(dict);
    walk(flat, !flat, |w| w.dict(dict))
}

/// Walks any node at the root for one file, as [`walk_dict`] does.
pub(crate) fn walk_node(node: &Node) -> Walked<'_> {
    let flat = node.as_dict().is_some_and(flat_dict);
    walk(flat, !flat, |w| w.node(node))
}

/// Walks any node at the root, always writing its record (an index of shards keeps it).
pub(crate) fn walk_node_recorded(node: &Node) -> Walked<'_> {
    walk(node.as_dict().is_some_and(flat_dict), true, |w| {
        w.node(node)
    })
}

/// Whether `dict` holds tensors only.
fn flat_dict(dict: &TensorDict) -> bool {
    dict.iter().all(|(_, node)| matches!(node, Node::Tensor(_)))
}

/// Walks the tree `tree` walks, the root `flat` or not; with `recording`, inside the
/// record's envelope.
fn walk<'a>(flat: bool, recording: bool, tree: impl FnOnce(&mut Walker<'a>)) -> Walked<'a> {
    let mut w = Walker {
        recording,
        ..Walker::default()
    };
    if recording {
        w.record.extend_from_slice(b"{\"format\":");
        push_u64(&mut w.record, FORMAT_VERSION);
        w.record.extend_from_slice(b",\"tree\":");
    }
    tree(&mut w);
    if recording {
        w.record.push(b'}');
    }
    w.finish(flat)
}

#[derive(Default)]
struct Walker<'a> {
    tensors: Vec<&'a Tensor>,
    names: String,
    ends: Vec<usize>,
    /// The dotted path of the node being visited.
    path: String,
    record: Vec<u8>,
    /// Whether the record is written (not for a flat dict's single file).
    recording: bool,
    tree: TreeCensus,
}

impl<'a> Walker<'a> {
    fn finish(self, flat: bool) -> Walked<'a> {
        Walked {
            tensors: self.tensors,
            names: self.names,
            ends: self.ends,
            record: self.record,
            tree: self.tree,
            flat,
        }
    }

    /// Appends `key` to the path; returns the length to truncate back to.
    fn enter(&mut self, key: impl std::fmt::Display) -> usize {
        let back = self.path.len();
        if back > 0 {
            self.path.push('.');
        }
        write!(self.path, "{key}").expect("writing to a String");
        back
    }

    fn saw_string(&mut self, len: usize) {
        self.tree.longest_string = self.tree.longest_string.max(len as u64);
    }

    fn dict(&mut self, d: &'a TensorDict) {
        if self.recording {
            self.record.extend_from_slice(b"{\"dict\":[");
        }
        for (i, (k, v)) in d.iter().enumerate() {
            if self.recording {
                if i > 0 {
                    self.record.push(b',');
                }
                self.record.push(b'[');
                push_json_str(&mut self.record, k);
                self.record.push(b',');
                self.saw_string(k.len());
                self.tree.string_bytes += k.len() as u64;
            }
            let back = self.enter(k);
            self.node(v);
            self.path.truncate(back);
            if self.recording {
                self.record.push(b']');
            }
        }
        if self.recording {
            self.record.extend_from_slice(b"]}");
        }
        self.tree.dicts += 1;
        self.tree.dict_entries += d.len() as u64;
    }

    fn items(&mut self, kind: &[u8], items: &'a [Node]) {
        self.record.extend_from_slice(kind);
        for (i, v) in items.iter().enumerate() {
            if i > 0 {
                self.record.push(b',');
            }
            let back = self.enter(i);
            self.node(v);
            self.path.truncate(back);
        }
        self.record.extend_from_slice(b"]}");
        self.tree.sequences += 1;
        self.tree.items += items.len() as u64;
    }

    fn node(&mut self, node: &'a Node) {
        match node {
            Node::Dict(d) => self.dict(d),
            Node::List(items) => self.items(b"{\"list\":[", items),
            Node::Tuple(items) => self.items(b"{\"tuple\":[", items),
            Node::Tensor(t) => {
                self.tensors.push(t);
                self.names.push_str(&self.path);
                self.ends.push(self.names.len());
                if !self.recording {
                    return;
                }
                self.record.extend_from_slice(b"{\"tensor\":");
                push_json_str(&mut self.record, &self.path);
                self.record.push(b'}');
                self.saw_string(self.path.len());
            }
            Node::Value(v) => self.value(v),
        }
    }

    fn value(&mut self, v: &Value) {
        let r = &mut self.record;
        match v {
            Value::None => r.extend_from_slice(b"{\"none\":null}"),
            Value::Bool(b) => {
                r.extend_from_slice(if *b {
                    b"{\"bool\":true}"
                } else {
                    b"{\"bool\":false}"
                });
            }
            Value::Int(i) => {
                r.extend_from_slice(b"{\"int\":");
                serde_json::to_writer(&mut *r, i).expect("writing to a Vec");
                r.push(b'}');
            }
            Value::Float(x) => {
                r.extend_from_slice(b"{\"float\":");
                if x.is_nan() {
                    r.extend_from_slice(b"\"nan\"");
                } else if x.is_infinite() {
                    r.extend_from_slice(if *x > 0.0 { b"\"inf\"" } else { b"\"-inf\"" });
                } else {
                    serde_json::to_writer(&mut *r, x).expect("writing to a Vec");
                }
                r.push(b'}');
            }
            Value::Str(s) => {
                r.extend_from_slice(b"{\"str\":");
                push_json_str(r, s);
                r.push(b'}');
                self.saw_string(s.len());
                self.tree.string_bytes += s.len() as u64;
            }
        }
    }
}

/// Appends `s` as a JSON string, escaped as `serde_json` escapes it.
fn push_json_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    let mut at = 0;
    loop {
        // Plain runs found eight bytes at a time and copied whole.
        let end = special_from(bytes, at);
        out.extend_from_slice(&bytes[at..end]);
        let Some(&b) = bytes.get(end) else {
            break;
        };
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            _ => out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[(b >> 4) as usize],
                HEX[(b & 0xf) as usize],
            ]),
        }
        at = end + 1;
    }
    out.push(b'"');
}

type NameSet<'a> = HashMap<&'a str, usize, std::hash::BuildHasherDefault<NameHasher>>;

/// Appends `n` in decimal.
fn push_u64(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// Refuses tensors whose dtype the format lacks, a tensor named `__metadata__` and two
/// paths giving one name; `paths` recomputes the key paths for the message.
pub(crate) fn check_names(walked: &Walked<'_>, paths: impl FnOnce() -> Vec<KeyPath>) -> Result<()> {
    let n = walked.tensors.len();
    let bad_dtype = walked
        .tensors
        .iter()
        .position(|t| t.dtype().safetensors_code().is_none());
    let reserved = (0..n).find(|&i| walked.name(i) == "__metadata__");
    let mut collision = None;
    // A flat dict's names are its keys: unique already.
    if !walked.flat {
        let mut seen = NameSet::with_capacity_and_hasher(n, Default::default());
        for i in 0..n {
            if let Some(first) = seen.insert(walked.name(i), i) {
                collision = Some((first, i));
                break;
            }
        }
    }
    // The first fault in tree order, as a check tensor by tensor reports it.
    let first_fault = [bad_dtype, reserved, collision.map(|(_, second)| second)]
        .into_iter()
        .flatten()
        .min();
    let Some(at) = first_fault else {
        return Ok(());
    };
    let paths = paths();
    if bad_dtype == Some(at) {
        let t = walked.tensors[at];
        return Err(Error::UnsupportedDType {
            key: paths[at].to_string(),
            dtype: t.dtype().to_string(),
            reason: "the safetensors format has no code for it".into(),
        });
    }
    if reserved == Some(at) {
        return Err(Error::InvalidValue {
            key: paths[at].to_string(),
            reason: "a tensor named \"__metadata__\" cannot be stored: safetensors \
                     reserves the name for the metadata, and no reader would read the file"
                .into(),
        });
    }
    let (first, second) = collision.expect("the remaining fault");
    Err(Error::NameCollision {
        name: walked.name(second).to_string(),
        first: paths[first].to_string(),
        second: paths[second].to_string(),
    })
}

/// The header built from `walked`, and its census.
pub(crate) struct Built {
    /// The 8-byte length and the JSON, padded with spaces so data starts 64-byte aligned.
    pub(crate) bytes: Vec<u8>,
    /// What [`super::census::count_header`] counts in it.
    pub(crate) census: HeaderCensus,
    /// The order in which the tensors' bytes follow the header (indexes into the walk).
    pub(crate) order: Vec<usize>,
}

/// Builds the header of `walked` with the user metadata `user` (names checked).
pub(crate) fn build(walked: &Walked<'_>, user: &BTreeMap<String, String>) -> Built {
    let record = std::str::from_utf8(&walked.record).expect("the record is built from strings");
    let mut census = HeaderCensus {
        entries: walked.tensors.len() as u64,
        // "__metadata__" and "data_offsets" are keys the census measures too.
        longest_string: 12,
        ..HeaderCensus::default()
    };
    let mut order: Vec<usize> = (0..walked.tensors.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(walked.tensors[i].dtype().size()));
    let recorded = !walked.flat;
    let mut json = Vec::with_capacity(64 + record.len() * 2 + walked.names.len() * 2);
    json.extend_from_slice(b"{\"__metadata__\":{");
    let mut pairs: Vec<(&str, &str)> = user.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    if recorded {
        let at = pairs.partition_point(|(k, _)| *k < TREE_METADATA_KEY);
        pairs.insert(at, (TREE_METADATA_KEY, record));
    }
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            json.push(b',');
        }
        push_json_str(&mut json, k);
        json.push(b':');
        push_json_str(&mut json, v);
        census.metadata_pairs += 1;
        census.metadata_bytes += (k.len() + v.len()) as u64;
        census.longest_string = census.longest_string.max(k.len().max(v.len()) as u64);
    }
    json.push(b'}');
    // The bytes follow `order`; a flat dict lists its entries in its own order (readers
    // take each tensor at its offsets, whatever the listing's order), so it reads back
    // in that order without a record.
    let mut begins = vec![0u64; order.len()];
    let mut end_of_data = 0u64;
    for &i in &order {
        begins[i] = end_of_data;
        end_of_data += walked.tensors[i].nbytes() as u64;
    }
    let listed: Box<dyn Iterator<Item = usize>> = if recorded {
        Box::new(order.iter().copied())
    } else {
        Box::new(0..order.len())
    };
    for i in listed {
        let t = walked.tensors[i];
        let name = walked.name(i);
        let code = t.dtype().safetensors_code().expect("checked");
        json.push(b',');
        push_json_str(&mut json, name);
        json.extend_from_slice(b":{\"dtype\":\"");
        json.extend_from_slice(code.as_bytes());
        json.extend_from_slice(b"\",\"shape\":[");
        for (d, &n) in t.shape().iter().enumerate() {
            if d > 0 {
                json.push(b',');
            }
            push_u64(&mut json, n as u64);
        }
        let begin = begins[i];
        json.extend_from_slice(b"],\"data_offsets\":[");
        push_u64(&mut json, begin);
        json.push(b',');
        push_u64(&mut json, begin + t.nbytes() as u64);
        json.extend_from_slice(b"]}");
        let ndim = t.shape().len() as u64;
        census.dims += ndim;
        census.max_ndim = census.max_ndim.max(ndim);
        census.name_bytes += name.len() as u64;
        census.longest_string = census.longest_string.max(name.len().max(code.len()) as u64);
    }
    json.push(b'}');
    let padded = (8 + json.len()).next_multiple_of(HOST_ALIGNMENT) - 8;
    let mut bytes = Vec::with_capacity(8 + padded);
    bytes.extend_from_slice(&(padded as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    bytes.resize(8 + padded, b' ');
    census.header_bytes = padded as u64;
    census.tree = recorded.then(|| {
        Ok(TreeCensus {
            dicts: walked.tree.dicts,
            dict_entries: walked.tree.dict_entries,
            sequences: walked.tree.sequences,
            items: walked.tree.items,
            string_bytes: walked.tree.string_bytes,
            longest_string: walked.tree.longest_string,
            lengths: Vec::new(),
            fast: false,
        })
    });
    #[cfg(debug_assertions)]
    check_census(&bytes[8..], &census);
    Built {
        bytes,
        census,
        order,
    }
}

/// Debug builds: the counts taken while writing are those a parse of the header takes.
#[cfg(debug_assertions)]
fn check_census(json: &[u8], built: &HeaderCensus) {
    let text = std::str::from_utf8(json).expect("the header is built from strings");
    let parsed = super::census::count_header(text).expect("the writer writes valid JSON");
    let counts = |c: &HeaderCensus| {
        let tree = match &c.tree {
            Some(Ok(t)) => Some((
                t.dicts,
                t.dict_entries,
                t.sequences,
                t.items,
                t.string_bytes,
                t.longest_string,
            )),
            _ => None,
        };
        (
            (c.header_bytes, c.entries, c.dims, c.max_ndim, c.name_bytes),
            (c.metadata_pairs, c.metadata_bytes, c.longest_string),
            tree,
        )
    };
    assert_eq!(counts(built), counts(&parsed), "header census");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped_exactly_as_serde_json_escapes_them() {
        for s in [
            "",
            "plain",
            "a\"b\\c",
            "\n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f}",
            "é∂😀\"x",
        ] {
            let mut out = Vec::new();
            push_json_str(&mut out, s);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                serde_json::to_string(s).unwrap()
            );
        }
        // Every special character at every position of strings longer than a word.
        for special in ['"', '\\', '\n', '\u{1}', '\u{1f}', ' ', '\u{7f}', 'é'] {
            for len in 1..20 {
                for at in 0..len {
                    let s: String = (0..len)
                        .map(|i| if i == at { special } else { 'x' })
                        .collect();
                    let mut out = Vec::new();
                    push_json_str(&mut out, &s);
                    assert_eq!(out, serde_json::to_vec(&s).unwrap(), "{s:?}");
                }
            }
        }
    }

    #[test]
    fn numbers_are_written_in_decimal() {
        for n in [0u64, 7, 10, 1234567890, u64::MAX] {
            let mut out = Vec::new();
            push_u64(&mut out, n);
            assert_eq!(String::from_utf8(out).unwrap(), n.to_string());
        }
    }
}
