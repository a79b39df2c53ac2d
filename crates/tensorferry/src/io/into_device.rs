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
use super::fs::direct::{Reader, Window, DIRECT_ALIGN};
use super::fs::file_kind::open_regular;
use super::read::{build, header_of, LoadOptions, Loaded};
use crate::backend::{backend_for, Backend};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::transfer::staging::Ring;
use crate::transfer::staging::{AUTO_CHUNK_BYTES, AUTO_DEPTH};
use crate::transfer::stream_in::{stream_to_device, Piece};
use crate::transfer::Staging;

/// [`crate::io::load_to_until`] onto a device (not the host), `staging` validated.
pub(crate) fn stream_to(
    path: &Path,
    device: Device,
    options: LoadOptions,
    staging: Staging,
    stop: &AtomicBool,
) -> Result<Loaded> {
    device.ensure_available()?;
    let backend = backend_for(device)?;
    let ring = ring_for(staging);
    let load_one = |file: &Path| {
        stream_file(file, &backend, options.direct, ring, stop).map_err(|e| e.in_file(file))
    };
    match resolve(path)? {
        Target::Index(index) => load_sharded_with(&index, 1, load_one),
        Target::File(file) => load_one(&file),
    }
}

/// The host buffers for `staging`: its ring, else the automatic one (ordinary memory
/// where no pinned memory is to be had); chunks in whole 4096-byte blocks.
pub(crate) fn ring_for(staging: Staging) -> Ring {
    let (chunk_bytes, depth) = match staging {
        Staging::Ring { chunk_bytes, depth } => (chunk_bytes, depth),
        Staging::Auto | Staging::Off => (AUTO_CHUNK_BYTES, AUTO_DEPTH),
    };
    Ring {
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
    ring: Ring,
    stop: &AtomicBool,
) -> Result<Loaded> {
    let (mut file, file_len) = open_regular(path)?;
    let parsed = header_of(&mut file, path, file_len)?;
    let data_start = parsed.0.data_start;
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
    ring: Ring,
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
    let ring = Ring {
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
