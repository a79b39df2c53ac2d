//! Converting between Python containers and tensorferry trees, for save and load.
//!
//! The Python package has already turned every tensor leaf into a `tensorferry.Tensor`
//! and every mapping into a dict; what is left here is exact: dict, list, tuple,
//! `Tensor`, `None`, bool, int, float, str.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use tensorferry::{Error, Node, TensorDict, Value};

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
        return Err(invalid(
            path,
            format!(
                "nested deeper than {} levels, the most tensorferry walks",
                crate::walk::MAX_DEPTH
            ),
        ));
    }
    if let Ok(t) = obj.cast::<PyTensor>() {
        return Ok(Node::Tensor(t.get().inner.clone()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut out = TensorDict::new();
        for (k, v) in d.iter() {
            let key: String = match k.cast::<PyString>() {
                Ok(s) => utf8(s, path, "the key")?,
                Err(_) => {
                    return Err(invalid(
                        path,
                        format!(
                            "dictionary keys must be strings, found {}",
                            k.get_type().name()?
                        ),
                    ))
                }
            };
            path.push(key.clone());
            let child = node_from_py(&v, path)?;
            path.pop();
            out.insert(key, child);
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
}

/// The Python containers of a tree: dict, list, tuple, plain values; tensors become NumPy
/// arrays or `Tensor` objects as `out` says (other frameworks are left to Python).
pub fn node_to_py(
    py: Python<'_>,
    node: Node,
    out: &mut Output<'_>,
    path: &mut Vec<String>,
) -> PyResult<Py<PyAny>> {
    Ok(match node {
        Node::Dict(d) => {
            let dict = PyDict::new(py);
            for (k, v) in d {
                path.push(k);
                let value = node_to_py(py, v, out, path);
                let k = path.pop().expect("pushed above");
                dict.set_item(k, value?)?;
            }
            dict.into_any().unbind()
        }
        Node::List(items) => PyList::new(py, items_to_py(py, items, out, path)?)?
            .into_any()
            .unbind(),
        Node::Tuple(items) => PyTuple::new(py, items_to_py(py, items, out, path)?)?
            .into_any()
            .unbind(),
        Node::Tensor(t) => {
            let kind = out.kind(path);
            let numpy = match kind {
                "numpy" => t.dtype().is_numpy_native() || out.ml_dtypes,
                "tensorferry" => false,
                _ => {
                    out.pending = true;
                    false
                }
            };
            let obj = Bound::new(py, PyTensor::new(t))?;
            if numpy {
                crate::numpy_interop::tensor_to_array(&obj)?.unbind()
            } else {
                obj.into_any().unbind()
            }
        }
        Node::Value(v) => match v {
            Value::None => py.None(),
            Value::Bool(b) => PyBool::new(py, b).to_owned().into_any().unbind(),
            Value::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
            Value::Float(x) => PyFloat::new(py, x).into_any().unbind(),
            Value::Str(s) => PyString::new(py, &s).into_any().unbind(),
        },
    })
}

fn items_to_py(
    py: Python<'_>,
    items: Vec<Node>,
    out: &mut Output<'_>,
    path: &mut Vec<String>,
) -> PyResult<Vec<Py<PyAny>>> {
    let mut v = Vec::with_capacity(items.len());
    for (i, n) in items.into_iter().enumerate() {
        path.push(i.to_string());
        let r = node_to_py(py, n, out, path);
        path.pop();
        v.push(r?);
    }
    Ok(v)
}
