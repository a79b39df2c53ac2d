//! Loading a file straight into a device's memory: the data section is read in chunks
//! into a ring of pinned host buffers (with `O_DIRECT` when asked for), and each chunk is
//! copied into one device allocation for the whole section while the next is read. Host
//! memory stays bounded by the ring whatever the file's size; the tensors view the
//! device memory at their offsets, as they would view a host buffer.

use std::fs::File;
use std::io::ErrorKind;
use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::checkpoint::sharded::{load_sharded_with, resolve, Target};
use super::format::header_reader::parse_counted;
use super::fs::direct::{Reader, Window, DIRECT_ALIGN};
use super::fs::file_kind::open_regular;
use super::read::{build, load, read_header_bytes, LoadOptions, Loaded};
use crate::backend::{backend_for, Backend};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::transfer::staging::{AUTO_CHUNK_BYTES, AUTO_DEPTH};
use crate::transfer::stream_in::{stream_to_device, Piece, StreamRing};
use crate::transfer::Staging;

/// Loads the tree saved at `path` (a file, an index of shards, or a folder holding one)
/// onto `device`, reading the data in chunks through a ring of pinned host buffers:
/// `staging`'s `(chunk_bytes, depth)` when it names a ring, else [`AUTO_DEPTH`] buffers
/// of [`AUTO_CHUNK_BYTES`] (chunks are rounded up to 4096 bytes). Host memory is bounded
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
    device.ensure_available()?;
    let backend = backend_for(device)?;
    let ring = ring_for(staging);
    let load_one = |file: &Path| {
        stream_file(file, &backend, options.direct, ring, stop).map_err(|e| e.in_file(file))
    };
    match resolve(path.as_ref())? {
        Target::Index(index) => load_sharded_with(&index, 1, load_one),
        Target::File(file) => load_one(&file),
    }
}

/// The host buffers for `staging`: its ring, else the automatic one (ordinary memory
/// where no pinned memory is to be had); chunks in whole 4096-byte blocks.
pub(crate) fn ring_for(staging: Staging) -> StreamRing {
    let (chunk_bytes, depth) = match staging {
        Staging::Ring { chunk_bytes, depth } => (chunk_bytes, depth),
        Staging::Auto | Staging::Off => (AUTO_CHUNK_BYTES, AUTO_DEPTH),
    };
    StreamRing {
        chunk_bytes: chunk_bytes.max(1).next_multiple_of(DIRECT_ALIGN),
        depth: depth.max(1),
        align: DIRECT_ALIGN,
        automatic: !matches!(staging, Staging::Ring { .. }),
    }
}

/// Loads one file onto `backend`'s device through `ring`.
fn stream_file(
    path: &Path,
    backend: &Arc<dyn Backend>,
    direct: bool,
    ring: StreamRing,
    stop: &AtomicBool,
) -> Result<Loaded> {
    let (mut file, file_len) = open_regular(path)?;
    let header = read_header_bytes(&mut file, path, file_len)?;
    let data_start = 8 + header.len() as u64;
    let data_len = file_len - data_start;
    let parsed = parse_counted(&header, data_len)?;
    drop(header);
    let stream = Stream { direct, ring, stop };
    let (storage, fallback) = stream_data(file, path, file_len, data_start, backend, stream)?;
    let mut loaded = build(parsed, storage, 0)?;
    loaded.direct_fallback = fallback;
    Ok(loaded)
}

/// How a file's data streams to a device.
struct Stream<'a> {
    /// Read with `O_DIRECT`.
    direct: bool,
    ring: StreamRing,
    /// Give up before the next chunk once set.
    stop: &'a AtomicBool,
}

/// Reads `[data_start, file_len)` of `file` into new device memory, chunk by chunk: the
/// memory, and why the reads went through the page cache if `direct` was asked for and
/// refused.
fn stream_data(
    file: File,
    path: &Path,
    file_len: u64,
    data_start: u64,
    backend: &Arc<dyn Backend>,
    stream: Stream<'_>,
) -> Result<(Arc<crate::storage::Storage>, Option<String>)> {
    let Stream { direct, ring, stop } = stream;
    let data_len = (file_len - data_start) as usize;
    let window = Window::covering(data_start, file_len);
    let ring = StreamRing {
        chunk_bytes: ring.chunk_bytes.min(window.len.max(DIRECT_ALIGN)),
        ..ring
    };
    let chunks = chunks(window, data_start, file_len, ring.chunk_bytes);
    let mut reader = Reader::new(file, path, file_len, direct);
    let fill = |j: usize, buffer: &mut [MaybeUninit<u8>]| {
        if stop.load(Ordering::Relaxed) {
            return Err(Error::io("read", path, ErrorKind::Interrupted.into()));
        }
        let (at, len) = chunks[j].0;
        let buffer = &mut buffer[..len];
        // SAFETY: the buffer is `len` writable bytes that nothing else touches during the
        // call (`stream_to_device`); `at`, `len` and the buffer's address are multiples of
        // 4096.
        unsafe { reader.read_raw(buffer.as_mut_ptr().cast(), len, at) }
    };
    let pieces: Vec<Piece> = chunks.iter().map(|&(_, piece)| piece).collect();
    let storage = stream_to_device(backend, data_len, &pieces, ring, fill)?;
    Ok((storage, reader.fallback().map(String::from)))
}

/// The chunks of `window` of `chunk_bytes` each: the file range read into its buffer
/// `(offset, len)`, and the piece of it that is data, placed in the data section.
fn chunks(
    window: Window,
    data_start: u64,
    file_len: u64,
    chunk_bytes: usize,
) -> Vec<((u64, usize), Piece)> {
    if file_len == data_start {
        return Vec::new();
    }
    let end = window.start + window.len as u64;
    (0..window.len.div_ceil(chunk_bytes))
        .map(|j| {
            let at = window.start + (j * chunk_bytes) as u64;
            let to = (at + chunk_bytes as u64).min(end);
            let from_data = at.max(data_start);
            let to_data = to.min(file_len);
            let piece = Piece {
                skip: (from_data - at) as usize,
                len: (to_data - from_data) as usize,
                dst_offset: (from_data - data_start) as usize,
            };
            ((at, (to - at) as usize), piece)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_data_section_and_read_whole_blocks() {
        // Data from byte 100 to 20 000, chunks of 8192.
        let w = Window::covering(100, 20_000);
        let cs = chunks(w, 100, 20_000, 8192);
        let reads: Vec<(u64, usize)> = cs.iter().map(|c| c.0).collect();
        assert_eq!(reads, [(0, 8192), (8192, 8192), (16_384, 4096)]);
        let pieces: Vec<(usize, usize, usize)> = cs
            .iter()
            .map(|c| (c.1.skip, c.1.len, c.1.dst_offset))
            .collect();
        assert_eq!(pieces, [(100, 8092, 0), (0, 8192, 8092), (0, 3616, 16_284)]);
        assert_eq!(pieces.iter().map(|p| p.1).sum::<usize>(), 19_900);
    }

    #[test]
    fn an_empty_data_section_has_no_chunks() {
        assert!(chunks(Window::covering(4096, 4096), 4096, 4096, 8192).is_empty());
        assert!(chunks(Window::covering(100, 100), 100, 100, 8192).is_empty());
    }

    #[test]
    fn rings_read_whole_blocks_and_default_to_the_automatic_one() {
        let r = ring_for(Staging::Ring {
            chunk_bytes: 5000,
            depth: 0,
        });
        assert_eq!((r.chunk_bytes, r.depth), (8192, 1));
        let r = ring_for(Staging::Off);
        assert_eq!((r.chunk_bytes, r.depth), (AUTO_CHUNK_BYTES, AUTO_DEPTH));
    }
}
