//! [`Node`]: the one tree type, an ordered, nested tree of tensors and plain values. A
//! dictionary is a node ([`Node::Dict`], whose entries a [`TensorDict`] holds); every
//! entry point (load, save, consolidate, moves) takes or returns a `Node`.
//!
//! Keys are any strings ("layer.0.weight" is one key) or integers (the parameter indices
//! that key PyTorch's optimizer state), an integer held as its decimal text; a node is a
//! dict, a list or a tuple; a leaf is a tensor or a plain value. Paths address nested
//! entries: list items by their index written as a string, integer keys by their text.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{Hash, Hasher};

use indexmap::IndexMap;

use crate::consolidate::pack;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A non-tensor leaf: the values a safetensors header can record exactly.
///
/// ```
/// use tensorferry::{Node, Value};
///
/// assert!(matches!(Node::from(0.5), Node::Value(Value::Float(x)) if x == 0.5));
/// ```
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Python's `None`.
    None,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float, NaN and infinities included.
    Float(f64),
    /// A string.
    Str(String),
}

/// A tree, or one entry of a tree: the one type every entry point takes and returns.
///
/// ```
/// use tensorferry::{Node, Tensor, TensorDict};
///
/// let mut d = TensorDict::new();
/// d.insert_path(&["model", "w"], Tensor::from_slice(&[1.0f32, 2.0], &[2])?)?;
/// d.insert("step", 10i64);
/// let tree = Node::from(d);
/// assert_eq!(tree.tensor_count(), 1);
/// assert_eq!(tree.tensor(&["model", "w"]).unwrap().to_vec::<f32>()?, [1.0, 2.0]);
/// # Ok::<(), tensorferry::Error>(())
/// ```
#[derive(Clone, Debug)]
pub enum Node {
    /// A nested dictionary.
    Dict(TensorDict),
    /// A list.
    List(Vec<Node>),
    /// A tuple.
    Tuple(Vec<Node>),
    /// A tensor leaf.
    Tensor(Tensor),
    /// A plain-value leaf.
    Value(Value),
}

/// The path of an entry: one key per level.
///
/// ```
/// use tensorferry::{KeyPath, Node, Tensor, TensorDict};
///
/// let mut d = TensorDict::new();
/// d.insert_path(&["model", "layer.0.weight"], Tensor::from_slice(&[1u8], &[1])?)?;
/// let (path, _) = Node::from(d).tensors().remove(0);
/// assert_eq!(path, KeyPath(vec!["model".into(), "layer.0.weight".into()]));
/// assert_eq!(path.dotted(), "model.layer.0.weight"); // its name in a file
/// # Ok::<(), tensorferry::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct KeyPath(pub Vec<String>);

impl KeyPath {
    /// The path joined with ".", as tensor names in safetensors files are.
    pub fn dotted(&self) -> String {
        self.0.join(".")
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("/"))
    }
}

/// A key of a [`TensorDict`]: a string, or an integer held as its decimal text. Keys are
/// equal when their texts are: the integer `0` and the string `"0"` are one key, as they
/// are one name in a file.
///
/// ```
/// use tensorferry::DictKey;
///
/// let (int, text) = (DictKey::from(0i64), DictKey::from("0"));
/// assert_eq!(int, text);
/// assert_eq!((int.as_int(), text.as_int()), (Some(0), None));
/// ```
#[derive(Clone, Debug)]
pub struct DictKey {
    text: String,
    int: bool,
}

impl DictKey {
    /// The key's text (an integer's in decimal).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// True when the key is an integer.
    pub fn is_int(&self) -> bool {
        self.int
    }

    /// The integer, when the key is one.
    pub fn as_int(&self) -> Option<i64> {
        if self.int {
            self.text.parse().ok()
        } else {
            None
        }
    }

    /// The key's text, by value.
    pub fn into_string(self) -> String {
        self.text
    }
}

impl PartialEq for DictKey {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}
impl Eq for DictKey {}

impl Hash for DictKey {
    /// As the text hashes, so that a dict is searched by `&str`.
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.text.as_str().hash(state);
    }
}

impl Borrow<str> for DictKey {
    fn borrow(&self) -> &str {
        &self.text
    }
}

impl From<String> for DictKey {
    fn from(text: String) -> Self {
        DictKey { text, int: false }
    }
}
impl From<&str> for DictKey {
    fn from(text: &str) -> Self {
        DictKey::from(text.to_string())
    }
}
impl From<&String> for DictKey {
    fn from(text: &String) -> Self {
        DictKey::from(text.clone())
    }
}
impl From<i64> for DictKey {
    fn from(i: i64) -> Self {
        DictKey {
            text: i.to_string(),
            int: true,
        }
    }
}

impl fmt::Display for DictKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The entries of a dictionary node ([`Node::Dict`]): an ordered map of keys (strings or
/// integers) to [`Node`]s, with the methods that build and edit it. What a whole tree
/// does (walk, map, move, save) is a method of [`Node`] or a function taking one.
///
/// ```
/// use tensorferry::{Tensor, TensorDict};
///
/// let mut d = TensorDict::new();
/// d.insert("b", Tensor::from_slice(&[1i32], &[1])?);
/// d.insert(0i64, "an integer key");
/// d.insert_path(&["nested", "a"], 2.5)?;
/// assert_eq!(d.keys().collect::<Vec<_>>(), ["b", "0", "nested"]);
/// assert!(d.tensor(&["b"]).is_some() && d.get_path(&["nested", "a"]).is_some());
/// # Ok::<(), tensorferry::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct TensorDict {
    entries: IndexMap<DictKey, Node>,
}

impl From<Tensor> for Node {
    fn from(t: Tensor) -> Self {
        Node::Tensor(t)
    }
}
impl From<TensorDict> for Node {
    fn from(d: TensorDict) -> Self {
        Node::Dict(d)
    }
}
impl From<Value> for Node {
    fn from(v: Value) -> Self {
        Node::Value(v)
    }
}
impl From<&str> for Node {
    fn from(s: &str) -> Self {
        Node::Value(Value::Str(s.to_string()))
    }
}
impl From<String> for Node {
    fn from(s: String) -> Self {
        Node::Value(Value::Str(s))
    }
}
impl From<i64> for Node {
    fn from(i: i64) -> Self {
        Node::Value(Value::Int(i))
    }
}
impl From<f64> for Node {
    fn from(x: f64) -> Self {
        Node::Value(Value::Float(x))
    }
}
impl From<bool> for Node {
    fn from(b: bool) -> Self {
        Node::Value(Value::Bool(b))
    }
}

impl Node {
    /// The tensor, if this node is one.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Node::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The dictionary, if this node is one.
    pub fn as_dict(&self) -> Option<&TensorDict> {
        match self {
            Node::Dict(d) => Some(d),
            _ => None,
        }
    }

    /// The child at `key`: a dict key, or a list/tuple index written as a string.
    pub fn child(&self, key: &str) -> Option<&Node> {
        match self {
            Node::Dict(d) => d.entries.get(key),
            Node::List(items) | Node::Tuple(items) => items.get(key.parse::<usize>().ok()?),
            _ => None,
        }
    }

    /// Calls `f` on every tensor leaf with its path, in tree order.
    pub fn visit_tensors<'a>(&'a self, f: &mut impl FnMut(&KeyPath, &'a Tensor)) {
        self.visit_tensors_at(&mut KeyPath::default(), f);
    }

    /// Visits with one path stack, pushed and popped, so no path is cloned per node.
    fn visit_tensors_at<'a>(
        &'a self,
        path: &mut KeyPath,
        f: &mut impl FnMut(&KeyPath, &'a Tensor),
    ) {
        match self {
            Node::Tensor(t) => f(path, t),
            Node::Value(_) => {}
            Node::Dict(d) => {
                for (k, v) in &d.entries {
                    path.0.push(k.text.clone());
                    v.visit_tensors_at(path, f);
                    path.0.pop();
                }
            }
            Node::List(items) | Node::Tuple(items) => {
                for (i, v) in items.iter().enumerate() {
                    path.0.push(i.to_string());
                    v.visit_tensors_at(path, f);
                    path.0.pop();
                }
            }
        }
    }

    /// Every tensor leaf with its path, in tree order.
    pub fn tensors(&self) -> Vec<(KeyPath, &Tensor)> {
        let mut out = Vec::new();
        self.visit_tensors(&mut |p, t| out.push((p.clone(), t)));
        out
    }

    /// Every tensor leaf in tree order, without paths (cheaper than [`Node::tensors`]).
    pub fn tensor_refs(&self) -> Vec<&Tensor> {
        let mut out = Vec::new();
        self.for_each_tensor(&mut |t| out.push(t));
        out
    }

    /// The node at a nested path (`&["model", "layer.0.weight"]`): dict keys, or list and
    /// tuple indices written as strings. The empty path is the node itself.
    pub fn get_path(&self, path: &[&str]) -> Option<&Node> {
        path.iter().try_fold(self, |node, k| node.child(k))
    }

    /// The tensor at a nested path, or `None` when absent or not a tensor.
    pub fn tensor(&self, path: &[&str]) -> Option<&Tensor> {
        self.get_path(path)?.as_tensor()
    }

    /// Number of tensor leaves at any depth.
    pub fn tensor_count(&self) -> usize {
        let mut n = 0;
        self.for_each_tensor(&mut |_| n += 1);
        n
    }

    /// Bytes of all tensor leaves.
    pub fn nbytes(&self) -> usize {
        let mut n = 0;
        self.for_each_tensor(&mut |t| n += t.nbytes());
        n
    }

    /// The device all tensors share, or `None` when they are mixed or there are none.
    pub fn device(&self) -> Option<Device> {
        let tensors = self.tensor_refs();
        let first = tensors.first()?.device();
        tensors.iter().all(|t| t.device() == first).then_some(first)
    }

    /// The tree with every tensor on `device`; tensors already there are shared unless
    /// `copy`. The source is never modified; on error nothing half-built is returned.
    pub fn to(&self, device: Device, copy: bool) -> Result<Node> {
        self.to_with(
            device,
            crate::transfer::MoveOptions {
                copy,
                non_blocking: false,
                ..Default::default()
            },
        )
    }

    /// Like [`Node::to`], with every option: one planned transfer for the whole tree;
    /// with `non_blocking` the copies may still run when this returns, and every read of
    /// a result waits for its copy ([`Node::wait`] waits for all).
    pub fn to_with(&self, device: Device, options: crate::transfer::MoveOptions) -> Result<Node> {
        let mut moved =
            crate::transfer::move_tensors(&self.tensor_refs(), device, options)?.into_iter();
        self.try_map_tensors_in_order(&mut |_| Ok(moved.next().expect("one result per tensor")))
    }

    /// Waits for every copy into this tree's tensors; the first failure, if any.
    pub fn wait(&self) -> Result<()> {
        self.tensor_refs().iter().try_for_each(|t| t.wait())
    }

    /// True when no copy into this tree's tensors is still running.
    pub fn is_ready(&self) -> bool {
        self.tensor_refs().iter().all(|t| t.is_ready())
    }

    fn for_each_tensor<'a>(&'a self, f: &mut impl FnMut(&'a Tensor)) {
        match self {
            Node::Tensor(t) => f(t),
            Node::Value(_) => {}
            Node::Dict(d) => d.entries.values().for_each(|v| v.for_each_tensor(f)),
            Node::List(items) | Node::Tuple(items) => {
                items.iter().for_each(|v| v.for_each_tensor(f))
            }
        }
    }

    /// A new tree of the same shape whose tensors are `f(path, tensor)`; plain values are
    /// cloned. The first error stops the map and is returned; `self` is never modified.
    pub fn try_map_tensors(
        &self,
        f: &mut impl FnMut(&KeyPath, &Tensor) -> Result<Tensor>,
    ) -> Result<Node> {
        let mut out = self.clone();
        out.replace_tensors_at(&mut KeyPath::default(), &mut |p, t| {
            f(p, t).map(Node::Tensor)
        })?;
        Ok(out)
    }

    /// This tree with every tensor whose dotted name is not in `only` replaced by `None`
    /// (what a load of a subset of names gives).
    pub(crate) fn keep_only(mut self, only: &std::collections::HashSet<String>) -> Node {
        let mut blank = |path: &KeyPath, t: &Tensor| -> Result<Node> {
            Ok(match only.contains(&path.dotted()) {
                true => Node::Tensor(t.clone()),
                false => Node::Value(Value::None),
            })
        };
        let kept = self.replace_tensors_at(&mut KeyPath::default(), &mut blank);
        kept.expect("the map never fails");
        self
    }

    /// Like [`Node::try_map_tensors`] without paths, for maps that do not need them.
    pub fn try_map_tensors_in_order(
        &self,
        f: &mut impl FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<Node> {
        let mut out = self.clone();
        out.replace_tensors_in_order(f)?;
        Ok(out)
    }

    /// Replaces every tensor `t` of this (cloned) tree by `f(t)`, in order. Cloning the
    /// tree first keeps every dict's hash table (no key is hashed again) and costs a
    /// tensor one reference count, now that shapes are inline.
    fn replace_tensors_in_order(
        &mut self,
        f: &mut impl FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<()> {
        match self {
            Node::Tensor(t) => *t = f(t)?,
            Node::Value(_) => {}
            Node::Dict(d) => {
                for v in d.entries.values_mut() {
                    v.replace_tensors_in_order(f)?;
                }
            }
            Node::List(items) | Node::Tuple(items) => {
                for v in items {
                    v.replace_tensors_in_order(f)?;
                }
            }
        }
        Ok(())
    }

    /// Replaces every tensor `t` at `path` (and below) of this (cloned) tree by the node
    /// `f(path, t)`, in order, with one path stack pushed and popped.
    fn replace_tensors_at(
        &mut self,
        path: &mut KeyPath,
        f: &mut impl FnMut(&KeyPath, &Tensor) -> Result<Node>,
    ) -> Result<()> {
        let mut below = |path: &mut KeyPath, key: String, v: &mut Node| {
            path.0.push(key);
            let replaced = v.replace_tensors_at(path, f);
            path.0.pop();
            replaced
        };
        match self {
            Node::Tensor(t) => *self = f(path, t)?,
            Node::Value(_) => {}
            Node::Dict(d) => {
                for (k, v) in d.entries.iter_mut() {
                    below(path, k.text.clone(), v)?;
                }
            }
            Node::List(items) | Node::Tuple(items) => {
                for (i, v) in items.iter_mut().enumerate() {
                    below(path, i.to_string(), v)?;
                }
            }
        }
        Ok(())
    }
}

impl TensorDict {
    /// An empty dictionary.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of top-level entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there are no top-level entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// An empty dictionary with room for `n` entries.
    pub fn with_capacity(n: usize) -> Self {
        TensorDict {
            entries: IndexMap::with_capacity(n),
        }
    }

    /// Inserts at a top-level key (a string, or an `i64` for an integer key), keeping the
    /// key's position if it existed (and taking the new key's kind); returns the old node.
    pub fn insert(&mut self, key: impl Into<DictKey>, node: impl Into<Node>) -> Option<Node> {
        use indexmap::map::MutableKeys;
        let key = key.into();
        match self.entries.get_full_mut2(key.as_str()) {
            Some((_, k, v)) => {
                k.int = key.int;
                Some(std::mem::replace(v, node.into()))
            }
            None => {
                self.entries.insert(key, node.into());
                None
            }
        }
    }

    /// Inserts `node` at `key` if the key is new; false, and the dict unchanged, if not.
    pub(crate) fn insert_new(&mut self, key: DictKey, node: Node) -> bool {
        match self.entries.entry(key) {
            indexmap::map::Entry::Vacant(slot) => {
                slot.insert(node);
                true
            }
            indexmap::map::Entry::Occupied(_) => false,
        }
    }

    /// Inserts at a nested path, creating missing dictionaries on the way.
    pub fn insert_path(&mut self, path: &[&str], node: impl Into<Node>) -> Result<Option<Node>> {
        let (last, parents) = path.split_last().ok_or_else(|| Error::KeyNotFound {
            path: String::new(),
        })?;
        let mut dict = self;
        for (depth, key) in parents.iter().enumerate() {
            let slot = dict
                .entries
                .entry(DictKey::from(*key))
                .or_insert_with(|| Node::Dict(TensorDict::new()));
            dict = match slot {
                Node::Dict(d) => d,
                _ => {
                    return Err(Error::InvalidValue {
                        key: path[..=depth].join("/"),
                        reason: "is not a dictionary, cannot insert below it".into(),
                    })
                }
            };
        }
        Ok(dict.insert(*last, node))
    }

    /// The node at a top-level key.
    pub fn get(&self, key: &str) -> Option<&Node> {
        self.entries.get(key)
    }

    /// The node at a nested path (`&["model", "layer.0.weight"]`), the first key a
    /// top-level one; see [`Node::get_path`].
    pub fn get_path(&self, path: &[&str]) -> Option<&Node> {
        let (first, rest) = path.split_first()?;
        self.entries.get(*first)?.get_path(rest)
    }

    /// The tensor at a nested path, or `None` when absent or not a tensor.
    pub fn tensor(&self, path: &[&str]) -> Option<&Tensor> {
        self.get_path(path)?.as_tensor()
    }

    /// Removes a top-level key, keeping the order of the others.
    pub fn remove(&mut self, key: &str) -> Option<Node> {
        self.entries.shift_remove(key)
    }

    /// The top-level keys in order (integers as their text).
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(DictKey::as_str)
    }

    /// The top-level entries in order (integer keys as their text).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Node)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The top-level entries in order, with their keys as held (string or integer).
    pub fn iter_keyed(&self) -> impl Iterator<Item = (&DictKey, &Node)> {
        self.entries.iter()
    }

    /// The top-level entries in order, by value, with their keys as held.
    pub fn into_keyed_iter(self) -> impl Iterator<Item = (DictKey, Node)> {
        self.entries.into_iter()
    }
}

/// The top-level entries of a [`TensorDict`] by value, keys as text.
pub struct IntoIter(indexmap::map::IntoIter<DictKey, Node>);

impl Iterator for IntoIter {
    type Item = (String, Node);
    fn next(&mut self) -> Option<(String, Node)> {
        self.0.next().map(|(k, v)| (k.text, v))
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl IntoIterator for TensorDict {
    type Item = (String, Node);
    type IntoIter = IntoIter;

    /// The top-level entries in order, by value (integer keys as their text;
    /// [`TensorDict::into_keyed_iter`] keeps their kind).
    fn into_iter(self) -> IntoIter {
        IntoIter(self.entries.into_iter())
    }
}

impl FromIterator<(String, Node)> for TensorDict {
    fn from_iter<I: IntoIterator<Item = (String, Node)>>(iter: I) -> Self {
        TensorDict {
            entries: iter
                .into_iter()
                .map(|(k, v)| (DictKey::from(k), v))
                .collect(),
        }
    }
}

impl FromIterator<(DictKey, Node)> for TensorDict {
    /// A dict of the entries in order; of keys given twice, the last entry wins.
    fn from_iter<I: IntoIterator<Item = (DictKey, Node)>>(iter: I) -> Self {
        TensorDict {
            entries: iter.into_iter().collect(),
        }
    }
}

/// Packs the tensors of `tree` into one 64-byte-aligned buffer; returns the tree with
/// contiguous views into it. The source is left as it is. Every tensor must be on the host.
///
/// ```
/// use tensorferry::{consolidate, Node, Tensor, TensorDict};
///
/// let mut d = TensorDict::new();
/// d.insert("a", Tensor::from_slice(&[1.0f32, 2.0], &[2])?);
/// d.insert("b", Tensor::from_slice(&[3i32], &[1])?);
/// let packed = consolidate(&Node::from(d))?;
/// let (a, b) = (packed.tensor(&["a"]).unwrap(), packed.tensor(&["b"]).unwrap());
/// assert!(std::sync::Arc::ptr_eq(a.storage(), b.storage()));
/// # Ok::<(), tensorferry::Error>(())
/// ```
pub fn consolidate(tree: &Node) -> Result<Node> {
    let mut packed = pack(&tree.tensor_refs())?.into_iter();
    tree.try_map_tensors_in_order(&mut |_| Ok(packed.next().expect("one view per tensor")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v, &[v.len()]).unwrap()
    }

    fn sample_dict() -> TensorDict {
        let mut d = TensorDict::new();
        d.insert_path(&["model", "layer.0.weight"], t(&[1.0, 2.0]))
            .unwrap();
        d.insert_path(&["model", "layer.0.bias"], t(&[3.0]))
            .unwrap();
        d.insert("step", 10i64);
        d.insert("name", "run-1");
        d.insert(
            "history",
            Node::List(vec![
                Node::Tensor(t(&[4.0])),
                Node::Value(Value::Float(0.5)),
            ]),
        );
        d
    }

    fn sample() -> Node {
        Node::Dict(sample_dict())
    }

    #[test]
    fn dotted_keys_are_one_key() {
        let d = sample();
        assert!(d.tensor(&["model", "layer.0.weight"]).is_some());
        assert!(d.get_path(&["model", "layer", "0", "weight"]).is_none());
    }

    #[test]
    fn tensors_come_in_tree_order_with_their_paths() {
        let d = sample();
        let paths: Vec<String> = d.tensors().iter().map(|(p, _)| p.to_string()).collect();
        assert_eq!(
            paths,
            ["model/layer.0.weight", "model/layer.0.bias", "history/0"]
        );
        assert_eq!(d.tensor_count(), 3);
        assert_eq!(d.nbytes(), 16);
    }

    #[test]
    fn list_items_are_addressed_by_index() {
        let d = sample();
        assert_eq!(
            d.tensor(&["history", "0"])
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            vec![4.0]
        );
        assert!(d.get_path(&["history", "7"]).is_none());
    }

    #[test]
    fn remove_keeps_the_order_of_the_rest() {
        let mut d = sample_dict();
        assert!(d.remove("step").is_some());
        assert_eq!(d.keys().collect::<Vec<_>>(), ["model", "name", "history"]);
        assert!(d.remove("nope").is_none());
    }

    #[test]
    fn insert_below_a_leaf_is_an_error() {
        let mut d = sample_dict();
        assert!(d.insert_path(&["step", "x"], 1i64).is_err());
    }

    #[test]
    fn map_builds_a_new_tree_and_leaves_the_source_alone() {
        let d = sample();
        let copied = d.to(Device::Cpu, true).unwrap();
        let a = d.tensor(&["model", "layer.0.bias"]).unwrap();
        let b = copied.tensor(&["model", "layer.0.bias"]).unwrap();
        assert!(!std::sync::Arc::ptr_eq(a.storage(), b.storage()));
        assert!(
            matches!(copied.get_path(&["name"]), Some(Node::Value(Value::Str(s))) if s == "run-1")
        );
    }

    #[test]
    fn a_failing_map_returns_the_error_and_no_tree() {
        let d = sample();
        let mut n = 0;
        let res = d.try_map_tensors(&mut |p, t| {
            n += 1;
            if n == 2 {
                Err(Error::KeyNotFound {
                    path: p.to_string(),
                })
            } else {
                Ok(t.clone())
            }
        });
        assert!(matches!(res, Err(Error::KeyNotFound { path }) if path == "model/layer.0.bias"));
        assert_eq!(d.tensor_count(), 3);
    }

    #[test]
    fn integer_keys_are_found_by_their_text_and_keep_their_kind() {
        let mut d = TensorDict::new();
        d.insert(0i64, t(&[1.0]));
        d.insert("lr", 0.1);
        assert!(Node::Dict(d.clone()).tensor(&["0"]).is_some());
        let kinds: Vec<(String, bool)> = d
            .iter_keyed()
            .map(|(k, _)| (k.to_string(), k.is_int()))
            .collect();
        assert_eq!(kinds, [("0".into(), true), ("lr".into(), false)]);
        assert_eq!(d.iter_keyed().next().unwrap().0.as_int(), Some(0));
        // The string "0" is the same key: it replaces the entry in place, as a string.
        assert!(d.insert("0", 2i64).is_some());
        assert_eq!(d.keys().collect::<Vec<_>>(), ["0", "lr"]);
        assert!(!d.iter_keyed().any(|(k, _)| k.is_int()));
        let copied = Node::Dict(d)
            .try_map_tensors(&mut |_, t| Ok(t.clone()))
            .unwrap();
        assert_eq!(copied.as_dict().unwrap().len(), 2);
    }

    #[test]
    fn device_is_the_shared_one() {
        assert_eq!(sample().device(), Some(Device::Cpu));
        assert_eq!(Node::Dict(TensorDict::new()).device(), None);
    }
}
