//! The two tree passes of the Python package, done natively for the containers that make
//! up nearly every tree (exact dict, list and tuple, and the `OrderedDict` that PyTorch's
//! `state_dict()` returns); any other container (a Mapping subclass, a namedtuple) is
//! handed back to the Python implementation for its subtree, so the rules stay in one
//! place: `tensorferry._tree`, whose `_same_mapping` rebuilds an `OrderedDict` as
//! [`Rebuilder`] does here.
//!
//! Both passes are bounded: a structure nested deeper than [`MAX_DEPTH`] levels, or one
//! that contains itself, is a `FormatError` naming where, never a stack overflow. A dict
//! is walked from a snapshot (`dict.copy()`), so another thread changing it while Python
//! code runs (`kind_of`, a Mapping's methods) cannot break the iteration.

use crate::numpy_interop::{is_exact_ndarray, is_ndarray};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};

use crate::errors::to_py;
use crate::tensor::PyTensor;

/// The deepest nesting of containers the walkers accept (the Python rules in
/// `tensorferry._tree` use the same number, read from `_native.MAX_DEPTH`).
pub const MAX_DEPTH: usize = 200;

fn python_tree(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static M: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    Ok(
        M.get_or_try_init(py, || py.import("tensorferry._tree").map(Bound::unbind))?
            .bind(py),
    )
}

/// A key and its value.
type Item<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>);

/// The mappings the native passes walk: an exact dict, or exactly a
/// `collections.OrderedDict` (rebuilt as one, with its instance attributes).
enum Mapping {
    Dict,
    Ordered,
}

/// `obj`'s items in its order and its kind of mapping, when the native passes walk it: a
/// snapshot either way, so that Python code run meanwhile cannot break the iteration
/// (`dict.copy()` for a dict; for an `OrderedDict`, `list(obj.items())`, whose order is
/// that of its links, which `move_to_end` changes, not of the dict underneath).
fn mapping_items<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<(Vec<Item<'py>>, Mapping)>> {
    let py = obj.py();
    if let Ok(d) = obj.cast_exact::<PyDict>() {
        return Ok(Some((d.copy()?.iter().collect(), Mapping::Dict)));
    }
    if !obj.get_type().is(ordered_dict_type(py)?) {
        return Ok(None);
    }
    let items = obj.call_method0(pyo3::intern!(py, "items"))?;
    let mut out = Vec::with_capacity(obj.len()?);
    for item in items.try_iter()? {
        out.push(item?.extract()?);
    }
    Ok(Some((out, Mapping::Ordered)))
}

fn ordered_dict_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static T: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    T.import(py, "collections", "OrderedDict")
}

/// True for values that are certainly plain leaves, decided without calling Python.
fn is_plain(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_none()
        || obj.is_exact_instance_of::<PyString>()
        || obj.is_exact_instance_of::<PyInt>()
        || obj.is_exact_instance_of::<PyFloat>()
        || obj.is_exact_instance_of::<PyBool>()
}

/// A key path for messages, "a/b/0", shortened in the middle when very deep.
pub fn shown_path(path: &[Bound<'_, PyAny>]) -> String {
    let part = |p: &Bound<'_, PyAny>| p.str().map(|s| s.to_string()).unwrap_or_default();
    if path.len() <= 12 {
        return path.iter().map(part).collect::<Vec<_>>().join("/");
    }
    let head: Vec<String> = path[..5].iter().map(part).collect();
    let tail: Vec<String> = path[path.len() - 5..].iter().map(part).collect();
    format!(
        "{}/…({} more)…/{}",
        head.join("/"),
        path.len() - 10,
        tail.join("/")
    )
}

fn invalid(path: &[Bound<'_, PyAny>], reason: String) -> PyErr {
    to_py(tensorferry::Error::InvalidValue {
        key: shown_path(path),
        reason,
    })
}

/// The ids of the containers enclosing the current position, to refuse cycles and depth.
#[derive(Default)]
struct Ancestors(Vec<usize>);

impl Ancestors {
    /// Enters `obj` (a container) at `path`: an error if it encloses itself or is too deep.
    fn enter(&mut self, obj: &Bound<'_, PyAny>, path: &[Bound<'_, PyAny>]) -> PyResult<()> {
        let id = obj.as_ptr() as usize;
        if self.0.contains(&id) {
            return Err(invalid(
                path,
                "the structure contains itself here (a container inside itself); \
                 tensorferry needs a tree"
                    .into(),
            ));
        }
        if self.0.len() >= MAX_DEPTH {
            return Err(invalid(
                path,
                format!("nested deeper than {MAX_DEPTH} levels, the most tensorferry walks"),
            ));
        }
        self.0.push(id);
        Ok(())
    }

    fn leave(&mut self) {
        self.0.pop();
    }
}

/// `[(path, leaf)]` for every tensor leaf (as `kind_of` says) in traversal order; NumPy
/// arrays are left out when `skip_numpy` (for callers that have nothing to do on them).
/// With `select` (a `(obj, path) -> bool` that also takes some lists as leaves, such as
/// lists of numbers to become tensors), a list whose first item is a number, a list or a
/// tuple is a leaf when `select` says so, and subtrees left to the Python rules use it;
/// within the state dict of a PyTorch optimizer or scheduler (`is_torch_state`) it is not
/// asked: only tensors are leaves there.
/// `kind_of`'s answer must depend on the object's type alone (as `_frameworks.kind_of`'s,
/// cached by type, does): it is asked once per type of tensor leaf in a call.
#[pyfunction]
#[pyo3(signature = (obj, kind_of, skip_numpy=false, select=None))]
pub fn collect_tensors<'py>(
    obj: &Bound<'py, PyAny>,
    kind_of: &Bound<'py, PyAny>,
    skip_numpy: bool,
    select: Option<Bound<'py, PyAny>>,
) -> PyResult<Vec<(Bound<'py, PyTuple>, Bound<'py, PyAny>)>> {
    let mut out = Vec::new();
    let mut path: Vec<Bound<'py, PyAny>> = Vec::new();
    let mut walker = Walker {
        kind_of,
        skip_numpy,
        select,
        ancestors: Ancestors::default(),
        tensor_types: Vec::new(),
    };
    walker.collect(obj, &mut path, &mut out)?;
    Ok(out)
}

struct Walker<'a, 'py> {
    kind_of: &'a Bound<'py, PyAny>,
    skip_numpy: bool,
    select: Option<Bound<'py, PyAny>>,
    ancestors: Ancestors,
    /// The types `kind_of` has called tensors in this call: a dictionary of 20,000 PyTorch
    /// tensors asks it once, not 20,000 times.
    tensor_types: Vec<Bound<'py, PyType>>,
}

/// True for the state dict of a PyTorch optimizer (it holds "state" and "param_groups")
/// or learning-rate scheduler (it holds "_last_lr", as every scheduler's does, or
/// "base_lrs" and "last_epoch"): records of hyper-parameters, whose lists of numbers
/// (`params`, `base_lrs`, `_last_lr`, `milestones`) are no data for `select`
/// (`tensorferry._tree.is_torch_state` says the same for the Python walk).
fn is_torch_state(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = obj.py();
    let has = |key: &Bound<'_, PyString>| obj.contains(key);
    Ok(
        (has(pyo3::intern!(py, "state"))? && has(pyo3::intern!(py, "param_groups"))?)
            || has(pyo3::intern!(py, "_last_lr"))?
            || (has(pyo3::intern!(py, "base_lrs"))? && has(pyo3::intern!(py, "last_epoch"))?),
    )
}

/// True when a list could be data for `select`: its first item is a number or a list or
/// tuple (lists of tensors and of strings are never asked about; a tuple is a record,
/// never data).
fn may_be_data(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let Ok(first) = obj.get_item(0) else {
        return Ok(false);
    };
    Ok(first.is_instance_of::<PyInt>()
        || first.is_instance_of::<PyFloat>()
        || first.is_instance_of::<PyList>()
        || first.is_instance_of::<PyTuple>())
}

impl<'py> Walker<'_, 'py> {
    fn collect(
        &mut self,
        obj: &Bound<'py, PyAny>,
        path: &mut Vec<Bound<'py, PyAny>>,
        out: &mut Vec<(Bound<'py, PyTuple>, Bound<'py, PyAny>)>,
    ) -> PyResult<()> {
        let py = obj.py();
        if let Some((items, _)) = mapping_items(obj)? {
            self.ancestors.enter(obj, path)?;
            // In a PyTorch optimizer's or scheduler's state, only tensors are leaves.
            let select = match &self.select {
                Some(_) if is_torch_state(obj)? => self.select.take(),
                _ => None,
            };
            let mut walked = Ok(());
            for (k, v) in items {
                path.push(k);
                walked = self.collect(&v, path, out);
                path.pop();
                if walked.is_err() {
                    break;
                }
            }
            if select.is_some() {
                self.select = select;
            }
            walked?;
            self.ancestors.leave();
            return Ok(());
        }
        if obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>() {
            if let Some(select) = &self.select {
                if obj.is_exact_instance_of::<PyList>()
                    && may_be_data(obj)?
                    && select
                        .call1((obj, PyTuple::new(py, path.iter())?))?
                        .is_truthy()?
                {
                    out.push((PyTuple::new(py, path.iter())?, obj.clone()));
                    return Ok(());
                }
            }
            self.ancestors.enter(obj, path)?;
            // A list is read by index against its length at each step: safe whatever
            // another thread does to it meanwhile.
            for (i, v) in obj.try_iter()?.enumerate() {
                path.push(i.into_pyobject(py)?.into_any());
                self.collect(&v?, path, out)?;
                path.pop();
            }
            self.ancestors.leave();
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
        let ty = obj.get_type();
        if self.tensor_types.iter().any(|t| t.is(&ty)) {
            out.push((PyTuple::new(py, path.iter())?, obj.clone()));
            return Ok(());
        }
        if !self.kind_of.call1((obj,))?.is_none() {
            self.tensor_types.push(ty);
            out.push((PyTuple::new(py, path.iter())?, obj.clone()));
            return Ok(());
        }
        // Some other container (or an unknown leaf): the Python rules decide, with the
        // depth left and the ancestors so far.
        let select = match &self.select {
            Some(select) => select.clone(),
            None => python_tree(py)?.getattr("select_tensors")?,
        };
        let prefix = PyTuple::new(py, path.iter())?;
        let ancestors = PyTuple::new(py, self.ancestors.0.iter())?;
        let found = python_tree(py)?
            .call_method1("collect", (obj, select, prefix, py.None(), ancestors))?;
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
/// With `plain`, every container becomes a dict, list or tuple. With `strict` (the
/// `kind_of` of the call), a tensor leaf that has no replacement is an error: it appeared
/// after the leaves were collected, so another thread changed the structure meanwhile
/// (NumPy arrays are exempt when `skip_numpy`, as in `collect_tensors`).
#[pyfunction]
#[pyo3(signature = (obj, replacements, plain=false, strict=None, skip_numpy=false))]
pub fn rebuild<'py>(
    obj: &Bound<'py, PyAny>,
    replacements: &Bound<'py, PyDict>,
    plain: bool,
    strict: Option<Bound<'py, PyAny>>,
    skip_numpy: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let mut r = Rebuilder {
        replacements,
        plain,
        strict,
        skip_numpy,
        ancestors: Ancestors::default(),
        path: Vec::new(),
    };
    r.rebuild(obj)
}

struct Rebuilder<'a, 'py> {
    replacements: &'a Bound<'py, PyDict>,
    plain: bool,
    strict: Option<Bound<'py, PyAny>>,
    skip_numpy: bool,
    ancestors: Ancestors,
    path: Vec<Bound<'py, PyAny>>,
}

impl<'py> Rebuilder<'_, 'py> {
    fn rebuild(&mut self, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = obj.py();
        if !self.replacements.is_empty() {
            let id = obj.as_ptr() as usize;
            if let Some(r) = self.replacements.get_item(id)? {
                return Ok(r);
            }
        }
        if let Some((items, mapping)) = mapping_items(obj)? {
            self.ancestors.enter(obj, &self.path)?;
            let ordered = matches!(mapping, Mapping::Ordered) && !self.plain;
            let out = if ordered {
                ordered_dict_type(py)?.call0()?
            } else {
                PyDict::new(py).into_any()
            };
            for (k, v) in items {
                self.path.push(k.clone());
                let value = self.rebuild(&v)?;
                self.path.pop();
                out.set_item(k, value)?;
            }
            self.ancestors.leave();
            if ordered {
                keep_attributes(obj, &out)?;
            }
            return Ok(out);
        }
        let exact_list = obj.is_exact_instance_of::<PyList>();
        if exact_list || obj.is_exact_instance_of::<PyTuple>() {
            self.ancestors.enter(obj, &self.path)?;
            let mut items = Vec::new();
            for (i, v) in obj.try_iter()?.enumerate() {
                self.path.push(i.into_pyobject(py)?.into_any());
                items.push(self.rebuild(&v?)?);
                self.path.pop();
            }
            self.ancestors.leave();
            return Ok(if exact_list {
                PyList::new(py, items)?.into_any()
            } else {
                PyTuple::new(py, items)?.into_any()
            });
        }
        if is_plain(obj) {
            return Ok(obj.clone());
        }
        let native = obj.is_exact_instance_of::<PyTensor>();
        let ndarray = !native && is_exact_ndarray(obj)?;
        if native || ndarray {
            if self.strict.is_some() && (native || !self.skip_numpy) {
                return Err(self.changed());
            }
            return Ok(obj.clone());
        }
        if let Some(kind_of) = &self.strict {
            if !kind_of.call1((obj,))?.is_none() {
                if self.skip_numpy && is_ndarray(obj)? {
                    return Ok(obj.clone());
                }
                return Err(self.changed());
            }
        }
        let ancestors = PyTuple::new(py, self.ancestors.0.iter())?;
        let prefix = PyTuple::new(py, self.path.iter())?;
        python_tree(py)?.call_method1(
            "rebuild",
            (
                obj,
                self.replacements,
                self.plain,
                ancestors,
                prefix,
                self.strict.clone(),
                self.skip_numpy,
            ),
        )
    }

    fn changed(&self) -> PyErr {
        crate::errors::runtime_err(format!(
            "the structure changed during the call at {:?}: a tensor appeared that was not \
             there when its leaves were collected (another thread modified it?)",
            shown_path(&self.path)
        ))
    }
}

/// Gives `out` (a new `OrderedDict`) the instance attributes of `source` (the same
/// objects, as every plain leaf is kept): PyTorch's `state_dict()` carries the versions of
/// its modules' formats in `_metadata`, which `load_state_dict` reads.
fn keep_attributes(source: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = source.py();
    let attrs = source.getattr(pyo3::intern!(py, "__dict__"))?;
    if attrs.is_truthy()? {
        out.getattr(pyo3::intern!(py, "__dict__"))?
            .call_method1(pyo3::intern!(py, "update"), (attrs,))?;
    }
    Ok(())
}
