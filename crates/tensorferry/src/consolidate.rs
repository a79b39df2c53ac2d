//! Packing tensors into one 64-byte-aligned buffer, with views into it: [`pack`] for a
//! list of tensors ([`crate::consolidate`] for a tree).
//!
//! One buffer means one allocation, one transfer and one file write for a whole
//! dictionary. Large dictionaries are copied by several threads at once.

use std::sync::Arc;

use crate::error::Result;
use crate::memory::{AlignedBuffer, HOST_ALIGNMENT};
use crate::storage::Storage;
use crate::tensor::Tensor;

/// Contiguous sources are split into pieces of at most this many bytes, so that one huge
/// tensor still spreads over every thread.
const PIECE_BYTES: usize = 8 << 20;
/// Below this total, one thread copies everything (thread start-up would cost more).
const PARALLEL_THRESHOLD: usize = 16 << 20;

/// Where each tensor goes in the packed buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedLayout {
    /// Byte offset of each tensor, in tree order; every one is 64-byte aligned.
    pub offsets: Vec<usize>,
    /// Total bytes of the buffer.
    pub total: usize,
}

impl PackedLayout {
    /// The layout of tensors of the given byte sizes, each starting 64-byte aligned.
    pub fn plan(sizes: impl IntoIterator<Item = usize>) -> PackedLayout {
        let sizes = sizes.into_iter();
        let mut offsets = Vec::with_capacity(sizes.size_hint().0);
        let mut at = 0usize;
        for size in sizes {
            offsets.push(at);
            at = (at + size).next_multiple_of(HOST_ALIGNMENT);
        }
        PackedLayout { offsets, total: at }
    }
}

enum Source<'a> {
    Bytes(&'a [u8]),
    Strided(&'a Tensor),
}

struct Piece<'a> {
    dst: usize,
    len: usize,
    src: Source<'a>,
}

/// Copies `tensors` (host memory, any layout) into one new 64-byte-aligned buffer and
/// returns contiguous views of it, in order. The result shares no memory with the input.
pub fn pack(tensors: &[&Tensor]) -> Result<Vec<Tensor>> {
    let layout = PackedLayout::plan(tensors.iter().map(|t| t.nbytes()));
    let mut pieces = Vec::with_capacity(tensors.len());
    for (t, &dst) in tensors.iter().zip(&layout.offsets) {
        match t.contiguous_bytes() {
            Some(bytes) => {
                for (i, chunk) in bytes.chunks(PIECE_BYTES).enumerate() {
                    pieces.push(Piece {
                        dst: dst + i * PIECE_BYTES,
                        len: chunk.len(),
                        src: Source::Bytes(chunk),
                    });
                }
            }
            None => pieces.push(Piece {
                dst,
                len: t.nbytes(),
                src: Source::Strided(t),
            }),
        }
    }
    let mut buffer = AlignedBuffer::zeroed(layout.total)?;
    copy_pieces(buffer.as_mut_slice(), &pieces, threads_for(layout.total))?;
    views(&Arc::new(Storage::owned(buffer)), tensors, &layout)
}

/// Copies each source's bytes into `dst` at its offset (`(bytes, offset)` pairs, in
/// ascending offsets that do not overlap), as [`pack`] copies into its own buffer: on
/// several threads for a large total. For a caller that owns the destination memory.
pub fn copy_into(dst: &mut [u8], sources: &[(&[u8], usize)]) -> Result<()> {
    let mut pieces = Vec::with_capacity(sources.len());
    let mut end = 0;
    for &(bytes, at) in sources {
        if at < end || at + bytes.len() > dst.len() {
            return Err(crate::error::Error::InvalidValue {
                key: String::new(),
                reason: format!(
                    "a copy of {} bytes to offset {at} overlaps the previous one (ending at \
                     {end}) or leaves the destination of {} bytes",
                    bytes.len(),
                    dst.len()
                ),
            });
        }
        end = at + bytes.len();
        pieces.push(Piece {
            dst: at,
            len: bytes.len(),
            src: Source::Bytes(bytes),
        });
    }
    copy_pieces(dst, &pieces, threads_for(end))
}

/// Contiguous views of `storage`, one per tensor (same dtype and shape) at the layout's
/// offsets: the results of a packed copy.
pub fn views<T: std::borrow::Borrow<Tensor>>(
    storage: &Arc<Storage>,
    tensors: &[T],
    layout: &PackedLayout,
) -> Result<Vec<Tensor>> {
    tensors
        .iter()
        .zip(&layout.offsets)
        .map(|(t, &offset)| Tensor::contiguous_view_like(storage.clone(), offset, t.borrow()))
        .collect()
}

/// Threads for a copy of `total` bytes: one below [`PARALLEL_THRESHOLD`], else one per
/// core up to 8, or `TENSORFERRY_COPY_THREADS` when set.
pub(crate) fn threads_for(total: usize) -> usize {
    static CONFIGURED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let configured = *CONFIGURED.get_or_init(|| {
        std::env::var("TENSORFERRY_COPY_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
    });
    if let Some(n) = configured {
        return n.max(1);
    }
    if total < PARALLEL_THRESHOLD {
        return 1;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.clamp(1, 8)
}

/// Copies every piece into `dst`, splitting the pieces into `threads` runs of about equal bytes.
fn copy_pieces(dst: &mut [u8], pieces: &[Piece<'_>], threads: usize) -> Result<()> {
    if threads <= 1 || pieces.len() < 2 {
        return copy_group(dst, 0, pieces);
    }
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let share = total.div_ceil(threads);
    let mut groups: Vec<&[Piece<'_>]> = Vec::new();
    let mut start = 0;
    let mut acc = 0;
    for (i, p) in pieces.iter().enumerate() {
        acc += p.len;
        if acc >= share && i + 1 < pieces.len() {
            groups.push(&pieces[start..=i]);
            start = i + 1;
            acc = 0;
        }
    }
    groups.push(&pieces[start..]);
    std::thread::scope(|scope| {
        let mut rest = dst;
        let mut base = 0;
        let mut handles = Vec::new();
        for (gi, group) in groups.iter().enumerate() {
            let end = match groups.get(gi + 1) {
                Some(next) => next[0].dst,
                None => base + rest.len(),
            };
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(end - base);
            let group_base = base;
            handles.push(scope.spawn(move || copy_group(mine, group_base, group)));
            rest = tail;
            base = end;
        }
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("copy threads do not panic"))
    })
}

/// Copies `pieces` into `dst`, whose first byte is at offset `base` of the whole buffer.
fn copy_group(dst: &mut [u8], base: usize, pieces: &[Piece<'_>]) -> Result<()> {
    for p in pieces {
        let at = p.dst - base;
        let out = &mut dst[at..at + p.len];
        match p.src {
            Source::Bytes(b) => out.copy_from_slice(b),
            Source::Strided(t) => {
                let mut i = 0;
                t.for_each_run(|run| {
                    out[i..i + run.len()].copy_from_slice(run);
                    i += run.len();
                    Ok(())
                })?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn copy_into_places_each_source_at_its_offset_and_refuses_overlaps() {
        let (a, b) = ([1u8, 2, 3], [4u8, 5]);
        let mut dst = [0u8; 8];
        copy_into(&mut dst, &[(&a, 0), (&b, 5)]).unwrap();
        assert_eq!(dst, [1, 2, 3, 0, 0, 4, 5, 0]);
        assert!(copy_into(&mut dst, &[(&a, 0), (&b, 2)]).is_err());
        assert!(copy_into(&mut dst, &[(&a, 6)]).is_err());
    }

    #[test]
    fn layout_aligns_every_tensor_to_64_bytes() {
        let l = PackedLayout::plan([3, 64, 0, 65]);
        assert_eq!(l.offsets, vec![0, 64, 128, 128]);
        assert_eq!(l.total, 256);
    }

    #[test]
    fn packed_tensors_share_one_buffer_and_keep_values() {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
        let m = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
        let packed = pack(&[&a, &m.transpose(0, 1).unwrap()]).unwrap();
        let (a, t) = (&packed[0], &packed[1]);
        assert!(Arc::ptr_eq(a.storage(), t.storage()));
        assert_eq!(t.offset() % HOST_ALIGNMENT, 0);
        assert!(t.is_contiguous());
        assert_eq!(t.to_vec::<i32>().unwrap(), vec![1, 4, 2, 5, 3, 6]);
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn parallel_copy_matches_the_source_bytes() {
        let big: Vec<u8> = (0..(40usize << 20)).map(|i| (i * 7 % 251) as u8).collect();
        let mut tensors = vec![Tensor::from_bytes(DType::U8, vec![big.len()], &big).unwrap()];
        tensors.extend((0..50).map(|i| Tensor::from_slice(&[i as u8; 100], &[100]).unwrap()));
        let packed = pack(&tensors.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(packed[0].contiguous_bytes().unwrap(), &big[..]);
        assert_eq!(packed[50].to_vec::<u8>().unwrap(), vec![49; 100]);
    }
}
