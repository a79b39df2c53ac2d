//! Building a header in one pass over the tree, into one buffer, counting on the way what
//! [`super::header`] counts when it reads the result.
//!
//! The walk gathers each tensor's dotted name into one string (no key path or name is
//! allocated per tensor), writes the tree record as it goes, and the entries are then
//! written by hand. The counts feed [`super::budget`] directly, so the writer refuses a
//! header the reader would refuse without parsing its own output; debug builds parse it
//! anyway and check that the counts agree.
//!
//! A tensor given under several keys (the same memory, dtype, shape and strides: tied
//! weights) is written once, under its first name in tree order, and its other places
//! are recorded as aliases of that name ([`super::tree_meta`]), so a load gives one tensor
//! in every place; tensors whose memory overlaps without being the same tensor are
//! refused, as a file cannot keep the overlap.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use super::header::HeaderCensus;
use super::tree_census::TreeCensus;
use super::tree_meta::TREE_METADATA_KEY;
use super::tree_meta::{FORMAT_VERSION, FORMAT_VERSION_NEWEST};
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
    /// The tree-order index of each walked tensor, when some tensors of the tree are
    /// aliases (not walked); empty when the two orders are one.
    tree_index: Vec<u32>,
    /// Two tensors of the tree (tree-order indexes) whose memory overlaps without their
    /// being the same tensor.
    overlap: Option<(usize, usize)>,
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

    /// The tree-order index of walked tensor `i` (the index into the tree's key paths).
    fn tree_index(&self, i: usize) -> usize {
        self.tree_index.get(i).map_or(i, |&k| k as usize)
    }
}

/// Walks the tree at the root of one file (no record written for a flat dict, which the
/// file does not carry).
pub(crate) fn walk_node(node: &Node) -> Walked<'_> {
    walk(node, false)
}

/// Walks any node at the root, always writing its record (an index of shards keeps it).
pub(crate) fn walk_node_recorded(node: &Node) -> Walked<'_> {
    walk(node, true)
}

/// Whether `dict` holds tensors only, under string keys (a file without a record reads
/// back with string keys).
fn flat_dict(dict: &TensorDict) -> bool {
    dict.iter_keyed()
        .all(|(key, node)| matches!(node, Node::Tensor(_)) && !key.is_int())
}

/// Where the record's envelope writes its format version (one digit).
const VERSION_AT: usize = b"{\"format\":".len();

/// Walks the tree at `node`; its record is written, inside the record's envelope and
/// marked format 2 when it holds an integer key or an alias, unless the tree is a flat
/// dict and not `always_recorded`.
fn walk(node: &Node, always_recorded: bool) -> Walked<'_> {
    let refs = node.tensor_refs();
    let sharing = Sharing::of(&refs);
    let flat = node.as_dict().is_some_and(flat_dict) && sharing.is_none();
    let recording = always_recorded || !flat;
    // Sized once: a tree of many tensors grows no vector by copying it.
    let names = match node.as_dict() {
        Some(d) if flat => d.iter_keyed().map(|(k, _)| k.as_str().len()).sum(),
        _ => refs.len() * 32,
    };
    let mut w = Walker {
        recording,
        same_as: sharing.same_as,
        tensors: Vec::with_capacity(refs.len()),
        names: String::with_capacity(names),
        ends: Vec::with_capacity(refs.len()),
        ..Walker::default()
    };
    if recording {
        w.record.extend_from_slice(b"{\"format\":");
        push_json(&mut w.record, &FORMAT_VERSION);
        w.record.extend_from_slice(b",\"tree\":");
    }
    w.node(node);
    if recording {
        w.record.push(b'}');
        if w.newest {
            debug_assert_eq!(w.record[VERSION_AT], b'0' + FORMAT_VERSION as u8);
            w.record[VERSION_AT] = b'0' + FORMAT_VERSION_NEWEST as u8;
        }
    }
    let mut walked = w.finish(flat);
    walked.overlap = sharing.overlap;
    walked
}

/// Which tensors of a tree share memory.
#[derive(Default)]
struct Sharing {
    /// For each tensor in tree order, the tree-order index of the earlier tensor it is
    /// the same as; empty when no tensor is another's.
    same_as: Vec<Option<u32>>,
    /// The first two tensors (tree-order indexes, the earlier first) whose memory overlaps
    /// without their being the same tensor.
    overlap: Option<(usize, usize)>,
}

impl Sharing {
    /// Finds the tensors of `tensors` (in tree order) that are one tensor, or overlap: their
    /// byte spans sorted by device and start, each compared with the span reaching
    /// furthest before it. Tensors without elements share nothing.
    fn of(tensors: &[&Tensor]) -> Sharing {
        let mut out = Sharing::default();
        if tensors.len() < 2 {
            return out;
        }
        // (device, first byte, end, tree index)
        let mut spans: Vec<((u8, usize), usize, usize, u32)> = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if t.numel() == 0 {
                continue;
            }
            let (lo, hi) = t.span_in_storage();
            let base = t.storage().as_ptr() as usize;
            let device = match t.device() {
                crate::device::Device::Cpu => (0, 0),
                crate::device::Device::Cuda(n) => (1, n),
                crate::device::Device::Emulated(n) => (2, n),
            };
            spans.push((
                device,
                base.wrapping_add(lo),
                base.wrapping_add(hi),
                i as u32,
            ));
        }
        spans.sort_unstable();
        // The span reaching furthest so far on this device, and the first of the run of
        // spans identical to the last one.
        let mut furthest = 0usize;
        let mut leader = 0usize;
        for k in 1..spans.len() {
            let (prev, cur) = (spans[k - 1], spans[k]);
            if cur.0 != prev.0 {
                furthest = k;
                leader = k;
                continue;
            }
            let lead = spans[leader];
            let same = (lead.1, lead.2) == (cur.1, cur.2)
                && tensors[lead.3 as usize].is_same_view(tensors[cur.3 as usize]);
            if same {
                if out.same_as.is_empty() {
                    out.same_as = vec![None; tensors.len()];
                }
                out.same_as[cur.3 as usize] = Some(lead.3);
                continue;
            }
            if cur.1 < spans[furthest].2 {
                let (a, b) = (spans[furthest].3 as usize, cur.3 as usize);
                if out.overlap.is_none_or(|(_, later)| a.max(b) < later) {
                    out.overlap = Some((a.min(b), a.max(b)));
                }
            }
            if cur.2 > spans[furthest].2 {
                furthest = k;
            }
            leader = k;
        }
        out
    }

    fn is_none(&self) -> bool {
        self.same_as.is_empty() && self.overlap.is_none()
    }
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
    /// The record uses what format 2 added (integer keys, aliases).
    newest: bool,
    /// [`Sharing::same_as`]: for each tensor in tree order, the one it is an alias of.
    same_as: Vec<Option<u32>>,
    /// Tensors met so far in tree order, aliases included.
    met: usize,
    /// For each tensor met (when there are aliases), the walked index it is written as.
    written_as: Vec<u32>,
    /// For each walked tensor (when there are aliases), its tree-order index.
    tree_index: Vec<u32>,
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
            tree_index: self.tree_index,
            overlap: None,
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
        for (i, (k, v)) in d.iter_keyed().enumerate() {
            let k_text = k.as_str();
            if self.recording {
                if i > 0 {
                    self.record.push(b',');
                }
                self.record.push(b'[');
                if k.is_int() {
                    // An integer key: its text is its JSON number.
                    self.record.extend_from_slice(k_text.as_bytes());
                    self.newest = true;
                } else {
                    push_json(&mut self.record, k_text);
                }
                self.record.push(b',');
                self.saw_string(k_text.len());
                self.tree.string_bytes += k_text.len() as u64;
            }
            let back = self.enter(k_text);
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
                if !self.same_as.is_empty() && self.alias_or_note() {
                    return;
                }
                self.tensors.push(t);
                self.names.push_str(&self.path);
                self.ends.push(self.names.len());
                if !self.recording {
                    return;
                }
                self.record.extend_from_slice(b"{\"tensor\":");
                push_json(&mut self.record, &self.path);
                self.record.push(b'}');
                self.saw_string(self.path.len());
            }
            Node::Value(v) => self.value(v),
        }
    }

    /// For a tree with aliases, at a tensor: records an alias of the earlier tensor it
    /// is the same as and says true; else notes where it will be written and says false.
    fn alias_or_note(&mut self) -> bool {
        let k = self.met;
        self.met += 1;
        let Some(first) = self.same_as[k] else {
            self.written_as.push(self.tensors.len() as u32);
            self.tree_index.push(k as u32);
            return false;
        };
        let at = self.written_as[first as usize] as usize;
        self.written_as.push(at as u32);
        let start = if at == 0 { 0 } else { self.ends[at - 1] };
        let name = &self.names[start..self.ends[at]];
        self.record.extend_from_slice(b"{\"alias\":");
        push_json(&mut self.record, name);
        self.record.push(b'}');
        let len = name.len();
        self.saw_string(len);
        self.newest = true;
        true
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
                push_json(r, i);
                r.push(b'}');
            }
            Value::Float(x) => {
                r.extend_from_slice(b"{\"float\":");
                if x.is_nan() {
                    r.extend_from_slice(b"\"nan\"");
                } else if x.is_infinite() {
                    r.extend_from_slice(if *x > 0.0 { b"\"inf\"" } else { b"\"-inf\"" });
                } else {
                    push_json(r, x);
                }
                r.push(b'}');
            }
            Value::Str(s) => {
                r.extend_from_slice(b"{\"str\":");
                push_json(r, s);
                r.push(b'}');
                self.saw_string(s.len());
                self.tree.string_bytes += s.len() as u64;
            }
        }
    }
}

/// Appends `v` as `serde_json` writes it: a string escaped and quoted, a number in decimal.
fn push_json(out: &mut Vec<u8>, v: &(impl serde::Serialize + ?Sized)) {
    serde_json::to_writer(out, v).expect("writing to a Vec");
}

type NameSet<'a> = HashMap<&'a str, usize, foldhash::fast::RandomState>;

/// Refuses tensors whose dtype the format lacks (or that a file cannot shape: a packed
/// scalar), a tensor named `__metadata__`, two paths giving one name, and tensors whose
/// memory overlaps without their being one tensor; `paths` recomputes the key paths (of
/// every tensor of the tree, in tree order) for the message.
pub(crate) fn check_names(walked: &Walked<'_>, paths: impl FnOnce() -> Vec<KeyPath>) -> Result<()> {
    let n = walked.tensors.len();
    let bad_dtype = walked.tensors.iter().position(|t| {
        t.dtype().safetensors_code().is_none() || t.dtype().file_shape(t.shape()).is_none()
    });
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
        .map(|i| walked.tree_index(i))
        .chain(walked.overlap.map(|(_, later)| later))
        .min();
    let Some(at) = first_fault else {
        return Ok(());
    };
    let paths = paths();
    let walked_at = |i: Option<usize>| i.filter(|&i| walked.tree_index(i) == at);
    if let Some(i) = walked_at(bad_dtype) {
        let t = walked.tensors[i];
        let reason = if t.dtype().safetensors_code().is_none() {
            "the safetensors format has no code for it".to_string()
        } else {
            format!(
                "a scalar cannot be stored: a file counts its {} values along the last \
                 dimension; reshape it to [1]",
                t.dtype().lanes()
            )
        };
        return Err(Error::UnsupportedDType {
            key: paths[at].to_string(),
            dtype: t.dtype().to_string(),
            reason,
        });
    }
    if walked_at(reserved).is_some() {
        return Err(Error::InvalidValue {
            key: paths[at].to_string(),
            reason: "a tensor named \"__metadata__\" cannot be stored: safetensors \
                     reserves the name for the metadata, and no reader would read the file"
                .into(),
        });
    }
    if let Some((first, second)) =
        collision.filter(|&(_, second)| walked_at(Some(second)).is_some())
    {
        return Err(Error::NameCollision {
            name: walked.name(second).to_string(),
            first: paths[walked.tree_index(first)].to_string(),
            second: paths[at].to_string(),
        });
    }
    let (earlier, later) = walked.overlap.expect("the remaining fault");
    Err(Error::InvalidValue {
        key: paths[later].to_string(),
        reason: format!(
            "its memory overlaps that of {:?} (views of one storage that are not the same \
             tensor); a file stores each tensor's bytes apart and cannot keep the overlap: \
             save a copy of one (`.clone()`), or leave one out (a tensor given under two \
             keys, tied weights, is stored once and shared again on load)",
            paths[earlier].to_string()
        ),
    })
}

/// The header built from `walked`, and its census.
pub(crate) struct Built {
    /// The 8-byte length and the JSON, padded with spaces so data starts 64-byte aligned.
    pub(crate) bytes: Vec<u8>,
    /// What [`super::header`] counts in it.
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
    order.sort_by_key(|&i| std::cmp::Reverse(walked.tensors[i].dtype().alignment()));
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
        push_json(&mut json, k);
        json.push(b':');
        push_json(&mut json, v);
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
        push_json(&mut json, name);
        json.extend_from_slice(b":{\"dtype\":\"");
        json.extend_from_slice(code.as_bytes());
        json.extend_from_slice(b"\",\"shape\":[");
        // Packed floats: the header counts values, not elements.
        let file_shape;
        let shape = if t.dtype().lanes() > 1 {
            file_shape = t.dtype().file_shape(t.shape()).expect("checked");
            &file_shape[..]
        } else {
            t.shape()
        };
        for (d, &n) in shape.iter().enumerate() {
            if d > 0 {
                json.push(b',');
            }
            push_json(&mut json, &n);
        }
        let begin = begins[i];
        json.extend_from_slice(b"],\"data_offsets\":[");
        push_json(&mut json, &begin);
        json.push(b',');
        push_json(&mut json, &(begin + t.nbytes() as u64));
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
    // The walk counts what a census of its record would (no lengths, aliases or offset).
    census.tree = recorded.then(|| Ok(walked.tree.clone()));
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
    let parsed = super::header_reader::census_of(text).expect("the writer writes valid JSON");
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
    fn names_and_strings_are_written_as_serde_json_writes_them_and_read_back() {
        let odd = "a\"b\\c\n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f}é∂😀 x";
        let mut d = TensorDict::new();
        d.insert(odd, Tensor::from_slice(&[1u8], &[1]).unwrap());
        d.insert("s", odd);
        let tree = Node::from(d);
        let walked = walk_node(&tree);
        let user = BTreeMap::from([(odd.to_string(), odd.to_string())]);
        let built = build(&walked, &user);
        let json = std::str::from_utf8(&built.bytes[8..]).unwrap();
        let quoted = serde_json::to_string(odd).unwrap();
        assert_eq!(json.matches(&quoted).count(), 3, "{json}");
        let header = super::super::header_reader::parse_header(&built.bytes[8..], 1).unwrap();
        assert_eq!(header.tensors[0].name, odd);
        assert_eq!(header.metadata[odd], odd);
    }
}
