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

/// The tree of a Python object; `path` is the key path so far, for error messages.
pub fn node_from_py(obj: &Bound<'_, PyAny>, path: &mut Vec<String>) -> PyResult<Node> {
    if let Ok(t) = obj.cast::<PyTensor>() {
        return Ok(Node::Tensor(t.get().inner.clone()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut out = TensorDict::new();
        for (k, v) in d.iter() {
            let key: String = match k.cast::<PyString>() {
                Ok(s) => s.to_cow()?.into_owned(),
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
            .map_err(|_| invalid(path, "integer does not fit in 64 bits".into()));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Node::Value(Value::Float(f.value())));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Node::Value(Value::Str(s.to_cow()?.into_owned())));
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

/// The Python containers of a tree: dict, list, tuple, `Tensor`, plain values.
pub fn node_to_py(py: Python<'_>, node: Node) -> PyResult<Py<PyAny>> {
    Ok(match node {
        Node::Dict(d) => {
            let out = PyDict::new(py);
            for (k, v) in d.iter() {
                out.set_item(k, node_to_py(py, v.clone())?)?;
            }
            out.into_any().unbind()
        }
        Node::List(items) => {
            let v = items
                .into_iter()
                .map(|n| node_to_py(py, n))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, v)?.into_any().unbind()
        }
        Node::Tuple(items) => {
            let v = items
                .into_iter()
                .map(|n| node_to_py(py, n))
                .collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, v)?.into_any().unbind()
        }
        Node::Tensor(t) => Py::new(py, PyTensor::new(t))?.into_any(),
        Node::Value(v) => match v {
            Value::None => py.None(),
            Value::Bool(b) => PyBool::new(py, b).to_owned().into_any().unbind(),
            Value::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
            Value::Float(x) => PyFloat::new(py, x).into_any().unbind(),
            Value::Str(s) => PyString::new(py, &s).into_any().unbind(),
        },
    })
}
