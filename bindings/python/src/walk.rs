//! The walker of Python containers: the one place that says which objects are containers
//! and walks them, for every call of the Python package. It enters every kind a user's
//! tree holds: dict, `OrderedDict` (rebuilt with its instance attributes, as PyTorch's
//! `state_dict()` needs), `defaultdict` (with its factory), any other `Mapping`, list and
//! tuple and their subclasses, and namedtuples; anything else is a leaf. The exact dict,
//! list and tuple that make up nearly every tree are told apart without calling Python.
//!
//! Every pass is bounded: a structure nested deeper than [`MAX_DEPTH`] levels, or one
//! that contains itself, is a `FormatError` naming where, never a stack overflow. A
//! container is walked from a snapshot of its items (`dict.copy()`, `list(m.items())`),
//! so another thread changing it while Python code runs (`kind_of`, a Mapping's methods)
//! cannot break the iteration.

use crate::errors::shown_path;
use crate::numpy_interop::{is_exact_ndarray, is_ndarray};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};

use crate::errors::to_py;
use crate::tensor::PyTensor;

/// The deepest nesting of containers the walkers accept (the conversion to a tree for
/// `save` too, and `tensorferry._tree.MAX_DEPTH` is this number).
pub const MAX_DEPTH: usize = 200;

/// A key and its value.
type Item<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>);

/// What the walker makes of an object.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Exactly a dict.
    Dict,
    /// Exactly a `collections.OrderedDict` (rebuilt as one, with its instance attributes).
    Ordered,
    /// Any other `collections.abc.Mapping` (a `defaultdict`, a dict subclass, …).
    Mapping,
    /// A list or a list subclass.
    List,
    /// A tuple or a tuple subclass that is not a namedtuple.
    Tuple,
    /// A tuple subclass with `_fields`: rebuilt by its fields.
    NamedTuple,
    /// Anything else.
    Leaf,
}

impl Kind {
    /// The kind of `obj`: the exact built-in containers first, without calling Python.
    fn of(obj: &Bound<'_, PyAny>) -> PyResult<Kind> {
        match Kind::exact(obj)? {
            Some(kind) => Ok(kind),
            None => Kind::other(obj),
        }
    }

    /// The kind of `obj`, known to be no exact dict, `OrderedDict`, list or tuple.
    fn other(obj: &Bound<'_, PyAny>) -> PyResult<Kind> {
        if is_plain(obj) || obj.is_exact_instance_of::<PyTensor>() || is_exact_ndarray(obj)? {
            return Ok(Kind::Leaf);
        }
        let py = obj.py();
        if obj.is_instance_of::<PyTuple>() {
            let named = obj.get_type().hasattr(pyo3::intern!(py, "_fields"))?;
            return Ok(if named { Kind::NamedTuple } else { Kind::Tuple });
        }
        if obj.is_instance_of::<PyList>() {
            return Ok(Kind::List);
        }
        if obj.is_instance(abc_mapping_type(py)?)? {
            return Ok(Kind::Mapping);
        }
        Ok(Kind::Leaf)
    }

    /// The kind of an exact dict, `OrderedDict`, list or tuple; None for anything else.
    fn exact(obj: &Bound<'_, PyAny>) -> PyResult<Option<Kind>> {
        Ok(if obj.is_exact_instance_of::<PyDict>() {
            Some(Kind::Dict)
        } else if obj.is_exact_instance_of::<PyList>() {
            Some(Kind::List)
        } else if obj.is_exact_instance_of::<PyTuple>() {
            Some(Kind::Tuple)
        } else if obj.get_type().is(ordered_dict_type(obj.py())?) {
            Some(Kind::Ordered)
        } else {
            None
        })
    }

    fn is_mapping(self) -> bool {
        matches!(self, Kind::Dict | Kind::Ordered | Kind::Mapping)
    }
}

fn ordered_dict_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static T: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    T.import(py, "collections", "OrderedDict")
}

fn abc_mapping_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static T: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    T.import(py, "collections.abc", "Mapping")
}

fn default_dict_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static T: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    T.import(py, "collections", "defaultdict")
}

/// The items of a container of `kind` as a snapshot, each with its key (an index for a
/// sequence): `dict.copy()` for a dict; `list(obj.items())` for any other mapping (for an
/// `OrderedDict`, the order of its links, which `move_to_end` changes, not of the dict
/// underneath); `list(obj)` for a sequence (a subclass's own `__iter__` runs).
fn items_of<'py>(obj: &Bound<'py, PyAny>, kind: Kind) -> PyResult<Vec<Item<'py>>> {
    let py = obj.py();
    if kind == Kind::Dict {
        return Ok(obj.cast::<PyDict>()?.copy()?.iter().collect());
    }
    let (iter, mapping) = match kind.is_mapping() {
        true => (
            obj.call_method0(pyo3::intern!(py, "items"))?.try_iter()?,
            true,
        ),
        false => (obj.try_iter()?, false),
    };
    let mut out = Vec::new();
    for (i, item) in iter.enumerate() {
        out.push(match mapping {
            true => item?.extract()?,
            false => (i.into_pyobject(py)?.into_any(), item?),
        });
    }
    Ok(out)
}

/// True for values that are certainly plain leaves, decided without calling Python.
fn is_plain(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_none()
        || obj.is_exact_instance_of::<PyString>()
        || obj.is_exact_instance_of::<PyInt>()
        || obj.is_exact_instance_of::<PyFloat>()
        || obj.is_exact_instance_of::<PyBool>()
}

fn invalid(key: String, reason: String) -> PyErr {
    to_py(tensorferry::Error::InvalidValue { key, reason })
}

/// The `FormatError` for a value at `key` nested deeper than [`MAX_DEPTH`] levels (the
/// conversion to a tree for `save` says the same).
pub fn too_deep(key: String) -> PyErr {
    invalid(
        key,
        format!("nested deeper than {MAX_DEPTH} levels, the most tensorferry walks"),
    )
}

/// Where a pass is: the key path from the root, and the ids of the containers enclosing
/// it, to refuse cycles and depth.
#[derive(Default)]
struct Position<'py> {
    path: Vec<Bound<'py, PyAny>>,
    ancestors: Vec<usize>,
}

impl<'py> Position<'py> {
    /// The key path as a tuple.
    fn key(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.path.iter())
    }

    /// Calls `visit` with each key and value of the container `obj` (of `kind`), the key
    /// pushed on the path, from a snapshot of its items ([`items_of`]), and stops at the
    /// first error. Entering `obj` is an error if it encloses itself or lies deeper than
    /// [`MAX_DEPTH`] levels.
    fn each_child(
        &mut self,
        obj: &Bound<'py, PyAny>,
        kind: Kind,
        mut visit: impl FnMut(&mut Self, &Bound<'py, PyAny>, &Bound<'py, PyAny>) -> PyResult<()>,
    ) -> PyResult<()> {
        let items = items_of(obj, kind)?;
        let id = obj.as_ptr() as usize;
        if self.ancestors.contains(&id) {
            return Err(invalid(
                shown_path(&self.path),
                "the structure contains itself here (a container inside itself); \
                 tensorferry needs a tree"
                    .into(),
            ));
        }
        if self.ancestors.len() >= MAX_DEPTH {
            return Err(too_deep(shown_path(&self.path)));
        }
        self.ancestors.push(id);
        let mut visited = Ok(());
        for (k, v) in &items {
            self.path.push(k.clone());
            visited = visit(self, k, v);
            self.path.pop();
            if visited.is_err() {
                break;
            }
        }
        self.ancestors.pop();
        visited
    }
}

/// `Ok(fallback)` in place of an ordinary exception `f` raised (never in place of a
/// `KeyboardInterrupt` or `SystemExit`).
fn or_on_exception<T>(py: Python<'_>, result: PyResult<T>, fallback: T) -> PyResult<T> {
    match result {
        Err(e) if e.is_instance_of::<PyException>(py) => Ok(fallback),
        other => other,
    }
}

/// `[(path, leaf)]` for every tensor leaf (as `kind_of` says) in traversal order; NumPy
/// arrays are left out when `skip_numpy` (for callers that have nothing to do on them).
/// With `select` (a `(obj, path) -> bool` that also takes some lists as leaves, such as
/// lists of numbers to become tensors), a list whose first item is a number, a list or a
/// tuple is a leaf when `select` says so; within the state dict of a PyTorch optimizer or
/// scheduler (`is_torch_state`) it is not asked: only tensors are leaves there. Paths
/// start with `prefix` (where `obj` lies in a larger tree).
/// `kind_of`'s answer must depend on the object's type alone (as `_frameworks.kind_of`'s,
/// cached by type, does): it is asked once per type of tensor leaf in a call. With
/// `plain`, the plain values (None, bool, int, float, str) come too, in their places.
#[pyfunction]
#[pyo3(signature = (obj, kind_of, skip_numpy=false, select=None, prefix=None, plain=false))]
pub fn collect_tensors<'py>(
    obj: &Bound<'py, PyAny>,
    kind_of: &Bound<'py, PyAny>,
    skip_numpy: bool,
    select: Option<Bound<'py, PyAny>>,
    prefix: Option<Bound<'py, PyTuple>>,
    plain: bool,
) -> PyResult<Vec<(Bound<'py, PyTuple>, Bound<'py, PyAny>)>> {
    let mut at = Position {
        path: prefix.map(|p| p.iter().collect()).unwrap_or_default(),
        ancestors: Vec::new(),
    };
    let mut walker = Walker {
        kind_of: Some(kind_of),
        skip_numpy,
        plain,
        select,
        tensor_types: Vec::new(),
        paths: Some(Vec::new()),
        leaves: Vec::new(),
    };
    walker.collect(obj, &mut at)?;
    Ok(walker
        .paths
        .unwrap_or_default()
        .into_iter()
        .zip(walker.leaves)
        .collect())
}

/// `obj` with each tensorferry tensor in it (exactly `Tensor`; NumPy arrays and other
/// objects are kept) replaced by what `convert` makes of it, in one call for all of them:
/// `convert(tensors, paths)` gets the list of those tensors in traversal order, each once
/// (a tensor under two keys, as tied weights are, has one replacement, put under both),
/// and their key paths (a list of tuples; a tensor's first) when `paths` is true, else
/// None, and returns a sequence of as many replacements, in the same order (a tensor
/// itself where it is to stay). Nothing is rebuilt, and `convert` is not called, when
/// `obj` holds no such tensor. Two passes over `obj`, the replacements put in by their
/// order: what a load's conversion to a framework takes. A tensor met in the second pass
/// that is not the one collected in its place, or one not met again, is an error (a
/// container whose `items()` order is not the same on both passes is one too).
#[pyfunction]
#[pyo3(signature = (obj, convert, paths=false))]
pub fn convert_native<'py>(
    obj: &Bound<'py, PyAny>,
    convert: &Bound<'py, PyAny>,
    paths: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let mut walker = Walker {
        kind_of: None,
        skip_numpy: true,
        plain: false,
        select: None,
        tensor_types: Vec::new(),
        paths: paths.then(Vec::new),
        leaves: Vec::new(),
    };
    walker.collect(obj, &mut Position::default())?;
    if walker.leaves.is_empty() {
        return Ok(obj.clone());
    }
    // Each tensor once: `order[i]` is the place among `unique` of the i-th one met.
    let mut first = std::collections::HashMap::with_capacity(walker.leaves.len());
    let (mut unique, mut unique_paths) = (Vec::new(), Vec::new());
    let mut order = Vec::with_capacity(walker.leaves.len());
    for (i, leaf) in walker.leaves.iter().enumerate() {
        order.push(*first.entry(leaf.as_ptr() as usize).or_insert_with(|| {
            unique.push(leaf.clone());
            if let Some(paths) = &walker.paths {
                unique_paths.push(paths[i].clone());
            }
            unique.len() - 1
        }));
    }
    let keys = match paths {
        true => Some(PyList::new(py, unique_paths)?),
        false => None,
    };
    let made = convert.call1((PyList::new(py, &unique)?, keys))?;
    let made: Vec<Bound<'py, PyAny>> = made.try_iter()?.collect::<PyResult<_>>()?;
    if made.len() != unique.len() {
        return Err(crate::errors::runtime_err(format!(
            "convert_native: {} replacements for {} tensors",
            made.len(),
            unique.len()
        )));
    }
    let r = Rebuilder {
        replacements: &PyDict::new(py),
        plain: false,
        strict: None,
        skip_numpy: false,
        convert: None,
        in_order: Some(InOrder {
            leaves: walker.leaves,
            order,
            made,
            next: std::cell::Cell::new(0),
        }),
    };
    let out = r.rebuild(obj, &mut Position::default())?;
    let (met, collected) = r
        .in_order
        .map_or((0, 0), |o| (o.next.get(), o.leaves.len()));
    if met != collected {
        return Err(crate::errors::runtime_err(format!(
            "the structure changed during the call: {} of its {collected} tensors were gone \
             when it was rebuilt (another thread modified it?)",
            collected - met
        )));
    }
    Ok(out)
}

struct Walker<'a, 'py> {
    /// Which other objects are tensors (None: only tensorferry's own tensors and NumPy
    /// arrays are).
    kind_of: Option<&'a Bound<'py, PyAny>>,
    skip_numpy: bool,
    /// Whether plain values are leaves too.
    plain: bool,
    select: Option<Bound<'py, PyAny>>,
    /// The types `kind_of` has called tensors in this call: a dictionary of 20,000 PyTorch
    /// tensors asks it once, not 20,000 times.
    tensor_types: Vec<Bound<'py, PyType>>,
    /// Each leaf's key path, when asked for.
    paths: Option<Vec<Bound<'py, PyTuple>>>,
    leaves: Vec<Bound<'py, PyAny>>,
}

/// True for the state dict of a PyTorch optimizer (it holds "state" and "param_groups")
/// or learning-rate scheduler (it holds "_last_lr", as every scheduler's does, or
/// "base_lrs" and "last_epoch"): records of hyper-parameters, whose lists of numbers
/// (`params`, `base_lrs`, `_last_lr`, `milestones`) are no data for `select`. A mapping
/// whose `in` fails holds no such state.
fn is_torch_state(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = obj.py();
    let has = |key: &Bound<'_, PyString>| obj.contains(key);
    let answer = (|| {
        Ok(
            (has(pyo3::intern!(py, "state"))? && has(pyo3::intern!(py, "param_groups"))?)
                || has(pyo3::intern!(py, "_last_lr"))?
                || (has(pyo3::intern!(py, "base_lrs"))? && has(pyo3::intern!(py, "last_epoch"))?),
        )
    })();
    or_on_exception(py, answer, false)
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
    fn collect(&mut self, obj: &Bound<'py, PyAny>, at: &mut Position<'py>) -> PyResult<()> {
        let kind = match Kind::exact(obj)? {
            Some(kind) => kind,
            None if self.is_tensor(obj)? => {
                if !(self.skip_numpy && is_exact_ndarray(obj)?) {
                    self.push(obj, at)?;
                }
                return Ok(());
            }
            None => Kind::other(obj)?,
        };
        if kind == Kind::Leaf {
            if self.plain && is_plain(obj) {
                self.push(obj, at)?;
            }
            return Ok(());
        }
        if kind == Kind::List && self.is_data(obj, at)? {
            self.push(obj, at)?;
            return Ok(());
        }
        // In a PyTorch optimizer's or scheduler's state, only tensors are leaves.
        let select = match &self.select {
            Some(_) if kind.is_mapping() && is_torch_state(obj)? => self.select.take(),
            _ => None,
        };
        let walked = at.each_child(obj, kind, |at, _, v| self.collect(v, at));
        if select.is_some() {
            self.select = select;
        }
        walked
    }

    /// Takes `obj` as a leaf, with its path when paths are kept.
    fn push(&mut self, obj: &Bound<'py, PyAny>, at: &Position<'py>) -> PyResult<()> {
        if let Some(paths) = &mut self.paths {
            paths.push(at.key(obj.py())?);
        }
        self.leaves.push(obj.clone());
        Ok(())
    }

    /// True for a tensor leaf (as `kind_of` says); plain values are not asked about.
    fn is_tensor(&mut self, obj: &Bound<'py, PyAny>) -> PyResult<bool> {
        if obj.is_exact_instance_of::<PyTensor>() || is_exact_ndarray(obj)? {
            return Ok(true);
        }
        if is_plain(obj) {
            return Ok(false);
        }
        let Some(kind_of) = self.kind_of else {
            return Ok(false);
        };
        let ty = obj.get_type();
        if self.tensor_types.iter().any(|t| t.is(&ty)) {
            return Ok(true);
        }
        if kind_of.call1((obj,))?.is_none() {
            return Ok(false);
        }
        self.tensor_types.push(ty);
        Ok(true)
    }

    /// True when `select` takes the list `obj` as one leaf (data).
    fn is_data(&self, obj: &Bound<'py, PyAny>, at: &Position<'py>) -> PyResult<bool> {
        let Some(select) = &self.select else {
            return Ok(false);
        };
        Ok(may_be_data(obj)? && select.call1((obj, at.key(obj.py())?))?.is_truthy()?)
    }
}

/// A new structure like `obj` with each object whose `id` is a key of `replacements`
/// swapped for its value; every other leaf is the very same object, and each container
/// of the same type where it can be built from its items (a Mapping subclass that cannot
/// becomes a dict, a list or tuple subclass a list or tuple).
/// With `plain`, every container becomes a dict, list or tuple. With `strict` (the
/// `kind_of` of the call), a tensor leaf that has no replacement is an error: it appeared
/// after the leaves were collected, so another thread changed the structure meanwhile
/// (NumPy arrays are exempt when `skip_numpy`, as in `collect_tensors`).
/// With `convert`, a `(type, function)`, each leaf of exactly that type becomes
/// `function(leaf)` in the same pass (what it raises, the call raises).
#[pyfunction]
#[pyo3(signature = (obj, replacements, plain=false, strict=None, skip_numpy=false, convert=None))]
pub fn rebuild<'py>(
    obj: &Bound<'py, PyAny>,
    replacements: &Bound<'py, PyDict>,
    plain: bool,
    strict: Option<Bound<'py, PyAny>>,
    skip_numpy: bool,
    convert: Option<(Bound<'py, PyType>, Bound<'py, PyAny>)>,
) -> PyResult<Bound<'py, PyAny>> {
    let r = Rebuilder {
        replacements,
        plain,
        strict,
        skip_numpy,
        convert,
        in_order: None,
    };
    r.rebuild(obj, &mut Position::default())
}

struct Rebuilder<'a, 'py> {
    replacements: &'a Bound<'py, PyDict>,
    plain: bool,
    strict: Option<Bound<'py, PyAny>>,
    skip_numpy: bool,
    convert: Option<(Bound<'py, PyType>, Bound<'py, PyAny>)>,
    /// [`convert_native`]'s replacements of tensorferry tensors, by their order.
    in_order: Option<InOrder<'py>>,
}

/// Replacements taken in traversal order: the `next` tensor met must be `leaves[next]`,
/// and its replacement is `made[order[next]]`.
struct InOrder<'py> {
    leaves: Vec<Bound<'py, PyAny>>,
    order: Vec<usize>,
    made: Vec<Bound<'py, PyAny>>,
    next: std::cell::Cell<usize>,
}

impl<'py> InOrder<'py> {
    /// The replacement of the tensor `obj`, met at `path`: an error when it is not the
    /// tensor collected in its place (the structure changed in between).
    fn take(
        &self,
        obj: &Bound<'py, PyAny>,
        path: &[Bound<'py, PyAny>],
    ) -> PyResult<Bound<'py, PyAny>> {
        let i = self.next.get();
        match self.leaves.get(i) {
            Some(leaf) if leaf.is(obj) => {
                self.next.set(i + 1);
                Ok(self.made[self.order[i]].clone())
            }
            _ => Err(changed(path)),
        }
    }
}

impl<'py> Rebuilder<'_, 'py> {
    fn rebuild(
        &self,
        obj: &Bound<'py, PyAny>,
        at: &mut Position<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if !self.replacements.is_empty() {
            if let Some(r) = self.replacements.get_item(obj.as_ptr() as usize)? {
                return Ok(r);
            }
        }
        if let Some(in_order) = &self.in_order {
            if obj.is_exact_instance_of::<PyTensor>() {
                return in_order.take(obj, &at.path);
            }
        }
        let kind = match Kind::exact(obj)? {
            Some(kind) => kind,
            None => match &self.convert {
                Some((ty, f)) if obj.get_type().is(ty) => return f.call1((obj,)),
                _ if self.is_unreplaced_tensor(obj)? => return Err(changed(&at.path)),
                _ => Kind::other(obj)?,
            },
        };
        let py = obj.py();
        if kind == Kind::Leaf {
            return Ok(obj.clone());
        }
        if kind.is_mapping() {
            let out = PyDict::new(py);
            at.each_child(obj, kind, |at, k, v| out.set_item(k, self.rebuild(v, at)?))?;
            if self.plain || kind == Kind::Dict {
                return Ok(out.into_any());
            }
            return same_mapping(obj, kind, out);
        }
        let out = PyList::empty(py);
        at.each_child(obj, kind, |at, _, v| out.append(self.rebuild(v, at)?))?;
        same_sequence(obj, kind, out, self.plain)
    }

    /// True when `obj` (no exact container) is a tensor that `strict` forbids: a tensor
    /// leaf without a replacement (NumPy arrays are allowed with `skip_numpy`).
    fn is_unreplaced_tensor(&self, obj: &Bound<'py, PyAny>) -> PyResult<bool> {
        let Some(kind_of) = &self.strict else {
            return Ok(false);
        };
        if is_plain(obj) {
            return Ok(false);
        }
        let native = obj.is_exact_instance_of::<PyTensor>();
        if !native && !is_exact_ndarray(obj)? && kind_of.call1((obj,))?.is_none() {
            return Ok(false);
        }
        Ok(native || !(self.skip_numpy && is_ndarray(obj)?))
    }
}

fn changed(path: &[Bound<'_, PyAny>]) -> PyErr {
    crate::errors::runtime_err(format!(
        "the structure changed during the call at {:?}: a tensor appeared that was not \
         there when its leaves were collected (another thread modified it?)",
        shown_path(path)
    ))
}

/// A mapping of `source`'s type holding `items`: an `OrderedDict` with `source`'s instance
/// attributes (the same objects, as every plain leaf is kept: PyTorch's `state_dict()`
/// carries the versions of its modules' formats in `_metadata`, which `load_state_dict`
/// reads); a `defaultdict` with its factory; a type that says how (a
/// `__tensorferry_rebuild__(source, items)` method, as `TensorDict`'s keeps its batch size);
/// any other type built from the items, or, when it cannot be, the plain dict. Never
/// changes `source`.
fn same_mapping<'py>(
    source: &Bound<'py, PyAny>,
    kind: Kind,
    items: Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = source.py();
    if kind == Kind::Ordered {
        let out = ordered_dict_type(py)?.call1((&items,))?;
        let attrs = source.getattr(pyo3::intern!(py, "__dict__"))?;
        if attrs.is_truthy()? {
            out.getattr(pyo3::intern!(py, "__dict__"))?
                .call_method1(pyo3::intern!(py, "update"), (attrs,))?;
        }
        return Ok(out);
    }
    let ty = source.get_type();
    if let Ok(rebuild) = ty.getattr(pyo3::intern!(py, "__tensorferry_rebuild__")) {
        return rebuild.call1((source, items));
    }
    let made = if source.is_instance(default_dict_type(py)?)? {
        source
            .getattr(pyo3::intern!(py, "default_factory"))
            .and_then(|factory| ty.call1((factory, &items)))
    } else {
        ty.call1((&items,))
    };
    or_on_exception(py, made, items.into_any())
}

/// A sequence like `source` (of `kind`) holding `items`: a namedtuple of its type by
/// fields; a list or tuple, or a subclass built from the items (the list or tuple when
/// it cannot be); with `plain`, a list or tuple.
fn same_sequence<'py>(
    source: &Bound<'py, PyAny>,
    kind: Kind,
    items: Bound<'py, PyList>,
    plain: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = source.py();
    let exact = source.is_exact_instance_of::<PyList>() || source.is_exact_instance_of::<PyTuple>();
    let base = |items: Bound<'py, PyList>| -> PyResult<Bound<'py, PyAny>> {
        Ok(if kind == Kind::List {
            items.into_any()
        } else {
            items.to_tuple().into_any()
        })
    };
    if plain || exact {
        return base(items);
    }
    let ty = source.get_type();
    if kind == Kind::NamedTuple {
        return ty.call1(items.to_tuple());
    }
    match or_on_exception(py, ty.call1((&items,)).map(Some), None)? {
        Some(made) => Ok(made),
        None => base(items),
    }
}

/// What the walker makes of `obj`: "dict" (exactly a dict), "mapping" (any other
/// Mapping, `OrderedDict` included), "list" (subclasses too), "tuple" (subclasses that
/// are not namedtuples too), "namedtuple", or None for a leaf. For code that compares or
/// prunes trees the walker has already checked.
#[pyfunction]
pub fn container_kind(obj: &Bound<'_, PyAny>) -> PyResult<Option<&'static str>> {
    Ok(match Kind::of(obj)? {
        Kind::Dict => Some("dict"),
        Kind::Ordered | Kind::Mapping => Some("mapping"),
        Kind::List => Some("list"),
        Kind::Tuple => Some("tuple"),
        Kind::NamedTuple => Some("namedtuple"),
        Kind::Leaf => None,
    })
}

/// Every key of `obj`'s nested mappings in traversal order: a top-level key as it is, a
/// nested one as its key path (a tuple). Only mappings are entered.
#[pyfunction]
pub fn nested_keys<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    fn walk<'py>(
        obj: &Bound<'py, PyAny>,
        kind: Kind,
        at: &mut Position<'py>,
        out: &mut Vec<Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        at.each_child(obj, kind, |at, k, v| {
            out.push(match at.path.len() {
                1 => k.clone(),
                _ => at.key(obj.py())?.into_any(),
            });
            match Kind::of(v)? {
                kind if kind.is_mapping() => walk(v, kind, at, out),
                _ => Ok(()),
            }
        })
    }
    let mut out = Vec::new();
    walk(obj, Kind::of(obj)?, &mut Position::default(), &mut out)?;
    Ok(out)
}

/// The part of `obj` whose leaves `keep(path)` says true for, as plain containers (every
/// mapping a dict, a tuple or namedtuple a tuple, a list a list); containers left empty
/// are dropped, and None is returned when nothing is kept.
#[pyfunction]
pub fn prune<'py>(
    obj: &Bound<'py, PyAny>,
    keep: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    fn walk<'py>(
        obj: &Bound<'py, PyAny>,
        at: &mut Position<'py>,
        keep: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = obj.py();
        let kind = Kind::of(obj)?;
        if kind == Kind::Leaf {
            let kept = keep.call1((at.key(py)?,))?.is_truthy()?;
            return Ok(kept.then(|| obj.clone()));
        }
        let (dict, list) = (PyDict::new(py), PyList::empty(py));
        at.each_child(obj, kind, |at, k, v| match walk(v, at, keep)? {
            Some(v) if kind.is_mapping() => dict.set_item(k, v),
            Some(v) => list.append(v),
            None => Ok(()),
        })?;
        Ok(match kind {
            _ if kind.is_mapping() => (!dict.is_empty()).then(|| dict.into_any()),
            _ if list.is_empty() => None,
            Kind::List => Some(list.into_any()),
            _ => Some(list.to_tuple().into_any()),
        })
    }
    walk(obj, &mut Position::default(), keep)
}
