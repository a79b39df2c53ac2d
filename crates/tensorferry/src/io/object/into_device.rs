//! Loading a checkpoint from object storage straight into a device's memory: the data
//! section comes in parallel ranged GETs written into the buffers of the staging ring, and
//! each chunk is copied into one device allocation for the whole section while the next
//! is fetched — the ring driver local files use ([`stream_to_device`]). Host memory stays
//! bounded by the ring (plus the first GET's bytes) whatever the object's size.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::{StreamExt, TryStreamExt};
use object_store::GetResult;
use tokio::task::JoinHandle;

use super::load::{
    drain_into, fetch_header, read_index, request_part, resolved, write_into, FetchedHeader,
    Version,
};
use super::location::Location;
use super::{plan, runtime, ObjectOptions};
use crate::backend::{backend_for, Backend};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::io::header::parse_counted;
use crate::io::into_device::ring_for;
use crate::io::read::{build, Loaded};
use crate::io::sharded::load_index_with;
use crate::storage::Storage;
use crate::transfer::stream_in::{stream_to_device, Piece, StreamRing};
use crate::transfer::Staging;

/// Requests of one chunk are never cut smaller than this (unless the chunk is).
const MIN_REQUEST_BYTES: u64 = 1 << 20;

/// Loads the checkpoint at `url` (found as [`super::load_url`] finds it) onto `device`,
/// through the staging ring `staging` names (else 3 × 32 MiB, as for files): each chunk
/// of the data section is fetched by up to [`ObjectOptions::concurrency`] ranged GETs
/// into a ring buffer, then copied to the device while the next is fetched. Shards are
/// loaded one after another, so host memory stays bounded by one ring. Every GET is
/// checked against the object's first answer (ETag and size): an object replaced during
/// the load is an error, and on any error the device memory taken is released. Once
/// `stop` is set, the load gives up before the next chunk with an
/// [`std::io::ErrorKind::Interrupted`] error. For the host this is [`super::load_url`].
pub fn load_url_to_until(
    url: &str,
    device: Device,
    options: &ObjectOptions,
    staging: Staging,
    stop: &AtomicBool,
) -> Result<Loaded> {
    let staging = staging.validate()?;
    if device.is_host() {
        return super::load_url(url, options, None);
    }
    device.ensure_available()?;
    let backend = backend_for(device)?;
    let ring = ring_for(staging);
    let at = Location::open(url, options)?;
    let one = |object: &Location| stream_object(object, &backend, options, ring, stop);
    resolved(at, one, |index| {
        let parsed = read_index(index, options)?;
        load_index_with(parsed, Path::new(index.url()), 1, |name| {
            one(&index.sibling(name))
        })
    })
}

/// Loads one safetensors object onto `backend`'s device through `ring`.
fn stream_object(
    at: &Location,
    backend: &Arc<dyn Backend>,
    options: &ObjectOptions,
    ring: StreamRing,
    stop: &AtomicBool,
) -> Result<Loaded> {
    let in_object = |e: Error| e.in_file(Path::new(at.url()));
    let header = fetch_header(at, options)?;
    let parsed = parse_counted(&header.json, header.data_len).map_err(in_object)?;
    super::load::test_pause_after_header();
    let storage = stream_data(at, &header, backend, options, ring, stop)?;
    build(parsed, storage, 0).map_err(in_object)
}

/// Fetches the data section of the object whose header is `header` into new device
/// memory, chunk by chunk through `ring`.
fn stream_data(
    at: &Location,
    header: &FetchedHeader,
    backend: &Arc<dyn Backend>,
    options: &ObjectOptions,
    ring: StreamRing,
    stop: &AtomicBool,
) -> Result<Arc<Storage>> {
    let data_len = header.data_len as usize;
    let ring = StreamRing {
        chunk_bytes: ring
            .chunk_bytes
            .min(data_len.max(1).next_multiple_of(ring.align)),
        ..ring
    };
    let chunks = chunks(header.data_len, ring.chunk_bytes as u64);
    let reads = Reads {
        at,
        header,
        version: header.version(),
        options,
    };
    // The GETs of the next chunk begin while this one's bodies arrive: the latency of
    // their first bytes is hidden behind this chunk's transfer (their bodies wait in the
    // connections, bounded by the network's own buffers, until their turn).
    let mut ahead: Option<(usize, Begun)> = None;
    let mut fill = |j: usize, buffer: *mut u8| {
        if stop.load(Ordering::Relaxed) {
            return Err(Error::io(
                "read",
                at.url(),
                std::io::ErrorKind::Interrupted.into(),
            ));
        }
        let begun = match ahead.take() {
            Some((k, begun)) if k == j => begun,
            _ => reads.begin(&chunks[j])?,
        };
        if let Some(next) = chunks.get(j + 1) {
            ahead = Some((j + 1, reads.begin(next)?));
        }
        let chunk = chunks[j].clone();
        let len = (chunk.end - chunk.start) as usize;
        // SAFETY: the buffer holds `ring.chunk_bytes` writable bytes, at least `len`
        // (`chunks`), which only this chunk uses until its copy completes
        // (`stream_to_device`); they are written, never read, through the slice.
        let into = unsafe { std::slice::from_raw_parts_mut(buffer.cast::<MaybeUninit<u8>>(), len) };
        reads.fill(chunk, into, begun)
    };
    let pieces: Vec<Piece> = chunks
        .iter()
        .map(|c| Piece {
            skip: 0,
            len: (c.end - c.start) as usize,
            dst_offset: c.start as usize,
        })
        .collect();
    // SAFETY: each piece is its whole chunk, at most `ring.chunk_bytes` long, the pieces
    // tile the data section without overlap (`chunks`), and `fill` writes every byte of
    // its chunk (or fails), only inside the buffer (`fill_chunk`).
    unsafe { stream_to_device(backend, data_len, &pieces, ring, &mut fill) }
}

/// How the chunks of one object are read.
struct Reads<'a> {
    at: &'a Location,
    header: &'a FetchedHeader,
    version: Version,
    options: &'a ObjectOptions,
}

/// The requests of one chunk: its parts (ranges of the object, in order, the bytes the
/// first GET brought left out), the first of them already asked for.
struct Begun {
    parts: Vec<Range<u64>>,
    asked: Vec<Asked>,
}

/// A GET begun on the runtime, cancelled if dropped before its answer is taken (the load
/// failed or stopped).
struct Asked(JoinHandle<Result<GetResult>>);

impl Asked {
    async fn answer(mut self, at: &Location) -> Result<GetResult> {
        (&mut self.0)
            .await
            .map_err(|e| Error::io("read", at.url(), std::io::Error::other(e.to_string())))?
    }
}

impl Drop for Asked {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Reads<'_> {
    /// The parts of `chunk` (a range of the data section), and the GETs of the first
    /// [`ObjectOptions::concurrency`] of them begun.
    fn begin(&self, chunk: &Range<u64>) -> Result<Begun> {
        let head = self.header.data_head.len() as u64;
        let from = head.clamp(chunk.start, chunk.end);
        let len = chunk.end - chunk.start;
        let concurrency = self.options.concurrency.max(1);
        let request = (self.options.part_bytes as u64)
            .min(len.div_ceil(concurrency as u64).max(MIN_REQUEST_BYTES));
        let start = self.header.data_start;
        let parts: Vec<Range<u64>> = plan::parts(std::slice::from_ref(&(from..chunk.end)), request)
            .into_iter()
            .map(|r| start + r.start..start + r.end)
            .collect();
        let mut asked = Vec::with_capacity(parts.len().min(concurrency));
        for range in parts.iter().take(concurrency).cloned() {
            let (at, version) = (self.at.clone(), self.version.clone());
            asked.push(Asked(runtime::spawn(async move {
                request_part(&at, range, &version).await
            })?));
        }
        Ok(Begun { parts, asked })
    }

    /// Fills `into` with the bytes `chunk` of the data section: those the first GET
    /// brought copied, the rest from the GETs `begun` (those not begun yet asked for
    /// now), several at once.
    fn fill(&self, chunk: Range<u64>, into: &mut [MaybeUninit<u8>], begun: Begun) -> Result<()> {
        let head = &self.header.data_head;
        let from_head = (head.len() as u64).clamp(chunk.start, chunk.end) - chunk.start;
        let (from_first, rest) = into.split_at_mut(from_head as usize);
        if from_head > 0 {
            write_into(
                from_first,
                &head[chunk.start as usize..(chunk.start + from_head) as usize],
            );
        }
        let mut asked = begun.asked.into_iter();
        let mut jobs = Vec::with_capacity(begun.parts.len());
        let mut rest = rest;
        for range in &begun.parts {
            let (slice, tail) =
                std::mem::take(&mut rest).split_at_mut((range.end - range.start) as usize);
            jobs.push((range.clone(), slice, asked.next()));
            rest = tail;
        }
        let at = self.at;
        let version = &self.version;
        runtime::block_on(
            futures_util::stream::iter(jobs)
                .map(|(range, slice, asked)| async move {
                    let answer = match asked {
                        Some(request) => request.answer(at).await?,
                        None => request_part(at, range.clone(), version).await?,
                    };
                    drain_into(at, range, answer, slice).await
                })
                .buffer_unordered(self.options.concurrency.max(1))
                .try_for_each(|()| async { Ok(()) }),
        )?
    }
}

/// The data section `0..data_len` cut into chunks of `chunk_bytes` (the last shorter).
fn chunks(data_len: u64, chunk_bytes: u64) -> Vec<Range<u64>> {
    plan::parts(std::slice::from_ref(&(0..data_len)), chunk_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_data_section() {
        assert_eq!(
            chunks(10_000, 4096),
            vec![0..4096, 4096..8192, 8192..10_000]
        );
        assert!(chunks(0, 4096).is_empty());
    }
}
