//! The entry points that take a path, and where each path goes: an object-storage URL to
//! [`super::object`], an index of shards (or a folder or stem naming one) to
//! [`super::checkpoint`], one file to [`super::read`] and [`super::write`]. Kept above
//! all of them, so that none of them needs to know of the others.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use super::checkpoint::sharded;
use super::format::header_writer;
use super::fs::replace;
use super::into_device;
use super::object;
use super::read::{load_file, read_header, LoadOptions, Loaded};
use super::write::{check_root, SaveOptions};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::transfer::Staging;
use crate::tree::Node;

/// Loads the tree saved in the file at `path`: a safetensors file, an index of shards, a
/// folder holding one index or one file, or an object-storage URL. A file tensorferry did
/// not write loads as a flat dict of its tensors, in its header's order.
///
/// Only regular files are read: a folder is an [`Error::Io`] with `EISDIR`, a FIFO or a
/// device an [`Error::Io`] naming its kind, both before any read. By default the data is
/// read into fresh memory, so a file truncated or rewritten later never reaches the
/// tensors; a file truncated during the load is an error. Mapping it instead is the
/// `unsafe` opt-in [`super::Mapping::map`].
///
/// ```
/// use tensorferry::{load, save, LoadOptions, Node, SaveOptions, Tensor, TensorDict};
///
/// let dir = std::env::temp_dir().join(format!("tf-doc-load-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("model.safetensors");
/// let mut d = TensorDict::new();
/// d.insert("w", Tensor::from_slice(&[1.0f32, 2.0], &[2])?);
/// save(&Node::from(d), &path, &SaveOptions::default())?;
/// let loaded = load(&path, LoadOptions::default())?;
/// assert_eq!(loaded.root.tensor(&["w"]).unwrap().to_vec::<f32>()?, [1.0, 2.0]);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load(path: impl AsRef<Path>, options: LoadOptions) -> Result<Loaded> {
    if let Some(url) = object::url_of(path.as_ref()) {
        return object::load_url(url, &object::ObjectOptions::from_env(), None);
    }
    let path = match sharded::resolve(path.as_ref())? {
        sharded::Target::Index(index) => return sharded::load_sharded(index, options),
        sharded::Target::File(file) => file,
    };
    load_file(&path, options)
}

/// What [`load`] reads for `path`: `(true, the index)` for a sharded checkpoint, else
/// `(false, the file)`, resolved as it resolves them (an index, a folder holding one
/// checkpoint, the index a sharded save to `path` wrote; an object-storage URL among
/// objects). A folder it would refuse, or a missing object, is the error it gives; a
/// missing local file resolves to itself. For readers that plan their own reads.
pub fn resolve(path: impl AsRef<Path>) -> Result<(bool, PathBuf)> {
    if let Some(url) = object::url_of(path.as_ref()) {
        let (is_index, found) = object::resolve_url(url, &object::ObjectOptions::from_env())?;
        return Ok((is_index, PathBuf::from(found)));
    }
    Ok(match sharded::resolve(path.as_ref())? {
        sharded::Target::Index(index) => (true, index),
        sharded::Target::File(file) => (false, file),
    })
}

/// Writes `bytes` as the file at `path`, replaced atomically as [`save`] replaces a file
/// (its permissions kept, a link followed, nothing left behind by a failure; with `fsync`
/// the file, then its folder, synced), or as the object at an object-storage URL in one
/// PUT: it appears whole, or stays as it was. For the small files that commit a
/// checkpoint (an index, DCP's `.metadata`).
pub fn put(path: impl AsRef<Path>, bytes: Vec<u8>, fsync: bool) -> Result<()> {
    if let Some(url) = object::url_of(path.as_ref()) {
        return object::put_url(url, bytes, &object::ObjectOptions::from_env());
    }
    replace::replace_with(path.as_ref(), &bytes, fsync)
}

/// The user metadata of the checkpoint at `path`, from headers alone: a file, an index
/// (its first shard's metadata, as [`load`] returns), or a folder or path that
/// [`load`] would read one from.
pub fn read_metadata(path: impl AsRef<Path>) -> Result<BTreeMap<String, String>> {
    if let Some(url) = object::url_of(path.as_ref()) {
        return object::read_metadata_url(url, &object::ObjectOptions::from_env());
    }
    let file = match sharded::resolve(path.as_ref())? {
        sharded::Target::Index(index) => sharded::first_shard(&index)?,
        sharded::Target::File(file) => file,
    };
    Ok(read_header(file)?.metadata)
}

/// Saves a tree (dict, list or tuple at the root) as a safetensors file at `path`.
///
/// Tensor names are the key paths joined with "."; a file no reader would read back (two
/// paths giving one name, a tensor named `__metadata__`, a dtype the format cannot hold,
/// a header over 100 MB, or too many values for the bytes the file holds: at most four
/// times the file's size plus 4 MiB is allocated by a load) is an error raised before the
/// file is touched. Tensors on a device are
/// copied to the host first, all in one planned transfer.
///
/// The file is replaced atomically and keeps its permission bits; a symbolic link at
/// `path` stays a link to the replaced file. A FIFO or device at `path`, a read-only file
/// or a missing folder is an [`Error::Io`]; a folder at `path` means
/// `path/model.safetensors`. A sharded checkpoint of that name
/// (`stem.safetensors.index.json` and its shards) is removed once the file is in place.
///
/// ```
/// use tensorferry::{save, Node, SaveOptions, Tensor, Value};
///
/// let dir = std::env::temp_dir().join(format!("tf-doc-save-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// // A list at the root is a tree too.
/// let tree = Node::List(vec![Tensor::from_slice(&[1u8, 2], &[2])?.into(), Value::None.into()]);
/// save(&tree, dir.join("list.safetensors"), &SaveOptions::default())?;
/// assert!(save(&Node::from(3i64), dir.join("x.safetensors"), &SaveOptions::default()).is_err());
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn save(root: &Node, path: impl AsRef<Path>, options: &SaveOptions) -> Result<()> {
    check_root(root, options)?;
    if let Some(url) = object::url_of(path.as_ref()) {
        return object::save_url(root, url, options, None).map(|_| ());
    }
    sharded::write_walked(
        header_writer::walk_node(root),
        || root.tensors().into_iter().map(|(p, _)| p).collect(),
        path.as_ref(),
        options,
    )
}

/// Saves `root` as shards of at most `max_shard_bytes` of tensor data each (a tensor
/// larger than that gets a shard of its own), plus the index, next to `path`:
/// `dir/model.safetensors` gives `dir/model-00001-of-0000N.safetensors` and
/// `dir/model.safetensors.index.json` (a folder `dir` gives the same). A tree that fits
/// one shard is saved as `path` itself, as Hugging Face does. Every shard's metadata holds
/// `"format": "pt"` unless `options.metadata` names a format (transformers requires the
/// key).
///
/// The checkpoint is replaced as a whole (`super::checkpoint`): a failure or a crash at
/// any point leaves the previous checkpoint of that name loadable, or the new one, never
/// a mix; what the previous one held that the new one does not is removed, and nothing
/// else in the folder. Returns the files written, the index last.
pub fn save_sharded(
    root: &Node,
    path: impl AsRef<Path>,
    options: &SaveOptions,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    let path = path.as_ref();
    if max_shard_bytes == 0 {
        return Err(Error::InvalidValue {
            key: String::new(),
            reason: "max_shard_size must be positive".into(),
        });
    }
    check_root(root, options)?;
    if let Some(url) = object::url_of(path) {
        let written = object::save_url(root, url, options, Some(max_shard_bytes))?;
        return Ok(written.into_iter().map(PathBuf::from).collect());
    }
    sharded::save_sharded_files(root, path, options, max_shard_bytes)
}

/// Loads the tree saved at `path` (a file, an index of shards, or a folder holding one)
/// onto `device`, reading the data in chunks through a ring of pinned host buffers:
/// `staging`'s `(chunk_bytes, depth)` when it names a ring, else [`crate::transfer::staging::AUTO_DEPTH`] buffers
/// of [`crate::transfer::staging::AUTO_CHUNK_BYTES`] (chunks are rounded up to 4096 bytes). Host memory is bounded
/// by the ring (shards are read one after another); device memory is the data's size.
///
/// With [`LoadOptions::direct`] the chunks are read with `O_DIRECT`, several reads in
/// flight, and [`Loaded::direct_fallback`] says why where the filesystem refused it;
/// [`LoadOptions::mmap`] has no effect here. Returns once the data is on the device. For
/// the host ([`Device::Cpu`]) this is [`load`].
///
/// ```
/// use tensorferry::load_to;
/// use tensorferry::{save, Device, LoadOptions, Node, SaveOptions, Staging, Tensor, TensorDict};
///
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("x.safetensors");
/// let mut d = TensorDict::new();
/// d.insert("x", Tensor::from_slice(&[1.5f32, 2.5], &[2])?);
/// save(&Node::from(d), &path, &SaveOptions::default())?;
/// let options = LoadOptions { direct: true, ..LoadOptions::default() };
/// let loaded = load_to(&path, Device::Emulated(0), options, Staging::Auto)?;
/// let x = loaded.root.child("x").and_then(Node::as_tensor).expect("saved");
/// assert_eq!(x.device(), Device::Emulated(0));
/// assert_eq!(x.to(Device::Cpu, false)?.to_vec::<f32>()?, vec![1.5, 2.5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load_to(
    path: impl AsRef<Path>,
    device: Device,
    options: LoadOptions,
    staging: Staging,
) -> Result<Loaded> {
    load_to_until(path, device, options, staging, &AtomicBool::new(false))
}

/// [`load_to`], given up between two chunks once `stop` is set (by another thread: a
/// caller waiting for Ctrl-C, say): then an [`Error::Io`] of kind
/// [`std::io::ErrorKind::Interrupted`], and the device memory taken so far is released
/// once the copies in flight (at most the ring's depth of chunks) have run. Staging out of
/// the limits is refused first ([`Staging::validate`]).
///
/// ```
/// use std::sync::atomic::AtomicBool;
/// use tensorferry::internal::io::load_to_until;
/// use tensorferry::{save, Device, LoadOptions, Node, SaveOptions, Staging, Tensor, TensorDict};
///
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("x.safetensors");
/// let mut d = TensorDict::new();
/// d.insert("x", Tensor::from_slice(&[1u8; 10_000], &[10_000])?);
/// save(&Node::from(d), &path, &SaveOptions::default())?;
/// let stop = AtomicBool::new(true); // already asked to stop
/// let err = load_to_until(&path, Device::Emulated(0), LoadOptions::default(), Staging::Auto, &stop)
///     .unwrap_err();
/// assert!(matches!(err, tensorferry::Error::Io { ref source, .. }
///     if source.kind() == std::io::ErrorKind::Interrupted), "{err}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load_to_until(
    path: impl AsRef<Path>,
    device: Device,
    options: LoadOptions,
    staging: Staging,
    stop: &AtomicBool,
) -> Result<Loaded> {
    let staging = staging.validate()?;
    if device.is_host() {
        return load(path, options);
    }
    into_device::stream_to(path.as_ref(), device, options, staging, stop)
}
