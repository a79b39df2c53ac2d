//! The two tree passes of the Python package, done natively for the containers that make
//! up nearly every tree (exact dict, list and tuple); any other container (a Mapping
//! subclass, a namedtuple) is handed back to the Python implementation for its subtree,
//! so the rules stay in one place: `tensorferry._tree`.

use crate::numpy_interop::{is_exact_ndarray, is_ndarray};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::tensor::PyTensor;

fn python_tree(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static M: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    Ok(
        M.get_or_try_init(py, || py.import("tensorferry._tree").map(Bound::unbind))?
            .bind(py),
    )
}

/// True for values that are certainly plain leaves, decided without calling Python.
fn is_plain(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_none()
        || obj.is_exact_instance_of::<PyString>()
        || obj.is_exact_instance_of::<PyInt>()
        || obj.is_exact_instance_of::<PyFloat>()
        || obj.is_exact_instance_of::<PyBool>()
}

/// `[(path, leaf)]` for every tensor leaf (as `kind_of` says) in traversal order; NumPy
/// arrays are left out when `skip_numpy` (for callers that have nothing to do on them).
#[pyfunction]
#[pyo3(signature = (obj, kind_of, skip_numpy=false))]
pub fn collect_tensors<'py>(
    obj: &Bound<'py, PyAny>,
    kind_of: &Bound<'py, PyAny>,
    skip_numpy: bool,
) -> PyResult<Vec<(Bound<'py, PyTuple>, Bound<'py, PyAny>)>> {
    let mut out = Vec::new();
    let mut path: Vec<Bound<'py, PyAny>> = Vec::new();
    let walker = Walker {
        kind_of,
        skip_numpy,
    };
    walker.collect(obj, &mut path, &mut out)?;
    Ok(out)
}

struct Walker<'a, 'py> {
    kind_of: &'a Bound<'py, PyAny>,
    skip_numpy: bool,
}

impl<'py> Walker<'_, 'py> {
    fn collect(
        &self,
        obj: &Bound<'py, PyAny>,
        path: &mut Vec<Bound<'py, PyAny>>,
        out: &mut Vec<(Bound<'py, PyTuple>, Bound<'py, PyAny>)>,
    ) -> PyResult<()> {
        let py = obj.py();
        if let Ok(d) = obj.cast_exact::<PyDict>() {
            for (k, v) in d.iter() {
                path.push(k);
                self.collect(&v, path, out)?;
                path.pop();
            }
            return Ok(());
        }
        if obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>() {
            for (i, v) in obj.try_iter()?.enumerate() {
                path.push(i.into_pyobject(py)?.into_any());
                self.collect(&v?, path, out)?;
                path.pop();
            }
            return Ok(());
        }
        if obj.is_exact_instance_of::<PyTensor>() {
            out.push((PyTuple::new(py, path.iter())?, obj.clone()));
            return Ok(());
        }
        if is_exact_ndarray(obj)? {
            if !self.skip_numpy {
                out.push((PyTuple::new(py, path.iter())?, obj.clone()));
            }
            return Ok(());
        }
        if is_plain(obj) {
            return Ok(());
        }
        if !self.kind_of.call1((obj,))?.is_none() {
            out.push((PyTuple::new(py, path.iter())?, obj.clone()));
            return Ok(());
        }
        // Some other container (or an unknown leaf): the Python rules decide.
        let select = python_tree(py)?.getattr("select_tensors")?;
        let prefix = PyTuple::new(py, path.iter())?;
        let found = python_tree(py)?.call_method1("collect", (obj, select, prefix))?;
        for item in found.try_iter()? {
            let (p, leaf): (Bound<'py, PyTuple>, Bound<'py, PyAny>) = item?.extract()?;
            if !(self.skip_numpy && is_ndarray(&leaf)?) {
                out.push((p, leaf));
            }
        }
        Ok(())
    }
}

/// A new structure like `obj` with each object whose `id` is a key of `replacements`
/// swapped for its value; every other leaf is the very same object.
/// With `plain`, every container becomes a dict, list or tuple.
#[pyfunction]
#[pyo3(signature = (obj, replacements, plain=false))]
pub fn rebuild<'py>(
    obj: &Bound<'py, PyAny>,
    replacements: &Bound<'py, PyDict>,
    plain: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    if !replacements.is_empty() {
        let id = obj.as_ptr() as usize;
        if let Some(r) = replacements.get_item(id)? {
            return Ok(r);
        }
    }
    if let Ok(d) = obj.cast_exact::<PyDict>() {
        let out = PyDict::new(py);
        for (k, v) in d.iter() {
            out.set_item(k, rebuild(&v, replacements, plain)?)?;
        }
        return Ok(out.into_any());
    }
    if let Ok(l) = obj.cast_exact::<PyList>() {
        let items = l
            .iter()
            .map(|v| rebuild(&v, replacements, plain))
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(PyList::new(py, items)?.into_any());
    }
    if let Ok(t) = obj.cast_exact::<PyTuple>() {
        let items = t
            .iter()
            .map(|v| rebuild(&v, replacements, plain))
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(PyTuple::new(py, items)?.into_any());
    }
    if is_plain(obj) || obj.is_exact_instance_of::<PyTensor>() || is_exact_ndarray(obj)? {
        return Ok(obj.clone());
    }
    python_tree(py)?.call_method1("rebuild", (obj, replacements, plain))
}
