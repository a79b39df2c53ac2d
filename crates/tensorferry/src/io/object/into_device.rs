//! Loading a checkpoint from object storage straight into a device's memory: the data
//! section (or a subset's byte ranges, laid end to end) comes in parallel ranged GETs
//! written into the buffers of the staging ring, and each chunk is copied into one device
//! allocation while the next is fetched — the ring driver local files use
//! ([`stream_to_device`]). Host memory stays bounded by the ring (plus the first GET's
//! bytes) whatever the object's size.

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::get::{write_into, Asked, Version};
use super::load::{fetch_header, read_index, resolved_load, FetchedHeader};
use super::location::Location;
use super::options::ObjectOptions;
use super::{lanes, plan};
use crate::backend::{backend_for, Backend};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::io::checkpoint::sharded::load_index_with;
use crate::io::format::header_reader::parse_counted;
use crate::io::into_device::ring_for;
use crate::io::read::{build, Loaded};
use crate::memory::AlignedBuffer;
use crate::storage::Storage;
use crate::tensor::Tensor;
use crate::transfer::staging::Ring;
use crate::transfer::stream_in::{stream_to_device, Piece};
use crate::transfer::Staging;

/// Requests of one chunk are never cut smaller than this (unless the chunk is).
const MIN_REQUEST_BYTES: u64 = 1 << 20;

/// Tensors of a subset closer than this are fetched together, the bytes between them
/// included: small, since those bytes take device memory too.
const DEVICE_MERGE_GAP: u64 = 4096;

/// Loads the checkpoint at `url` (found as [`super::load_url`] finds it) onto `device`,
/// through the staging ring `staging` names (else 3 × 32 MiB, as for files): each chunk
/// of the data section is fetched by up to [`ObjectOptions::concurrency`] ranged GETs
/// into a ring buffer, then copied to the device while the next chunk's GETs are under
/// way. Shards are loaded one after another, so host memory stays bounded by one ring.
/// Every GET is checked against the object's first answer (ETag and size): an object
/// replaced during the load is an error, and on any error the device memory taken is
/// released. Once `stop` is set, the load gives up before the next chunk with an
/// [`std::io::ErrorKind::Interrupted`] error. For the host this is [`super::load_url`].
///
/// With `only`, as for [`super::load_url`]: only those tensors' byte ranges are fetched,
/// into device memory of their size (not the object's), and every other tensor comes
/// back as a `None` value in its place.
pub fn load_url_to_until(
    url: &str,
    device: Device,
    options: &ObjectOptions,
    staging: Staging,
    stop: &AtomicBool,
    only: Option<&HashSet<String>>,
) -> Result<Loaded> {
    let staging = staging.validate()?;
    if device.is_host() {
        return super::load::load_url(url, options, only);
    }
    device.ensure_available()?;
    let backend = backend_for(device)?;
    let ring = ring_for(staging);
    let at = Location::open(url, options)?;
    let stream = Stream {
        backend: &backend,
        options,
        ring,
        stop,
    };
    let one = |object: &Location| stream_object(object, &stream, only);
    let mut loaded = resolved_load(at, options, one, |index| {
        let parsed = read_index(index, options)?;
        load_index_with(parsed, Path::new(index.url()), 1, |name| {
            one(&index.sibling(name))
        })
    })?;
    if let Some(names) = only {
        loaded.root = loaded.root.keep_only(names);
    }
    Ok(loaded)
}

/// How objects stream onto a device.
struct Stream<'a> {
    backend: &'a Arc<dyn Backend>,
    options: &'a ObjectOptions,
    ring: Ring,
    /// Give up before the next chunk once set.
    stop: &'a AtomicBool,
}

/// Loads one safetensors object (all of it, or the tensors `only` names) onto the device.
fn stream_object(
    at: &Location,
    stream: &Stream<'_>,
    only: Option<&HashSet<String>>,
) -> Result<Loaded> {
    let in_object = |e: Error| e.in_file(Path::new(at.url()));
    let header = fetch_header(at, stream.options)?;
    let parsed = parse_counted(&header.json, header.data_len).map_err(in_object)?;
    super::load::test_pause("TENSORFERRY_TEST_OBJECT_PAUSE");
    let Some(names) = only else {
        let whole = 0..header.data_len;
        let storage = stream_ranges(at, &header, std::slice::from_ref(&whole), stream)?;
        return build(parsed, storage, 0).map_err(in_object);
    };
    let wanted: Vec<Range<u64>> = parsed
        .0
        .tensors
        .iter()
        .filter(|t| names.contains(&t.name))
        .map(|t| t.begin as u64..t.end as u64)
        .collect();
    let ranges = plan::merged(wanted, DEVICE_MERGE_GAP);
    let storage = stream_ranges(at, &header, &ranges, stream)?;
    // The tree as the header builds it, over zeroed pages nothing touches; then the
    // wanted tensors moved to their place in the device memory. The others stay views of
    // those pages until the caller blanks them (once an index has checked its shards).
    let untouched = Arc::new(Storage::owned(AlignedBuffer::zeroed(
        header.data_len as usize,
    )?));
    let mut loaded = build(parsed, untouched, 0).map_err(in_object)?;
    loaded.root =
        loaded
            .root
            .try_map_tensors(&mut |path, t| match names.contains(&path.dotted()) {
                false => Ok(t.clone()),
                true => Tensor::contiguous_view(
                    storage.clone(),
                    packed_offset(&ranges, t.offset() as u64) as usize,
                    t.dtype(),
                    t.shape().to_vec(),
                ),
            })?;
    Ok(loaded)
}

/// Where byte `at` of the data section lies once `ranges` (sorted, disjoint) are laid end
/// to end; 0 for a byte in none of them (only an empty tensor's place can be).
fn packed_offset(ranges: &[Range<u64>], at: u64) -> u64 {
    let mut packed = 0;
    for r in ranges {
        if r.contains(&at) {
            return packed + (at - r.start);
        }
        packed += r.end - r.start;
    }
    0
}

/// Fetches `ranges` of the data section (sorted, disjoint) of the object whose header is
/// `header` into new device memory, laid end to end, chunk by chunk through the ring.
fn stream_ranges(
    at: &Location,
    header: &FetchedHeader,
    ranges: &[Range<u64>],
    stream: &Stream<'_>,
) -> Result<Arc<Storage>> {
    let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let ring = Ring {
        chunk_bytes: stream
            .ring
            .chunk_bytes
            .min((total as usize).max(1).next_multiple_of(stream.ring.align)),
        ..stream.ring
    };
    let chunks = chunks(ranges, ring.chunk_bytes as u64);
    let reads = Reads {
        at,
        header,
        version: header.version.clone(),
        options: stream.options,
    };
    // The GETs of the next chunk begin while this one's bodies arrive: the latency of
    // their first bytes is hidden behind this chunk's transfer (their bodies wait in the
    // connections, bounded by the network's own buffers, until their turn).
    let mut ahead: Option<(usize, Begun)> = None;
    let mut fill = |j: usize, buffer: &mut [MaybeUninit<u8>]| {
        if stream.stop.load(Ordering::Relaxed) {
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
        let len = bytes_of(&chunks[j]) as usize;
        reads.fill(&mut buffer[..len], begun)
    };
    let mut placed = 0usize;
    let pieces: Vec<Piece> = chunks
        .iter()
        .map(|c| {
            let len = bytes_of(c) as usize;
            placed += len;
            Piece {
                skip: 0,
                len,
                dst_offset: placed - len,
            }
        })
        .collect();
    stream_to_device(stream.backend, total as usize, &pieces, ring, &mut fill)
}

/// How the chunks of one object are read.
struct Reads<'a> {
    at: &'a Location,
    header: &'a FetchedHeader,
    version: Version,
    options: &'a ObjectOptions,
}

/// Where the bytes of a chunk come from, in order: the first GET's (bytes of the data
/// section it brought) or one ranged GET (absolute in the object).
enum Source {
    Head(Range<u64>),
    Get(Range<u64>),
}

/// The requests of one chunk: its sources, the first GETs already asked for.
struct Begun {
    sources: Vec<Source>,
    asked: Vec<Asked>,
}

impl Reads<'_> {
    /// The sources of `chunk` (ranges of the data section), and the first
    /// [`ObjectOptions::concurrency`] of its GETs begun.
    fn begin(&self, chunk: &[Range<u64>]) -> Result<Begun> {
        let concurrency = self.options.concurrency.max(1);
        let request = (self.options.part_bytes as u64).min(
            bytes_of(chunk)
                .div_ceil(concurrency as u64)
                .max(MIN_REQUEST_BYTES),
        );
        let sources = sources(
            chunk,
            self.header.data_head.len() as u64,
            self.header.data_start,
            request,
        );
        let mut asked = Vec::with_capacity(concurrency);
        for source in &sources {
            let Source::Get(range) = source else {
                continue;
            };
            if asked.len() == concurrency {
                break;
            }
            asked.push(Asked::begin(self.at, range.clone(), &self.version)?);
        }
        Ok(Begun { sources, asked })
    }

    /// Fills `into` (as long as the chunk) from the chunk's sources, in order: the first
    /// GET's bytes copied, the GETs `begun` drained and the others asked for now, several
    /// at once, on the runtime's workers ([`lanes`]).
    fn fill(&self, into: &mut [MaybeUninit<u8>], begun: Begun) -> Result<()> {
        let head = &self.header.data_head;
        let mut asked = begun.asked.into_iter();
        let mut ahead = HashMap::with_capacity(asked.len());
        let mut jobs = Vec::with_capacity(begun.sources.len());
        let mut rest = into;
        for source in &begun.sources {
            let (Source::Head(range) | Source::Get(range)) = source;
            let (slice, tail) =
                std::mem::take(&mut rest).split_at_mut((range.end - range.start) as usize);
            rest = tail;
            match source {
                Source::Head(r) => write_into(slice, &head[r.start as usize..r.end as usize]),
                Source::Get(r) => {
                    if let Some(request) = asked.next() {
                        ahead.insert(r.start, request);
                    }
                    jobs.push((r.clone(), slice));
                }
            }
        }
        let concurrency = self.options.concurrency;
        lanes::fetch_all(self.at, jobs, &self.version, concurrency, Some(ahead))
    }
}

/// The sources of the bytes `chunk` (ranges of the data section, laid end to end): those
/// below `head` (the data bytes the first GET brought) from it, the rest in GETs of at
/// most `request` bytes, at their place in the object (`data_start` + their offset).
fn sources(chunk: &[Range<u64>], head: u64, data_start: u64, request: u64) -> Vec<Source> {
    let mut out = Vec::new();
    for r in chunk {
        let split = head.clamp(r.start, r.end);
        if split > r.start {
            out.push(Source::Head(r.start..split));
        }
        let rest = split..r.end;
        for part in plan::parts(std::slice::from_ref(&rest), request) {
            out.push(Source::Get(data_start + part.start..data_start + part.end));
        }
    }
    out
}

/// The bytes of `ranges`.
fn bytes_of(ranges: &[Range<u64>]) -> u64 {
    ranges.iter().map(|r| r.end - r.start).sum()
}

/// `ranges` (sorted, disjoint) laid end to end and cut into chunks of `chunk_bytes` (the
/// last shorter): each chunk's ranges, in order.
fn chunks(ranges: &[Range<u64>], chunk_bytes: u64) -> Vec<Vec<Range<u64>>> {
    let chunk_bytes = chunk_bytes.max(1);
    let mut out: Vec<Vec<Range<u64>>> = Vec::new();
    let mut room = 0u64;
    for r in ranges {
        let mut at = r.start;
        while at < r.end {
            if room == 0 {
                out.push(Vec::new());
                room = chunk_bytes;
            }
            let end = r.end.min(at + room);
            out.last_mut().expect("pushed above").push(at..end);
            room -= end - at;
            at = end;
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one range is a case like any other here
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_ranges_laid_end_to_end() {
        assert_eq!(
            chunks(&[0..10_000], 4096),
            vec![vec![0..4096], vec![4096..8192], vec![8192..10_000]]
        );
        assert_eq!(
            chunks(&[0..3, 10..15, 20..21], 4),
            vec![vec![0..3, 10..11], vec![11..15], vec![20..21]]
        );
        assert!(chunks(&[], 4096).is_empty());
        assert!(chunks(&[0..0], 4096).is_empty());
    }

    #[test]
    fn bytes_the_first_get_brought_are_not_asked_for_again() {
        let got: Vec<(bool, Range<u64>)> = sources(&[0..10, 20..40], 25, 100, 8)
            .into_iter()
            .map(|s| match s {
                Source::Head(r) => (true, r),
                Source::Get(r) => (false, r),
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (true, 0..10),
                (true, 20..25),
                (false, 125..133),
                (false, 133..140)
            ]
        );
    }

    #[test]
    fn a_tensor_of_a_subset_finds_its_place_in_the_packed_memory() {
        let ranges = [10..20, 50..60];
        assert_eq!(packed_offset(&ranges, 10), 0);
        assert_eq!(packed_offset(&ranges, 55), 15);
        assert_eq!(packed_offset(&ranges, 30), 0); // an empty tensor between them
    }
}
