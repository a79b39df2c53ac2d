//! The native core of the `tensorferry` Python package: a thin adapter that converts
//! Python objects and errors; every behaviour lives in the `tensorferry` crate.

mod cai;
mod direct_runs;
mod dlpack;
mod errors;
mod groups;
mod host_copy;
mod numpy_interop;
mod release;
mod runs;
mod tensor;
mod tree;
mod wait;
mod walk;

use std::collections::BTreeMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tensorferry::internal::backend::StreamHandle;
use tensorferry::internal::io::object;
use tensorferry::internal::transfer::Readable;
use tensorferry::{Device, LoadOptions, SaveOptions};

use errors::{guard, IntoPy};
use tensor::PyTensor;

/// The canonical form of a device string; raises `InvalidDeviceError` for a bad one.
#[pyfunction]
fn parse_device(device: &str) -> PyResult<String> {
    guard(|| device.parse::<Device>().py_err().map(|d| d.to_string()))
}

/// Raises `DeviceUnavailableError` (with the reason) when `device` cannot be used now.
#[pyfunction]
fn ensure_device(device: &str) -> PyResult<String> {
    guard(|| {
        let d: Device = device.parse().py_err()?;
        d.ensure_available().py_err()?;
        Ok(d.to_string())
    })
}

/// The devices present, host first.
#[pyfunction]
fn devices() -> Vec<String> {
    tensorferry::available_devices()
        .iter()
        .map(|d| d.to_string())
        .collect()
}

/// Moves tensors to `device` in one planned transfer (GIL released); see
/// `tensorferry::move_tensors`. With `non_blocking` the copies may still run: every read
/// of a result waits for its copy.
#[pyfunction]
#[pyo3(signature = (tensors, device, copy=false, non_blocking=false, pinned=false, staging=None))]
fn move_tensors(
    py: Python<'_>,
    tensors: Vec<Py<PyTensor>>,
    device: &str,
    copy: bool,
    non_blocking: bool,
    pinned: bool,
    staging: Option<Bound<'_, PyAny>>,
) -> PyResult<Vec<PyTensor>> {
    guard(|| {
        let target: Device = device.parse().py_err()?;
        let refs: Vec<&tensorferry::Tensor> = tensors.iter().map(|t| &t.get().inner).collect();
        let options = tensorferry::MoveOptions {
            copy,
            non_blocking,
            pinned,
            staging: parse_staging(staging.as_ref())?,
            ..Default::default()
        };
        let moved = wait::move_tensors(py, &refs, target, options)?;
        Ok(moved.into_iter().map(PyTensor::new).collect())
    })
}

/// `staging=`: None or "auto", "off", "on" (the automatic ring, whatever the device and
/// size), or `(chunk_bytes, depth)` within the limits of `tensorferry::Staging::validate`,
/// whose error (a `FormatError`, also a `ValueError`) names the value out of range.
fn parse_staging(value: Option<&Bound<'_, PyAny>>) -> PyResult<tensorferry::Staging> {
    use tensorferry::internal::transfer::staging::{AUTO_CHUNK_BYTES, AUTO_DEPTH, RING_LIMITS};
    use tensorferry::Staging;
    let Some(v) = value.filter(|v| !v.is_none()) else {
        return Ok(Staging::Auto);
    };
    let refused = |reason: String| {
        errors::to_py(tensorferry::Error::InvalidValue {
            key: "staging".into(),
            reason,
        })
    };
    if let Ok(text) = v.extract::<String>() {
        return match text.as_str() {
            "auto" => Ok(Staging::Auto),
            "off" => Ok(Staging::Off),
            "on" => Ok(Staging::Ring {
                chunk_bytes: AUTO_CHUNK_BYTES,
                depth: AUTO_DEPTH,
            }),
            other => Err(refused(format!(
                "{other:?}: expected \"auto\", \"off\", \"on\" or (chunk_bytes, depth)"
            ))),
        };
    }
    let pair = v
        .extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>()
        .map_err(|_| {
            refused(format!(
                "{}: expected \"auto\", \"off\", \"on\" or (chunk_bytes, depth)",
                shown(v)
            ))
        })?;
    let whole = |x: &Bound<'_, PyAny>, name: &str| match x.extract::<usize>() {
        Ok(n) if !x.is_instance_of::<pyo3::types::PyBool>() => Ok(n),
        _ => Err(refused(format!(
            "({}, {}): {name}={} is out of range: {RING_LIMITS}",
            shown(&pair.0),
            shown(&pair.1),
            shown(x)
        ))),
    };
    let chunk_bytes = whole(&pair.0, "chunk_bytes")?;
    let depth = whole(&pair.1, "depth")?;
    Staging::Ring { chunk_bytes, depth }.validate().py_err()
}

/// `repr(value)`, or a stand-in where even that fails.
fn shown(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".into())
}

/// Checks a `staging=` argument without moving anything (for calls that would otherwise
/// take it only later, or not at all).
#[pyfunction]
#[pyo3(signature = (staging=None))]
fn check_staging(staging: Option<Bound<'_, PyAny>>) -> PyResult<()> {
    guard(|| parse_staging(staging.as_ref()).map(drop))
}

/// Sets up emulated device `index` from `key=value,…` settings (see `TENSORFERRY_EMU`).
#[pyfunction]
fn configure_emulated(index: usize, settings: &str) -> PyResult<()> {
    guard(|| {
        // Its errors name the settings given here, not the variable read otherwise.
        let config = tensorferry::internal::backend::emulated::EmuConfig::parse(settings)
            .map_err(|e| match e {
                tensorferry::Error::InvalidValue { reason, .. } => {
                    tensorferry::Error::InvalidValue {
                        key: "configure_emulated".into(),
                        reason,
                    }
                }
                other => other,
            })
            .py_err()?;
        tensorferry::internal::backend::emulated::configure(index, config).py_err()
    })
}

/// Statistics of `device`'s pinned host pool: `{"pinned_bytes", "cached_bytes", "hits",
/// "misses"}`.
#[pyfunction]
fn pinned_pool_stats<'py>(py: Python<'py>, device: &str) -> PyResult<Bound<'py, PyDict>> {
    guard(|| {
        let d: Device = device.parse().py_err()?;
        if d == Device::Cpu {
            return Err(tensorferry::Error::InvalidValue {
                key: "device".into(),
                reason: "the host has no pool of its own: name the device whose copies to the \
                         host land in it (\"cuda:0\", \"emu:0\")"
                    .into(),
            })
            .py_err();
        }
        let s = tensorferry::internal::backend::backend_for(d)
            .py_err()?
            .pinned_pool()
            .py_err()?
            .stats();
        let out = PyDict::new(py);
        out.set_item("pinned_bytes", s.pinned_bytes)?;
        out.set_item("cached_bytes", s.cached_bytes)?;
        out.set_item("hits", s.hits)?;
        out.set_item("misses", s.misses)?;
        Ok(out)
    })
}

/// Waits for a raw CUDA stream handle's queued work (the producer's stream), in GPU
/// `ordinal`'s context (the default-stream handles 1 and 2 name that GPU's).
#[pyfunction]
fn cuda_stream_synchronize(py: Python<'_>, ordinal: usize, handle: usize) -> PyResult<()> {
    guard(|| {
        // SAFETY: the handle comes from the user (the `stream=` argument of the Python API:
        // a producer's raw `CUstream`, e.g. `torch.cuda.current_stream().cuda_stream`, or
        // 1/2 for the default streams), trusted as PyTorch's `ExternalStream` trusts its
        // integer. We cannot check it: the driver validates handles it knows of, so an
        // arbitrary integer is only as safe as that validation.
        let stream = unsafe { StreamHandle::new(handle) };
        let gpu = tensorferry::internal::backend::backend_for(Device::Cuda(ordinal)).py_err()?;
        py.detach(|| gpu.synchronize_stream(stream)).py_err()
    })
}

/// Orders tensorferry's copies on GPU `ordinal` after a producer's raw CUDA stream's
/// queued work, on the GPU (the caller does not wait).
#[pyfunction]
fn cuda_order_after_stream(ordinal: usize, handle: usize) -> PyResult<()> {
    guard(|| {
        // SAFETY: as in `cuda_stream_synchronize`: the handle is the user's `stream=`, a
        // stream of that GPU (its device is read from the framework's stream object, or is
        // the one GPU the call's tensors live on), trusted as PyTorch trusts
        // `ExternalStream`'s integer.
        let stream = unsafe { StreamHandle::new(handle) };
        tensorferry::internal::backend::backend_for(Device::Cuda(ordinal))
            .and_then(|gpu| gpu.order_after_stream(stream))
            .py_err()
    })
}

/// Writes a tree of dict/list/tuple, `Tensor` and plain values as a safetensors file, or
/// with `max_shard_bytes` as shards of at most that much data plus their index (one file
/// when it all fits). Returns the files written.
#[pyfunction]
#[pyo3(signature = (tree, path, metadata=None, fsync=true, max_shard_bytes=None, staging=None))]
fn save(
    py: Python<'_>,
    tree: &Bound<'_, PyAny>,
    path: PathBuf,
    metadata: Option<BTreeMap<String, String>>,
    fsync: bool,
    max_shard_bytes: Option<u64>,
    staging: Option<Bound<'_, PyAny>>,
) -> PyResult<Vec<PathBuf>> {
    guard(|| {
        let root = tree::node_from_py(tree, &mut Vec::new())?;
        // Wait here, interruptibly, for copies still filling the tensors: the writer
        // would wait for them without checking for signals.
        wait::wait_all(py, root.tensor_refs())?;
        let options = SaveOptions {
            metadata: metadata.unwrap_or_default(),
            fsync,
            staging: parse_staging(staging.as_ref())?,
        };
        py.detach(|| match max_shard_bytes {
            None => tensorferry::save(&root, &path, &options).map(|()| vec![path.clone()]),
            Some(n) => tensorferry::internal::io::save_sharded(&root, &path, &options, n),
        })
        .py_err()
    })
}

/// The metadata key under which the Python package records each tensor's framework.
const FRAMEWORKS_KEY: &str = "tensorferry.frameworks";

/// Reads a safetensors file: `(tree, metadata, pending, direct_fallback)`. Each tensor
/// becomes a NumPy array or a `Tensor`, by `like`, else by the framework recorded at save
/// time, else NumPy where NumPy can hold its dtype. `pending` is true when some tensors
/// were recorded from another framework (PyTorch, JAX) and stayed `Tensor` for Python to
/// convert. With `direct`, the data is read with O_DIRECT; `direct_fallback` says why it
/// went through the page cache instead, if it did. With `device` (not the host), the
/// file streams onto it through the ring `staging` names (`tensorferry::load_to`).
/// With `copy_on_write`, a map is private and writable (`LoadOptions::copy_on_write`).
#[pyfunction]
#[pyo3(signature = (path, mmap=true, like=None, ml_dtypes=false, direct=false, device=None, staging=None, copy_on_write=false, only=None, early=false, pinned=None))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn load(
    py: Python<'_>,
    path: PathBuf,
    mmap: bool,
    like: Option<&str>,
    ml_dtypes: bool,
    direct: bool,
    device: Option<&str>,
    staging: Option<Bound<'_, PyAny>>,
    copy_on_write: bool,
    only: Option<std::collections::HashSet<String>>,
    early: bool,
    pinned: Option<(Option<String>, u64, Bound<'_, pyo3::types::PyBytes>)>,
) -> PyResult<(
    Py<PyAny>,
    BTreeMap<String, String>,
    bool,
    Option<String>,
    Option<wait::PyArrival>,
)> {
    guard(|| {
        let mmap = if mmap {
            // SAFETY: Python's `load(mmap=True)` is the documented default (README, "Limits":
            // as with NumPy's `memmap`, a file truncated or rewritten in place while mapped
            // can crash the process with SIGBUS; `mmap=False` where files may change). The
            // Python user accepts that risk by keeping the default, as NumPy's users do.
            unsafe { tensorferry::Mapping::map() }
        } else {
            tensorferry::Mapping::READ
        };
        let options = LoadOptions {
            mmap,
            direct,
            copy_on_write,
        };
        // An object-storage URL loads into host memory, or streams onto `device` through
        // the ring `staging` names; `only` fetches just those tensors.
        let url = path
            .to_str()
            .filter(|p| object::is_url(p))
            .map(String::from);
        // `pinned`: `(etag, size, header as stored)` of the one object an earlier read
        // found (`object_read_header`): this load must find that version, and asks for no
        // header.
        let object_options = object::ObjectOptions {
            pinned: pinned.map(|(etag, size, header)| object::Pinned {
                etag,
                size,
                header: header.as_bytes().to_vec(),
            }),
            ..object::ObjectOptions::from_env()
        };
        let mut arrival = None;
        let loaded = match (url, device) {
            (Some(url), None) => {
                let (loaded, arriving) =
                    wait::run_interruptibly(py, "tensorferry-load", move |_| {
                        object::load_url_arriving(&url, &object_options, only.as_ref())
                    })?
                    .py_err()?;
                arrival = Some(wait::PyArrival(arriving));
                Ok(loaded)
            }
            (Some(url), Some(d)) => {
                let target: Device = d.parse().py_err()?;
                let staging = parse_staging(staging.as_ref())?;
                wait::run_interruptibly(py, "tensorferry-load", move |stop| {
                    let only = only.as_ref();
                    object::load_url_to_until(&url, target, &object_options, staging, stop, only)
                })?
            }
            // On a thread of its own too: Ctrl-C reaches the caller at once, whatever the
            // index or header takes to read (the thread finishes and drops its result).
            (None, None) => wait::run_interruptibly(py, "tensorferry-load", move |_| {
                tensorferry::load(&path, options)
            })?,
            (None, Some(d)) => {
                let target: Device = d.parse().py_err()?;
                let staging = parse_staging(staging.as_ref())?;
                // On a thread of its own, waited for in slices: Ctrl-C stops it between
                // two chunks instead of after the whole file.
                wait::run_interruptibly(py, "tensorferry-load", move |stop| {
                    tensorferry::internal::io::load_to_until(&path, target, options, staging, stop)
                })?
            }
        }
        .py_err()?;
        let mut out = tree::Output {
            like,
            default: None,
            exceptions: Default::default(),
            ml_dtypes,
            pending: false,
        };
        if like.is_none() {
            let field = |key: &str| loaded.metadata.get(key).map(String::as_str);
            (out.default, out.exceptions) =
                recorded_frameworks(field(FRAMEWORKS_KEY), field("format"));
        }
        // A tree of NumPy arrays is built from the bytes: they must all be in first. Tensors
        // left for Python to convert are views, built while the bytes arrive.
        if let Some(arriving) = arrival.take_if(|a| !early || out.reads_bytes() || a.0.is_done()) {
            arriving.wait(py)?;
        }
        let tree = tree::node_to_py(py, loaded.root, &mut out, &mut Vec::new())?;
        Ok((
            tree,
            loaded.metadata,
            out.pending,
            loaded.direct_fallback,
            arrival,
        ))
    })
}

/// The frameworks a file records its tensors were saved from, from its metadata's
/// `record` (under [`FRAMEWORKS_KEY`]) and `format`: `(default, {dotted name: framework})`,
/// the exceptions to the default. Files of other tools have no record: the Hugging Face
/// convention, `format` ("pt" → "torch", …), names their default. A damaged record only
/// loses the framework hint, never the data: what is not a string where one belongs is
/// left out.
#[pyfunction]
#[pyo3(signature = (record, format))]
fn recorded_frameworks(
    record: Option<&str>,
    format: Option<&str>,
) -> (Option<String>, std::collections::HashMap<String, String>) {
    let Some(text) = record else {
        let default = match format {
            Some("pt") => Some("torch"),
            Some("tf") => Some("tensorflow"),
            Some("flax" | "jax") => Some("jax"),
            Some("np" | "numpy") => Some("numpy"),
            _ => None,
        };
        return (default.map(String::from), Default::default());
    };
    let Ok(record) = serde_json::from_str::<serde_json::Value>(text) else {
        return (None, Default::default());
    };
    let default = record
        .get("default")
        .and_then(|d| d.as_str())
        .map(String::from);
    let exceptions = record
        .get("except")
        .and_then(|e| e.as_object())
        .map(|map| {
            map.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    (default, exceptions)
}

/// A key path for messages: "a/b/0", shortened in the middle when very deep ("<root>" for
/// the root), as every error of the walker shows one.
#[pyfunction]
fn shown_path(path: Vec<Bound<'_, PyAny>>) -> String {
    errors::shown_path(&path)
}

/// NumPy arrays viewing each host tensor (zero-copy), in order.
#[pyfunction]
fn to_numpy_many<'py>(tensors: Vec<Bound<'py, PyTensor>>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    guard(|| tensors.iter().map(tensor::to_array).collect())
}

/// `({id(leaf): array}, other leaves)` for `[(path, leaf)]`: every `tensorferry.Tensor`
/// leaf as a NumPy array (from a device in one transfer), the rest left to the caller.
#[pyfunction]
fn native_leaves_to_numpy<'py>(
    py: Python<'py>,
    leaves: &Bound<'py, PyList>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>)> {
    guard(|| tensor::native_leaves_to_numpy(py, leaves))
}

/// The rows of `tensor` (the slices along its first dimension) as tensors viewing its
/// memory, in order: how a move of many tensors stacked into one is handed back. The
/// tensor must be contiguous, with at least one dimension.
#[pyfunction]
fn unbind(tensor: &Bound<'_, PyTensor>) -> PyResult<Vec<PyTensor>> {
    guard(|| {
        let t = &tensor.get().inner;
        let Some((&rows, row_shape)) = t.shape().split_first().filter(|_| t.is_contiguous()) else {
            return Err(errors::format_err(
                "unbind takes a contiguous tensor of at least one dimension",
            ));
        };
        let row_bytes = t.dtype().size() * row_shape.iter().product::<usize>();
        (0..rows)
            .map(|i| {
                tensorferry::Tensor::contiguous_view(
                    t.storage().clone(),
                    t.offset() + i * row_bytes,
                    t.dtype(),
                    row_shape.to_vec(),
                )
                .map(PyTensor::new)
                .py_err()
            })
            .collect()
    })
}

/// Tensors viewing each NumPy array (zero-copy where the layout allows), in order.
#[pyfunction]
fn from_numpy_many(arrays: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<PyTensor>> {
    guard(|| {
        arrays
            .iter()
            .map(|a| numpy_interop::import_or_convert(a).map(PyTensor::new))
            .collect()
    })
}

/// Tensors viewing the memory of each DLPack capsule (`dltensor` or `dltensor_versioned`,
/// e.g. from `torch.utils.dlpack.to_dlpack`), in order: one call for many leaves, without
/// the per-leaf cost of a producer's `__dlpack__` method.
#[pyfunction]
fn from_dlpack_capsules(capsules: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<PyTensor>> {
    guard(|| {
        capsules
            .iter()
            .map(|c| dlpack::import_capsule(c).map(PyTensor::new))
            .collect()
    })
}

/// A legacy (`dltensor`) DLPack capsule for each tensor, in order, after its pending copy
/// has finished (every consumer stream may use it at once) — or, for a CUDA tensor of GPU
/// `i` when `streams` maps `i` to the consumer's stream handle, once that stream is made
/// to wait for the copy on the GPU (the copy may still be running). Read-only memory is
/// copied: the legacy form cannot flag it. With `promised`, host tensors are exported at
/// once, their copies maybe still running: only for `_api._load`, which hands nothing out
/// before its load's `Arrival.wait()` returns (see the SAFETY below).
#[pyfunction]
#[pyo3(signature = (tensors, streams=None, promised=false))]
fn to_dlpack_capsules(
    py: Python<'_>,
    tensors: Vec<Py<PyTensor>>,
    streams: Option<std::collections::HashMap<usize, usize>>,
    promised: bool,
) -> PyResult<Vec<Py<PyAny>>> {
    guard(|| {
        let inner: Vec<&tensorferry::Tensor> = tensors.iter().map(|t| &t.get().inner).collect();
        let streams = streams.unwrap_or_default();
        let stream_of = |t: &tensorferry::Tensor| match t.device() {
            Device::Cuda(i) => streams.get(&i).copied(),
            _ => None,
        };
        // One GPU-side wait per buffer (a move's results share one per GPU), a host wait
        // for the rest.
        let mut ordered: std::collections::HashMap<(usize, usize), Readable<'_>> =
            std::collections::HashMap::new();
        inner
            .iter()
            .map(|&t| {
                if matches!(t.device(), Device::Emulated(_)) {
                    return Err(errors::buffer_err(format!(
                        "{} memory has no DLPack device: move it to the host first",
                        t.device()
                    )));
                }
                let ready = match stream_of(t) {
                    Some(handle) => {
                        let buffer = (std::sync::Arc::as_ptr(t.storage()) as usize, handle);
                        match ordered.get(&buffer).and_then(|r| r.view(t)) {
                            Some(ready) => ready,
                            None => {
                                // SAFETY: the handle is the stream the caller named for
                                // this GPU (a live stream of the process, or 1/2).
                                let stream = unsafe { StreamHandle::new(handle) };
                                let ready = wait::ordered(py, t, stream)?;
                                ordered.insert(buffer, ready);
                                ready
                            }
                        }
                    }
                    // SAFETY: `promised` is passed by `_api._load` alone, for the tensors of
                    // a load from object storage whose bytes may still arrive: it turns them
                    // into PyTorch tensors (views: no byte is read) and hands none of them
                    // out before the load's `Arrival.wait()` has returned; when anything
                    // fails first, it cancels the arrival, which returns once nothing writes
                    // the memory any more, and drops them.
                    None if promised && t.device() == Device::Cpu => unsafe {
                        Readable::promised(t)
                    },
                    None => wait::readable(py, t)?,
                };
                dlpack::export_capsule(py, ready, false, true)
            })
            .collect()
    })
}

/// A tensor viewing the CUDA memory an object describes with `__cuda_array_interface__`
/// (Numba, CuPy, …), after synchronising on the producer's stream if it names one.
#[pyfunction]
fn from_cuda_array_interface(obj: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
    guard(|| cai::import(obj).map(PyTensor::new))
}

/// The device ("cuda:N") of the memory an object describes with `__cuda_array_interface__`.
#[pyfunction]
fn cuda_array_interface_device(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    guard(|| {
        let iface = obj.getattr("__cuda_array_interface__")?;
        let (address, _): (usize, bool) = iface.get_item("data")?.extract()?;
        if address == 0 {
            return Ok("cuda:0".into());
        }
        let dev = tensorferry::internal::backend::pointer_device(address).py_err()?;
        Ok(dev.to_string())
    })
}

/// Waits for every copy into `tensors` (interruptibly); with `timeout` (seconds), gives up
/// then and returns False. A failed copy raises its error.
#[pyfunction]
#[pyo3(signature = (tensors, timeout=None))]
fn wait_tensors(
    py: Python<'_>,
    tensors: Vec<Py<PyTensor>>,
    timeout: Option<f64>,
) -> PyResult<bool> {
    guard(|| {
        let inner = tensors.iter().map(|t| &t.get().inner);
        match timeout {
            None => wait::wait_all(py, inner).map(|()| true),
            Some(s) if s.is_finite() && s >= 0.0 => {
                let deadline =
                    std::time::Instant::now() + std::time::Duration::from_secs_f64(s.min(1e9));
                wait::wait_until(py, inner, Some(deadline))
            }
            Some(s) => Err(errors::format_err(format!(
                "timeout must be a non-negative number of seconds, not {s}"
            ))),
        }
    })
}

/// `(names, aliased, pinned)`: the tensor names of the checkpoint at an object-storage
/// URL, from its index or header, whether its tree record gives a tensor a second name,
/// and for a URL that names one object itself, `(etag, size, header)` as `load(pinned=)`
/// takes them (None otherwise).
#[pyfunction]
#[allow(clippy::type_complexity)]
fn object_names(
    py: Python<'_>,
    url: &str,
) -> PyResult<(
    Vec<String>,
    bool,
    Option<(Option<String>, u64, Py<pyo3::types::PyBytes>)>,
)> {
    let options = object::ObjectOptions::from_env();
    guard(|| {
        let (names, aliased, pinned) =
            py.detach(|| object::tensor_names(url, &options)).py_err()?;
        let pinned = pinned.map(|p| {
            let header = pyo3::types::PyBytes::new(py, &p.header).unbind();
            (p.etag, p.size, header)
        });
        Ok((names, aliased, pinned))
    })
}

/// The header of the safetensors object at `url` (one object, no folder or index
/// resolved), read and validated as `load` does: `(data_start, entries, etag, size,
/// metadata, stored)`, entries as `RunFile.read_header` gives them (offsets absolute in
/// the object), `etag` None where the store gives none, `metadata` the header's
/// `__metadata__`, `stored` the header's bytes as the object holds them (`data_start`
/// bytes).
#[pyfunction]
#[allow(clippy::type_complexity)]
fn object_read_header(
    py: Python<'_>,
    url: &str,
) -> PyResult<(
    u64,
    Vec<IndexEntry>,
    Option<String>,
    u64,
    BTreeMap<String, String>,
    Py<pyo3::types::PyBytes>,
)> {
    let options = object::ObjectOptions::from_env();
    guard(|| {
        let (mut header, stored, etag, size) = py
            .detach(|| object::read_header_url(url, &options))
            .py_err()?;
        let metadata = std::mem::take(&mut header.metadata);
        let stored = pyo3::types::PyBytes::new(py, &stored).unbind();
        Ok((
            header.data_start,
            entries_of(header),
            etag,
            size,
            metadata,
            stored,
        ))
    })
}

/// `(is_index, path)`: the index or the one file (object) `load` reads for `path` (a file,
/// an index, a folder, the index a sharded save to `path` wrote; or an object-storage
/// URL), resolved as it resolves them; a checkpoint it refuses is the error it gives.
#[pyfunction]
fn resolve(py: Python<'_>, path: PathBuf) -> PyResult<(bool, std::ffi::OsString)> {
    guard(|| {
        let (is_index, found) = py
            .detach(|| tensorferry::internal::io::resolve(&path))
            .py_err()?;
        Ok((is_index, found.into_os_string()))
    })
}

/// `(weight_map, save_id)` of the index of a sharded checkpoint whose bytes `data` were
/// read from `path` (a file or an object), checked as every load checks it: a bad index
/// (a shard outside its folder or that is no safetensors file, a save id that is no
/// string…) is a `FormatError` naming `path`.
#[pyfunction]
fn parse_index(data: &[u8], path: PathBuf) -> PyResult<(BTreeMap<String, String>, Option<String>)> {
    guard(|| {
        let index = tensorferry::internal::io::parse_index(data, &path).py_err()?;
        Ok((index.weight_map, index.save_id))
    })
}

/// `(size, etag)` of the object at `url` (one HEAD); `etag` None where the store gives
/// none. A missing object is a `FileNotFoundError` naming it.
#[pyfunction]
fn object_head(py: Python<'_>, url: &str) -> PyResult<(u64, Option<String>)> {
    let options = object::ObjectOptions::from_env();
    guard(|| py.detach(|| object::head_url(url, &options)).py_err())
}

/// Writes `data` as the file at `path` (replaced atomically as `save` replaces a file,
/// its permissions kept; with `fsync`, synced with its folder) or as the object at an
/// object-storage URL (one PUT), the GIL released: it appears whole or stays as it was.
#[pyfunction]
#[pyo3(signature = (path, data, fsync=false))]
fn put(py: Python<'_>, path: PathBuf, data: Vec<u8>, fsync: bool) -> PyResult<()> {
    guard(|| {
        py.detach(|| tensorferry::internal::io::put(&path, data, fsync))
            .py_err()
    })
}

/// Deletes the object at `url` (GIL released); one already absent is no error.
#[pyfunction]
fn object_delete(py: Python<'_>, url: &str) -> PyResult<()> {
    let options = object::ObjectOptions::from_env();
    guard(|| py.detach(|| object::delete_url(url, &options)).py_err())
}

/// Fills the memory of each `(offset, address, length)` of `spans` with the bytes of the
/// object at `url` from that offset, in parallel ranged GETs (GIL released), all from one
/// version of the object (with `etag`, that version). Spans that overlap are refused.
/// Private to the package: `tensorferry._dcp_io.read_pieces` passes the addresses of
/// writable buffers it holds exported for the call (the only way to write into Python
/// buffers under the stable ABI before Python 3.11).
#[pyfunction]
#[pyo3(signature = (url, spans, etag=None))]
fn object_read_into(
    py: Python<'_>,
    url: &str,
    spans: Vec<(u64, usize, usize)>,
    etag: Option<String>,
) -> PyResult<()> {
    let options = object::ObjectOptions::from_env();
    guard(|| {
        // SAFETY: each span is the writable memory of a Python buffer that the caller
        // (`tensorferry._dcp_io.read_pieces`) keeps exported until this call returns.
        let targets = unsafe { direct_runs::spans_as_slices(&spans) }?;
        py.detach(|| object::read_into(url, targets, etag.as_deref(), &options))
            .py_err()
    })
}

/// Whether `path` is an object-storage URL (`s3://`, `gs://`, `az://`, `http(s)://`).
#[pyfunction]
fn is_url(path: &str) -> bool {
    object::is_url(path)
}

/// The `__metadata__` of a safetensors file, reading the header only.
#[pyfunction]
fn read_metadata(py: Python<'_>, path: PathBuf) -> PyResult<BTreeMap<String, String>> {
    guard(|| {
        py.detach(|| tensorferry::internal::io::read_metadata(&path))
            .py_err()
    })
}

/// One tensor of a file's header: name, safetensors dtype code, shape, and its first and
/// end byte, absolute in the file.
pub(crate) type IndexEntry = (String, &'static str, Vec<usize>, u64, u64);

/// The entries of `header`, offsets absolute in its file or object.
pub(crate) fn entries_of(header: tensorferry::internal::io::Header) -> Vec<IndexEntry> {
    let start = header.data_start;
    header
        .tensors
        .into_iter()
        .map(|e| {
            let code = e.dtype.safetensors_code().unwrap_or("?");
            (
                e.name,
                code,
                e.shape,
                start + e.begin as u64,
                start + e.end as u64,
            )
        })
        .collect()
}

mod cli;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    cli::register(m)?;
    m.add_class::<PyTensor>()?;
    m.add_class::<wait::PyArrival>()?;
    m.add_function(wrap_pyfunction!(parse_device, m)?)?;
    m.add_function(wrap_pyfunction!(ensure_device, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(move_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(configure_emulated, m)?)?;
    m.add_function(wrap_pyfunction!(check_staging, m)?)?;
    m.add_function(wrap_pyfunction!(pinned_pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_stream_synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_order_after_stream, m)?)?;
    m.add_function(wrap_pyfunction!(to_numpy_many, m)?)?;
    m.add_function(wrap_pyfunction!(native_leaves_to_numpy, m)?)?;
    m.add_function(wrap_pyfunction!(unbind, m)?)?;
    m.add_function(wrap_pyfunction!(from_numpy_many, m)?)?;
    m.add_function(wrap_pyfunction!(from_dlpack_capsules, m)?)?;
    m.add_function(wrap_pyfunction!(to_dlpack_capsules, m)?)?;
    m.add_function(wrap_pyfunction!(runs::host_runs, m)?)?;
    m.add_function(wrap_pyfunction!(direct_runs::read_runs, m)?)?;
    m.add_class::<direct_runs::PyRunFile>()?;
    m.add_function(wrap_pyfunction!(save, m)?)?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(recorded_frameworks, m)?)?;
    m.add_function(wrap_pyfunction!(read_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(object_names, m)?)?;
    m.add_function(wrap_pyfunction!(is_url, m)?)?;
    m.add_function(wrap_pyfunction!(object_read_header, m)?)?;
    m.add_function(wrap_pyfunction!(object_head, m)?)?;
    m.add_function(wrap_pyfunction!(resolve, m)?)?;
    m.add_function(wrap_pyfunction!(parse_index, m)?)?;
    m.add_function(wrap_pyfunction!(object_read_into, m)?)?;
    m.add_function(wrap_pyfunction!(put, m)?)?;
    m.add_function(wrap_pyfunction!(object_delete, m)?)?;
    m.add_function(wrap_pyfunction!(wait_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(from_cuda_array_interface, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_array_interface_device, m)?)?;
    m.add_function(wrap_pyfunction!(groups::group_leaves, m)?)?;
    m.add_function(wrap_pyfunction!(host_copy::copy_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(host_copy::copy_rows, m)?)?;
    m.add_function(wrap_pyfunction!(shown_path, m)?)?;
    m.add_function(wrap_pyfunction!(walk::collect_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(walk::rebuild, m)?)?;
    m.add_function(wrap_pyfunction!(walk::convert_native, m)?)?;
    m.add_function(wrap_pyfunction!(walk::container_kind, m)?)?;
    m.add_function(wrap_pyfunction!(walk::nested_keys, m)?)?;
    m.add_function(wrap_pyfunction!(walk::prune, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_DEPTH", walk::MAX_DEPTH)?;
    m.add(
        "MAX_INDEX_BYTES",
        tensorferry::internal::io::MAX_INDEX_BYTES,
    )?;
    Ok(())
}
