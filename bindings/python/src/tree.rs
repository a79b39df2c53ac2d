//! Converting between Python containers and tensorferry trees, for save and load.
//!
//! Not a second walker of users' containers: the Python package has already walked the
//! tree with [`crate::walk`] (`rebuild(plain=True)`), turning every tensor leaf into a
//! `tensorferry.Tensor` and every mapping into a dict; what is left here is exact: dict
//! (keys str or int), list, tuple, `Tensor`, `None`, bool, int, float, str. This module's
//! job is the conversion to and from the core's `Node` (keys that a file can name, values
//! that fit its record, one Python object per tensor a file holds under several keys, as
//! tied weights are), which no other pass does; it shares the walker's depth limit and its
//! message ([`crate::walk::too_deep`]).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use tensorferry::{DictKey, Error, Node, Tensor, TensorDict, Value};

use crate::errors::to_py;
use crate::tensor::PyTensor;

fn invalid(path: &[String], reason: String) -> PyErr {
    to_py(Error::InvalidValue {
        key: path.join("/"),
        reason,
    })
}

/// Text of a key or value as UTF-8; a string that cannot be (a lone surrogate, as
/// `os.fsdecode` makes of undecodable bytes) is a `FormatError` naming the key.
fn utf8(s: &Bound<'_, PyString>, path: &[String], what: &str) -> PyResult<String> {
    match s.to_cow() {
        Ok(text) => Ok(text.into_owned()),
        Err(_) => Err(invalid(
            path,
            format!(
                "{what} {} is not valid Unicode (it holds a lone surrogate) and cannot be \
                 stored in a file",
                s.repr().map(|r| r.to_string()).unwrap_or_default()
            ),
        )),
    }
}

/// The tree of a Python object; `path` is the key path so far, for error messages.
pub fn node_from_py(obj: &Bound<'_, PyAny>, path: &mut Vec<String>) -> PyResult<Node> {
    if path.len() > crate::walk::MAX_DEPTH {
        return Err(crate::walk::too_deep(path.join("/")));
    }
    if let Ok(t) = obj.cast::<PyTensor>() {
        return Ok(Node::Tensor(t.get().inner.clone()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut out = TensorDict::with_capacity(d.len());
        for (k, v) in d.iter() {
            let key = dict_key(&k, path)?;
            path.push(key.as_str().to_string());
            let child = node_from_py(&v, path)?;
            path.pop();
            let int = key.is_int();
            if out.insert(key, child).is_some() {
                // The key before was the other kind: the string of an integer's text, or
                // the integer of a string's.
                let text = k.str()?;
                let earlier = if int { text.repr()? } else { text };
                return Err(invalid(
                    path,
                    format!(
                        "the keys {earlier} and {} are one name in a file (tensor names are \
                         text); rename one",
                        k.repr()?
                    ),
                ));
            }
        }
        return Ok(Node::Dict(out));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return items(l.iter(), path).map(Node::List);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return items(t.iter(), path).map(Node::Tuple);
    }
    if obj.is_none() {
        return Ok(Node::Value(Value::None));
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Node::Value(Value::Bool(b.is_true())));
    }
    if obj.cast::<PyInt>().is_ok() {
        return obj
            .extract::<i64>()
            .map(|i| Node::Value(Value::Int(i)))
            .map_err(|_| {
                crate::errors::overflow_err(format!(
                    "cannot handle the value at {:?}: the integer {} does not fit in 64 bits",
                    path.join("/"),
                    obj.repr().map(|r| r.to_string()).unwrap_or_default()
                ))
            });
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Node::Value(Value::Float(f.value())));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Node::Value(Value::Str(utf8(s, path, "the string")?)));
    }
    Err(invalid(
        path,
        format!(
            "values of type {} cannot be saved (tensors, dict, list, tuple, str, int, float, bool and None can)",
            obj.get_type().name()?
        ),
    ))
}

/// A dict key: a string, or an integer (not a bool) that fits in 64 bits.
fn dict_key(k: &Bound<'_, PyAny>, path: &[String]) -> PyResult<DictKey> {
    if let Ok(s) = k.cast::<PyString>() {
        return Ok(utf8(s, path, "the key")?.into());
    }
    if k.cast::<PyInt>().is_ok() && k.cast::<PyBool>().is_err() {
        return k.extract::<i64>().map(DictKey::from).map_err(|_| {
            crate::errors::overflow_err(format!(
                "cannot handle the key {} at {:?}: it does not fit in 64 bits",
                k.repr().map(|r| r.to_string()).unwrap_or_default(),
                path.join("/")
            ))
        });
    }
    Err(invalid(
        path,
        format!(
            "dictionary keys must be strings or integers, found {}",
            k.get_type().name()?
        ),
    ))
}

fn items<'py>(
    iter: impl Iterator<Item = Bound<'py, PyAny>>,
    path: &mut Vec<String>,
) -> PyResult<Vec<Node>> {
    iter.enumerate()
        .map(|(i, v)| {
            path.push(i.to_string());
            let n = node_from_py(&v, path);
            path.pop();
            n
        })
        .collect()
}

/// How `node_to_py` turns tensors into Python objects.
pub struct Output<'a> {
    /// Give this kind to every tensor (the caller's `like`).
    pub like: Option<&'a str>,
    /// The kind each tensor was saved from: a default and exceptions by dotted name.
    pub default: Option<String>,
    /// Tensors whose recorded kind differs from `default`.
    pub exceptions: std::collections::HashMap<String, String>,
    /// ml_dtypes is importable (bfloat16/float8 can become NumPy arrays).
    pub ml_dtypes: bool,
    /// Set when some tensor stayed a `Tensor` for the Python side to convert (torch, jax).
    pub pending: bool,
}

impl Output<'_> {
    fn kind(&self, path: &[String]) -> &str {
        if let Some(like) = self.like {
            return like;
        }
        if !self.exceptions.is_empty() {
            if let Some(k) = self.exceptions.get(&path.join(".")) {
                return k;
            }
        }
        self.default.as_deref().unwrap_or("numpy")
    }

    /// True when some tensor may become a NumPy array, made from its bytes (the others
    /// stay `Tensor` objects, views whose bytes are not read).
    pub fn reads_bytes(&self) -> bool {
        match self.like {
            Some(like) => like == "numpy",
            None => {
                self.default.as_deref().is_none_or(|k| k == "numpy")
                    || self.exceptions.values().any(|k| k == "numpy")
            }
        }
    }
}

/// The Python containers of a tree: dict, list, tuple, plain values; tensors become NumPy
/// arrays or `Tensor` objects as `out` says (other frameworks are left to Python). One
/// tensor in several places (a file's aliases: the same memory, dtype, shape and strides)
/// becomes one object.
pub fn node_to_py(
    py: Python<'_>,
    node: Node,
    out: &mut Output<'_>,
    path: &mut Vec<String>,
) -> PyResult<Py<PyAny>> {
    Converter {
        out,
        made: HashMap::default(),
        shared: has_shared_tensors(&node),
    }
    .node(py, node, path)
}

/// True when two tensors of `node` start at one address (aliases of one tensor: the
/// distinct tensors of a file never do). Addresses in tree order mostly rise (a file lays
/// out each dtype's tensors in tree order), so most trees are settled by one pass; others
/// by sorting their addresses.
fn has_shared_tensors(node: &Node) -> bool {
    let mut all: Vec<usize> = (node.tensor_refs().into_iter())
        .filter(|t| t.numel() > 0)
        .map(|t| t.data_ptr() as usize)
        .collect();
    if all.windows(2).all(|w| w[0] < w[1]) {
        return false;
    }
    all.sort_unstable();
    all.windows(2).any(|w| w[0] == w[1])
}

/// Hashes an address: a multiply spreads its bits upwards, and the rotation brings the
/// mixed high bits down to where the table picks its bucket (aligned addresses have
/// their low bits all zero, which a product keeps zero).
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

struct Converter<'o, 'a> {
    out: &'o mut Output<'a>,
    /// The object made for each tensor with elements so far, by the address of its first
    /// element (distinct for the distinct tensors of a file), with the tensor to compare.
    made: HashMap<usize, (Tensor, Py<PyAny>), BuildHasherDefault<AddressHasher>>,
    /// Some tensors of the tree are one (else `made` is not kept).
    shared: bool,
}

impl Converter<'_, '_> {
    fn node(&mut self, py: Python<'_>, node: Node, path: &mut Vec<String>) -> PyResult<Py<PyAny>> {
        Ok(match node {
            Node::Dict(d) => {
                let dict = PyDict::new(py);
                for (k, v) in d.into_keyed_iter() {
                    let int = k.as_int();
                    path.push(k.into_string());
                    let value = self.node(py, v, path);
                    let k = path.pop().expect("pushed above");
                    match int {
                        Some(i) => dict.set_item(i, value?)?,
                        None => dict.set_item(k, value?)?,
                    }
                }
                dict.into_any().unbind()
            }
            Node::List(items) => PyList::new(py, self.items(py, items, path)?)?
                .into_any()
                .unbind(),
            Node::Tuple(items) => PyTuple::new(py, self.items(py, items, path)?)?
                .into_any()
                .unbind(),
            Node::Tensor(t) => self.tensor(py, t, path)?,
            Node::Value(v) => match v {
                Value::None => py.None(),
                Value::Bool(b) => PyBool::new(py, b).to_owned().into_any().unbind(),
                Value::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
                Value::Float(x) => PyFloat::new(py, x).into_any().unbind(),
                Value::Str(s) => PyString::new(py, &s).into_any().unbind(),
            },
        })
    }

    fn tensor(&mut self, py: Python<'_>, t: Tensor, path: &[String]) -> PyResult<Py<PyAny>> {
        let at = t.data_ptr() as usize;
        let keyed = self.shared && t.numel() > 0;
        if keyed {
            if let Some((seen, obj)) = self.made.get(&at) {
                if seen.is_same_view(&t) {
                    return Ok(obj.clone_ref(py));
                }
            }
        }
        let kind = self.out.kind(path);
        let numpy = match kind {
            "numpy" => {
                t.dtype().is_numpy_native() || (self.out.ml_dtypes && t.dtype().is_ml_dtypes())
            }
            "tensorferry" => false,
            _ => {
                self.out.pending = true;
                false
            }
        };
        let kept = keyed.then(|| t.clone());
        let obj = Bound::new(py, PyTensor::new(t))?;
        let obj = if numpy {
            crate::tensor::to_array(&obj)?.unbind()
        } else {
            obj.into_any().unbind()
        };
        if let Some(t) = kept {
            self.made.insert(at, (t, obj.clone_ref(py)));
        }
        Ok(obj)
    }

    fn items(
        &mut self,
        py: Python<'_>,
        items: Vec<Node>,
        path: &mut Vec<String>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let mut v = Vec::with_capacity(items.len());
        for (i, n) in items.into_iter().enumerate() {
            path.push(i.to_string());
            let r = self.node(py, n, path);
            path.pop();
            v.push(r?);
        }
        Ok(v)
    }
}
