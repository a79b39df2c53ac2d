//! Loading checkpoints from object storage into host memory.
//!
//! One object: the first GET asks for its first [`ObjectOptions::header_bytes`] (which
//! hold the whole object when it is small). A whole load asks for the rest of the object
//! as soon as that GET's answer begins (its size and version, and the header's length in
//! its first bytes), in parallel ranged GETs ([`ObjectOptions::part_bytes`] each,
//! [`ObjectOptions::concurrency`] at once) while the first body still arrives, so the
//! header costs no round trip of its own; the header is parsed as soon as its bytes are
//! in, and a bad one ends the load there, cancelling the GETs in flight. A subset needs
//! the header first: the first GET,
//! a second one only when the header is longer, then only its tensors' byte ranges. Either
//! way the bytes land in one aligned buffer, which goes through the same validated
//! header → tree path as a local file ([`crate::io::read`]). Every GET after the first
//! is conditional on the first one's ETag, and its answer is checked against it: an
//! object replaced during the read is an error, never a mix of two versions.
//!
//! Sharded checkpoints load through their index, each shard as above, several at once.

use std::collections::{BTreeMap, HashSet};
use std::mem::MaybeUninit;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use object_store::list::PaginatedListOptions;
use object_store::{GetRange, ObjectMeta, ObjectStoreExt};

use super::arrival::{Arrival, Stop};
use super::failure::{cause_of, failed, from_store, Cause};
use super::get::{answer, fetch_part, Body, Version};
use super::location::Location;
use super::options::{ObjectOptions, Pinned};
use super::{lanes, plan, runtime};
use crate::backend::Event;
use crate::error::{Error, Result};
use crate::io::checkpoint::index::{check_index_len, parse_index, Index, INDEX_SUFFIX};
use crate::io::checkpoint::sharded::{choose_in_folder, load_index_with, Chosen, READERS};
use crate::io::format::header::{Header, HeaderCensus};
use crate::io::format::header_reader::{header_len, parse_counted};
use crate::io::format::tree_census;
use crate::io::read::{build, Loaded};
use crate::memory::{AlignedBuffer, HostBuffer, HOST_ALIGNMENT};
use crate::storage::Storage;

/// Loads the checkpoint at `url`: one safetensors object, an index of shards
/// (`…/model.safetensors.index.json`), the index a sharded save to `url` wrote
/// (`url` + `.index.json`), or the checkpoint in a folder (`url` ending in `/`:
/// `model.safetensors`, else `model.safetensors.index.json`, else the one index or the
/// one safetensors object in it).
///
/// With `only`, only the tensors of those names are fetched (their byte ranges, and the
/// headers); every other tensor comes back as a `None` value in its place, so the tree
/// keeps its shape for a caller that then selects.
pub fn load_url(
    url: &str,
    options: &ObjectOptions,
    only: Option<&HashSet<String>>,
) -> Result<Loaded> {
    let (loaded, arrival) = load_url_arriving(url, options, only)?;
    arrival.wait()?;
    Ok(loaded)
}

/// [`load_url`], handing the tree over as soon as it is built: a whole object's bytes may
/// still be arriving then, into the memory its tensors view. Every read of that memory
/// waits until they are in, and fails if they never come; [`Arrival::wait`] gives the
/// load's own error. What the caller does meanwhile (such as handing each tensor to its
/// framework) overlaps the download. An index's shards and a subset arrive whole.
pub fn load_url_arriving(
    url: &str,
    options: &ObjectOptions,
    only: Option<&HashSet<String>>,
) -> Result<(Loaded, Arrival)> {
    let at = Location::open(url, options)?;
    let (mut loaded, arrival) = resolved_load(
        at,
        options,
        |object| arrive_object(object, options, only),
        |index| Ok((load_index(index, options, only)?, Arrival::complete())),
    )?;
    if let Some(names) = only {
        loaded.root = loaded.root.keep_only(names);
    }
    Ok((loaded, arrival))
}

/// What [`tensor_names`] finds: the names, whether a tensor has a second name, and for a
/// URL that names one object itself, that object as read ([`ObjectOptions::pinned`] for
/// the load that follows: no second GET of its header).
pub type Names = (Vec<String>, bool, Option<Pinned>);

/// The names of the tensors the checkpoint at `url` holds (as [`load_url`] finds it),
/// from its index or its header alone, and whether its tree record gives some tensor a
/// second name (an alias, such as a head tied to the embedding), which no header lists.
pub fn tensor_names(url: &str, options: &ObjectOptions) -> Result<Names> {
    let at = Location::open(url, options)?;
    let named = at.url().to_string();
    resolved(
        at,
        |object| {
            let fetched = fetch_header(object, options)?;
            let (header, census) = parse_counted(&fetched.json, fetched.data_len)
                .map_err(|e| e.in_file(Path::new(object.url())))?;
            let aliased = matches!(census.tree, Some(Ok(tree)) if !tree.aliased.is_empty());
            let pinned = (object.url() == named).then(|| fetched.pinned());
            let names = header.tensors.into_iter().map(|t| t.name).collect();
            Ok((names, aliased, pinned))
        },
        |index| {
            let index = read_index(index, options)?;
            let aliased = match &index.record {
                Some(text) => !tree_census::count(text)?.aliased.is_empty(),
                None => false,
            };
            Ok((index.names().map(String::from).collect(), aliased, None))
        },
    )
}

/// What [`load_url`] reads for `url`: `(true, index URL)` for a sharded checkpoint, else
/// `(false, object URL)`, resolved as it resolves them (an index, a folder, the index a
/// sharded save to `url` wrote). For readers that plan their own ranged reads.
pub fn resolve_url(url: &str, options: &ObjectOptions) -> Result<(bool, String)> {
    let at = Location::open(url, options)?;
    resolved(
        at,
        |object| head(object).map(|_| (false, object.url().to_string())),
        |index| Ok((true, index.url().to_string())),
    )
}

/// The user metadata of the checkpoint at `url` (as [`load_url`] finds it), from headers
/// alone: an object's, or an index's first shard's, as [`crate::io::read_metadata`] gives
/// for files.
pub fn read_metadata_url(url: &str, options: &ObjectOptions) -> Result<BTreeMap<String, String>> {
    let at = Location::open(url, options)?;
    let of_object = |object: &Location| {
        let header = fetch_header(object, options)?;
        let parsed = parse_counted(&header.json, header.data_len)
            .map_err(|e| e.in_file(Path::new(object.url())))?;
        Ok(parsed.0.metadata)
    };
    resolved(at, of_object, |index| {
        let first = read_index(index, options)?.files().next().map(String::from);
        let first = first.ok_or_else(|| Error::Format {
            at: index.url().to_string(),
            reason: "the index names no shard".into(),
        })?;
        of_object(&index.sibling(&first))
    })
}

/// The header of the safetensors object at `url` (one object: no folder or index is
/// resolved), validated as a load validates it, with its bytes as stored (the 8-byte
/// length, then the JSON), the object's ETag (when the store gives one) and size: what
/// [`read_into`] needs to read the tensors' bytes of that version. Offsets in the
/// header are relative to its `data_start`.
pub fn read_header_url(
    url: &str,
    options: &ObjectOptions,
) -> Result<(Header, Vec<u8>, Option<String>, u64)> {
    let at = Location::open(url, options)?;
    let header = fetch_header(&at, options)?;
    let parsed = crate::io::format::header_reader::parse_header(&header.json, header.data_len)
        .map_err(|e| e.in_file(Path::new(at.url())))?;
    let Pinned { etag, size, header } = header.pinned();
    Ok((parsed, header, etag, size))
}

/// The size and ETag (when the store gives one) of the object at `url`, from one HEAD.
pub fn head_url(url: &str, options: &ObjectOptions) -> Result<(u64, Option<String>)> {
    let at = Location::open(url, options)?;
    let meta = head(&at)?;
    Ok((meta.size, meta.e_tag))
}

/// Fills each `(offset, buffer)` of `targets` with the bytes of the object at `url` (one
/// object: no folder or index is resolved) from that offset, in parallel ranged GETs of
/// at most [`ObjectOptions::part_bytes`] each, [`ObjectOptions::concurrency`] at once.
/// With `etag`, the object must still be that version (else an error of cause
/// [`Cause::Changed`]); every GET is checked against the version the first request
/// (a HEAD) found, so all bytes come from one version of the object. A range past the
/// object's end is refused before anything is read.
pub fn read_into(
    url: &str,
    targets: Vec<(u64, &mut [u8])>,
    etag: Option<&str>,
    options: &ObjectOptions,
) -> Result<()> {
    let at = Location::open(url, options)?;
    let meta = head(&at)?;
    if let Some(expected) = etag.filter(|e| meta.e_tag.as_deref() != Some(*e)) {
        return Err(failed(
            "read",
            at.url(),
            Cause::Changed,
            format!("expected ETag {expected:?}, found {:?}", meta.e_tag),
        ));
    }
    let version = Version {
        etag: meta.e_tag,
        size: meta.size,
    };
    let past_the_end = targets
        .iter()
        .map(|(offset, buffer)| *offset..offset.saturating_add(buffer.len() as u64))
        .find(|r| r.end > version.size);
    if let Some(r) = past_the_end {
        return Err(Error::InvalidValue {
            key: String::new(),
            reason: format!(
                "bytes {r:?} of {}: the object holds {} bytes",
                at.url(),
                version.size
            ),
        });
    }
    let mut jobs = Vec::new();
    for (offset, buffer) in targets {
        let range = offset..offset + buffer.len() as u64;
        let mut rest = as_uninit(buffer);
        for part in plan::parts(std::slice::from_ref(&range), options.part_bytes as u64) {
            let (slice, tail) =
                std::mem::take(&mut rest).split_at_mut((part.end - part.start) as usize);
            jobs.push((part, slice));
            rest = tail;
        }
    }
    lanes::fetch_all(&at, jobs, &version, options.concurrency, None)
}

/// What a load of `at` reads, as [`load_url`] says, read by `object` (one safetensors
/// object) or `index` (an index of shards). A missing object is found missing by its
/// first GET, whose answer names the cause (a HEAD's has no body to tell a missing
/// bucket from a missing object).
pub(super) fn resolved<T>(
    at: Location,
    object: impl Fn(&Location) -> Result<T>,
    index: impl Fn(&Location) -> Result<T>,
) -> Result<T> {
    if at.name().ends_with(INDEX_SUFFIX) {
        return index(&at);
    }
    if at.is_folder() {
        return match in_folder(&at)? {
            Target::Index(found) => index(&found),
            Target::Object(found) => object(&found),
        };
    }
    match object(&at) {
        // Not there: the index a sharded save to that name wrote, if there is one.
        Err(e) if cause_of(&e) == Some(Cause::NotFound) => {
            let name = at.name();
            let stem = name.strip_suffix(".safetensors").unwrap_or(name);
            let found = at.sibling(&format!("{stem}{INDEX_SUFFIX}"));
            match head(&found) {
                Ok(_) => index(&found),
                Err(_) => Err(missing_bucket(&at).unwrap_or(e)),
            }
        }
        other => other,
    }
}

/// [`resolved`] for a load with `options`: one [`ObjectOptions::pinned`] names one object,
/// read as it is (never an index, a folder, or the index a sharded save to its name wrote).
pub(super) fn resolved_load<T>(
    at: Location,
    options: &ObjectOptions,
    object: impl Fn(&Location) -> Result<T>,
    index: impl Fn(&Location) -> Result<T>,
) -> Result<T> {
    if options.pinned.is_none() {
        return resolved(at, object, index);
    }
    if at.is_folder() || at.name().ends_with(INDEX_SUFFIX) {
        let why = "a pinned version and header belong to one object, not an index or a folder";
        return Err(failed("read", at.url(), Cause::BadConfig, why));
    }
    object(&at)
}

/// The error saying the bucket of `at` does not exist, when a listing says so (some
/// servers answer a GET in a missing bucket with "no such key"); `None` otherwise.
fn missing_bucket(at: &Location) -> Option<Error> {
    // The first page of a listing says it (one entry asked for).
    let pages = at.pages()?;
    let options = PaginatedListOptions {
        max_keys: Some(1),
        ..Default::default()
    };
    let first = runtime::block_on(pages.list_paginated(Some(at.key().as_ref()), options)).ok()?;
    let e = from_store("read", at.url(), first.err()?);
    (cause_of(&e) == Some(Cause::NoBucket)).then_some(e)
}

/// The most entries (objects and subfolders) a folder's listing may hold: a listing is read
/// a page at a time, and a server whose pages never end must not hold the load, nor fill
/// memory.
const MAX_LISTED: usize = 10_000;

/// The names of the objects directly in the folder `dir`: its listing by the delimiter
/// `/`, a page at a time, of at most [`MAX_LISTED`] entries (over HTTP, one PROPFIND of
/// depth 1).
fn names_in(dir: &Location) -> Result<Vec<String>> {
    let listing_error = |e| from_store("list", dir.url(), e);
    let Some(pages) = dir.pages() else {
        let listing = runtime::block_on(dir.store().list_with_delimiter(Some(dir.key())))?
            .map_err(listing_error)?;
        return Ok(listing
            .objects
            .iter()
            .filter_map(|o| o.location.filename())
            .map(String::from)
            .collect());
    };
    // Unlike `ObjectStore::list`, a paged listing takes the prefix as it is given.
    let prefix = match dir.key().as_ref() {
        "" => String::new(),
        key => format!("{key}/"),
    };
    runtime::block_on(async {
        let (mut names, mut seen, mut token) = (Vec::new(), 0, None);
        loop {
            let options = PaginatedListOptions {
                delimiter: Some("/".into()),
                page_token: token.take(),
                ..Default::default()
            };
            let page = pages
                .list_paginated(Some(&prefix), options)
                .await
                .map_err(listing_error)?;
            seen += page.result.objects.len() + page.result.common_prefixes.len();
            if seen > MAX_LISTED {
                return Err(failed(
                    "list",
                    dir.url(),
                    Cause::Other,
                    format!("over {MAX_LISTED} entries are in it: name the checkpoint's object or index"),
                ));
            }
            let objects = page.result.objects.iter();
            names.extend(
                objects
                    .filter_map(|o| o.location.filename())
                    .map(String::from),
            );
            match page.page_token {
                Some(next) => token = Some(next),
                None => return Ok(names),
            }
        }
    })?
}

/// What a folder's checkpoint is.
enum Target {
    Object(Location),
    Index(Location),
}

/// The checkpoint in the folder `dir`, in transformers' order ([`choose_in_folder`]),
/// `model.safetensors` and its index asked for before the folder is listed.
fn in_folder(dir: &Location) -> Result<Target> {
    let single = dir.sibling("model.safetensors");
    if head(&single).is_ok() {
        return Ok(Target::Object(single));
    }
    let index = dir.sibling(&format!("model{INDEX_SUFFIX}"));
    if head(&index).is_ok() {
        return Ok(Target::Index(index));
    }
    let listed = names_in(dir)?;
    let names: Vec<&str> = listed.iter().map(String::as_str).collect();
    match choose_in_folder(&names, dir.url(), "objects", "the one")? {
        Some(Chosen::File(name)) => Ok(Target::Object(dir.sibling(&name))),
        Some(Chosen::Index(name)) => Ok(Target::Index(dir.sibling(&name))),
        None => Err(failed(
            "find a checkpoint (a *.safetensors object or a *.safetensors.index.json) in",
            dir.url(),
            Cause::NotFound,
            "the folder holds neither",
        )),
    }
}

/// The object's size and version, or why it cannot be read.
fn head(at: &Location) -> Result<ObjectMeta> {
    runtime::block_on(at.store().head(at.key()))?.map_err(|e| from_store("read", at.url(), e))
}

/// Reads and checks the index at `at`.
pub(super) fn read_index(at: &Location, options: &ObjectOptions) -> Result<Index> {
    let label = Path::new(at.url());
    let first_len = options.header_bytes as u64;
    let (first, meta) = get(at, Some(GetRange::Bounded(0..first_len)), None, first_len)?;
    check_index_len(meta.size, label)?;
    let bytes = match (first.len() as u64) < meta.size {
        true => {
            let (whole, now) = get(at, Some(GetRange::Offset(0)), meta.e_tag, meta.size)?;
            if now.size != meta.size {
                let sizes = format!("{} bytes, then {}", meta.size, now.size);
                return Err(failed("read", at.url(), Cause::Changed, sizes));
            }
            whole
        }
        false => first,
    };
    parse_index(&bytes, label)
}

/// Loads every shard the index at `at` names, several at once, as one tree.
fn load_index(
    at: &Location,
    options: &ObjectOptions,
    only: Option<&HashSet<String>>,
) -> Result<Loaded> {
    let index = read_index(at, options)?;
    load_index_with(index, Path::new(at.url()), READERS, |name| {
        let (loaded, arrival) = arrive_object(&at.sibling(name), options, only)?;
        arrival.wait()?;
        Ok(loaded)
    })
}

/// One GET of `range` (the whole object for `None`) of the object at `at` (conditional on
/// `etag` when given), of at most `cap` bytes: its bytes and what the store says of the
/// object. An answer announcing more is refused before any of it is held: a server may
/// claim any length, and the body is collected into one allocation of the announced size.
pub(super) fn get(
    at: &Location,
    range: Option<GetRange>,
    etag: Option<String>,
    cap: u64,
) -> Result<(Bytes, ObjectMeta)> {
    runtime::block_on(async {
        let result = answer(at, range, etag).await?;
        let len = result.range.end.saturating_sub(result.range.start);
        if len > cap {
            return Err(Error::Format {
                at: at.url().to_string(),
                reason: format!("the store announced {len} bytes where at most {cap} can be"),
            });
        }
        let meta = result.meta.clone();
        let bytes = result.bytes().await;
        Ok((bytes.map_err(|e| from_store("read", at.url(), e))?, meta))
    })?
}

/// An object's header and the start of its data section, from the first GET.
pub(super) struct FetchedHeader {
    /// The header's JSON.
    pub(super) json: Vec<u8>,
    /// The data section's length.
    pub(super) data_len: u64,
    /// The data section's offset in the object.
    pub(super) data_start: u64,
    /// The first bytes of the data section, fetched with the header.
    pub(super) data_head: Bytes,
    /// The object's version, which every later GET must find.
    pub(super) version: Version,
}

impl FetchedHeader {
    /// The object as this read found it: its version, and its header as stored (the
    /// 8-byte length, then the JSON), as a later load of that version takes it
    /// ([`ObjectOptions::pinned`]; [`pinned_header`] reads it back).
    fn pinned(&self) -> Pinned {
        let mut header = (self.json.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(&self.json);
        Pinned {
            etag: self.version.etag.clone(),
            size: self.version.size,
            header,
        }
    }
}

/// The header of the object at `at`: one GET of its first bytes, a second one only
/// when the header is longer.
pub(super) fn fetch_header(at: &Location, options: &ObjectOptions) -> Result<FetchedHeader> {
    if let Some(pinned) = &options.pinned {
        return pinned_header(at, pinned);
    }
    let first_len = options.header_bytes.max(8) as u64;
    let (first, meta) = match get(at, Some(GetRange::Bounded(0..first_len)), None, first_len) {
        // An empty object has no range to give.
        Err(e) if is_empty_object(&e) => (
            Bytes::new(),
            ObjectMeta {
                size: 0,
                ..head(at)?
            },
        ),
        other => other?,
    };
    let size = meta.size;
    let data_start = 8 + header_len(&first, size).map_err(|e| e.in_file(Path::new(at.url())))?;
    let version = Version {
        etag: meta.e_tag,
        size,
    };
    let got = data_start.min(first.len() as u64);
    let mut json = first[8..got as usize].to_vec();
    json.resize((data_start - 8) as usize, 0);
    if got < data_start {
        let rest = as_uninit(&mut json[(got - 8) as usize..]);
        runtime::block_on(fetch_part(at, got..data_start, rest, &version))??;
    }
    Ok(FetchedHeader {
        json,
        data_len: size - data_start,
        data_start,
        data_head: first.slice(got as usize..),
        version,
    })
}

/// The header an earlier read of `at` found (`pinned`), as [`fetch_header`] gives it,
/// asking for nothing: the GETs that follow must find that version.
fn pinned_header(at: &Location, pinned: &Pinned) -> Result<FetchedHeader> {
    let in_object = |e: Error| e.in_file(Path::new(at.url()));
    let data_start = 8 + header_len(&pinned.header, pinned.size).map_err(in_object)?;
    if pinned.header.len() as u64 != data_start {
        let held = pinned.header.len();
        let reason = format!("the pinned header holds {held} bytes, its length says {data_start}");
        return Err(in_object(Error::format_at(0, reason)));
    }
    Ok(FetchedHeader {
        json: pinned.header[8..].to_vec(),
        data_len: pinned.size - data_start,
        data_start,
        data_head: Bytes::new(),
        version: Version {
            etag: pinned.etag.clone(),
            size: pinned.size,
        },
    })
}

/// An error saying the object at `at` was replaced when the version `meta` found is not
/// the one `pinned` (by an earlier read); a server that ignored the GET's `If-Match` is
/// caught here too.
fn check_pinned(at: &Location, meta: &ObjectMeta, pinned: Option<&Pinned>) -> Result<()> {
    let Some(pinned) = pinned else {
        return Ok(());
    };
    if meta.size == pinned.size && (pinned.etag.is_none() || meta.e_tag == pinned.etag) {
        return Ok(());
    }
    let etag = |e: &Option<String>| e.clone().unwrap_or_else(|| "none".into());
    let detail = format!(
        "an earlier read found ETag {} and {} bytes, this one {} and {} bytes",
        etag(&pinned.etag),
        pinned.size,
        etag(&meta.e_tag),
        meta.size
    );
    Err(failed("read", at.url(), Cause::Changed, detail))
}

/// Whether a GET failed only because the object holds no bytes (no range to give: HTTP
/// 416, S3's `InvalidRange`). Not any message with "416" in it: the client's messages
/// hold the request's duration ("in 41.6ms").
fn is_empty_object(e: &Error) -> bool {
    let text = e.to_string();
    cause_of(e) == Some(Cause::Other)
        && (text.contains("InvalidRange") || text.contains("416 Range Not Satisfiable"))
}

/// Loads one safetensors object (never an index): all of it ([`arrive_whole`]), or the
/// tensors `only` names, whose byte ranges the header says ([`load_subset`]), which
/// arrive whole.
fn arrive_object(
    at: &Location,
    options: &ObjectOptions,
    only: Option<&HashSet<String>>,
) -> Result<(Loaded, Arrival)> {
    match only {
        None => arrive_whole(at, options),
        Some(names) => Ok((load_subset(at, options, names)?, Arrival::complete())),
    }
}

/// Loads all of one safetensors object, its header's round trip hidden behind the data,
/// and hands its tree over before the last byte is in: the first GET (of
/// [`ObjectOptions::header_bytes`]) is answered with the object's size and version and, in
/// its first bytes, the header's length; the rest of the object is asked for at once, in
/// parallel ranged GETs conditional on that version, while the first answer's body still
/// arrives. The whole object lands in one buffer, placed so that its data section starts
/// 64-byte aligned. The header is parsed as soon as its bytes are in (from the first GET,
/// or with the GETs that carry its rest), and the tree is built from it then, over the
/// buffer the GETs go on filling on a thread of their own: every read of it waits for the
/// [`Arrival`]. A header that fails the parse ends the load there, cancelling the GETs
/// still in flight.
fn arrive_whole(at: &Location, options: &ObjectOptions) -> Result<(Loaded, Arrival)> {
    let in_object = |e: Error| e.in_file(Path::new(at.url()));
    let first_len = options.header_bytes.max(8) as u64;
    let pinned = options.pinned.as_ref();
    let (meta, mut body) = match runtime::block_on(first_answer(at, first_len, pinned))? {
        // An empty object has no range to give, and no header.
        Err(e) if is_empty_object(&e) => return Err(in_object(header_len(&[], 0).unwrap_err())),
        other => other?,
    };
    let size = meta.size;
    let first_end = first_len.min(size);
    let mut len = [0u8; 8];
    let k = first_end.min(8) as usize;
    runtime::block_on(body.fill(at, as_uninit(&mut len[..k])))??;
    let data_start = 8 + header_len(&len[..k], size).map_err(in_object)?;
    let pad = data_start.next_multiple_of(HOST_ALIGNMENT as u64) - data_start;
    test_pause("TENSORFERRY_TEST_OBJECT_PAUSE");
    let version = Version {
        etag: meta.e_tag,
        size,
    };
    // The rest of the object, in parts laid from the first GET's end, the one that holds
    // the header's end cut there: the header (with the first GET's bytes) is in once the
    // GETs before `split` are.
    let split = first_end.max(data_start);
    let parts = plan::parts(
        std::slice::from_ref(&(first_end..size)),
        options.part_bytes as u64,
    );
    let header_parts: Vec<Range<u64>> = parts
        .iter()
        .filter(|p| p.start < split)
        .map(|p| p.start - first_end..p.end.min(split) - first_end)
        .collect();
    let data_parts: Vec<Range<u64>> = plan::after(parts, split)
        .into_iter()
        .map(|p| p.start - split..p.end - split)
        .collect();
    // The first GET is one of the `concurrency` in flight, and so are the header's.
    let others = options.concurrency.saturating_sub(1).max(1);
    let for_data = others.saturating_sub(header_parts.len()).max(1);
    let fill = Fill {
        at: at.clone(),
        body,
        len,
        k,
        first_end,
        data_start,
        split,
        version,
        header_parts,
        data_parts,
        others,
        for_data,
    };
    let buffer = AlignedBuffer::zeroed_small_pages((pad + size) as usize)?;
    let pages = buffer.page_span();
    let done = Event::pending();
    let storage = Arc::new(Storage::incoming(
        HostBuffer::Pageable(buffer),
        done.clone(),
    ));
    let (arrival, writer) = Arrival::pending(done);
    let (header_tx, header_rx) = std::sync::mpsc::sync_channel(1);
    let memory = storage.clone();
    let url = at.url().to_string();
    let spawned = std::thread::Builder::new()
        .name("tensorferry-object".into())
        .spawn(move || {
            let mut header_tx = Some(header_tx);
            let filled = {
                // SAFETY: `memory` keeps the buffer allocated until after the guard is dropped
                // at the end of this block.
                let _pages = pages.map(|span| unsafe { crate::memory::PagesAhead::start(span) });
                // SAFETY: `memory` is incoming memory (`Storage::incoming`): safe code reads its
                // bytes only after `done` completes, which happens below, once this slice and
                // every GET writing through it are gone (`fill` returns only then); the tree
                // handed over meanwhile holds views, whose readers wait, and a consumer that
                // takes one's address before (`Readable::promised`) has promised not to read it
                // before then. Nothing else writes the buffer, which `memory` keeps alive.
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(memory.as_ptr().cast_mut(), memory.len())
                };
                fill.run(&mut bytes[pad as usize..], &writer.stop, &mut |parsed| {
                    if let Some(tx) = header_tx.take() {
                        let _ = tx.send(Ok(parsed));
                    }
                })
            };
            match (filled, header_tx) {
                (Ok(()), _) => writer.succeed(),
                // Before the header was handed over: the caller gets the error.
                (Err(e), Some(tx)) => {
                    writer.fail(&url, failed("read", &url, Cause::Other, e.to_string()));
                    let _ = tx.send(Err(e));
                }
                (Err(e), None) => writer.fail(&url, e),
            }
            drop(memory);
        });
    if let Err(source) = spawned {
        return Err(Error::Io {
            op: "start a thread to read",
            path: at.url().into(),
            source,
        });
    }
    let parsed = header_rx.recv().unwrap_or_else(|_| {
        Err(failed(
            "read",
            at.url(),
            Cause::Other,
            "the thread reading the object ended",
        ))
    })?;
    let base = (pad + data_start) as usize;
    match build(parsed, storage, base).map_err(in_object) {
        Ok(loaded) => Ok((loaded, arrival)),
        Err(e) => {
            arrival.cancel();
            Err(e)
        }
    }
}

/// The GETs of [`arrive_whole`] after the first one's answer began: what they fetch and
/// where it goes.
struct Fill {
    at: Location,
    /// The first GET's body, past the header's length.
    body: Body,
    /// The header's length, as stored (its first `k` bytes are the first GET's).
    len: [u8; 8],
    k: usize,
    /// The first GET's end, the data section's start, and the end of the GETs that carry
    /// the header (the larger of the two).
    first_end: u64,
    data_start: u64,
    split: u64,
    version: Version,
    /// The parts before `split` (counted from `first_end`) and after it (from `split`).
    header_parts: Vec<Range<u64>>,
    data_parts: Vec<Range<u64>>,
    /// GETs at once beside the first one, and for the data alone.
    others: usize,
    for_data: usize,
}

impl Fill {
    /// Fills `object` (the whole object's bytes) and hands the parsed header to `header`
    /// as soon as it is in, while the data goes on arriving; returns once every GET has
    /// ended. The data parts fill on the runtime's workers while this thread brings the
    /// header in (the first GET's body, and the parts that carry the header's rest), then
    /// parses it as the data goes on arriving. `stop` ends it early.
    fn run(
        mut self,
        object: &mut [u8],
        stop: &Stop,
        header: &mut (dyn FnMut((Header, HeaderCensus)) + Send),
    ) -> Result<()> {
        let (at, url) = (&self.at, self.at.url());
        let (data_start, first_end, k) = (self.data_start, self.first_end, self.k);
        object[..8].copy_from_slice(&self.len);
        let (with_header, rest) = object.split_at_mut(self.split as usize);
        let (version, data_len) = (&self.version, self.version.size - data_start);
        let data = jobs_of(as_uninit(rest), self.split, &self.data_parts);
        let body = &mut self.body;
        lanes::fetch_spawned(at, data, version, self.for_data, None, |data_lanes| {
            if data_start <= first_end {
                // The first GET holds the header: parsed as soon as it is in.
                let (json, data_head) = with_header.split_at_mut(data_start as usize);
                let fill_json = body.fill(at, &mut as_uninit(json)[k..]);
                runtime::block_on(stop.or_stopped(url, fill_json))??;
                let rest_of_first = async {
                    body.fill(at, as_uninit(data_head)).await?;
                    body.end(at).await
                };
                let header = futures_util::future::try_join(
                    handed(at, &json[8..], data_len, header),
                    rest_of_first,
                );
                let both = futures_util::future::try_join(data_lanes.join(), header);
                runtime::block_on(stop.or_stopped(url, both))??;
                return Ok(());
            }
            let (first, carried) = as_uninit(&mut *with_header).split_at_mut(first_end as usize);
            let carried = jobs_of(carried, first_end, &self.header_parts);
            lanes::fetch_spawned(at, carried, version, self.others, None, |header_lanes| {
                let first_body = async {
                    body.fill(at, &mut first[k..]).await?;
                    body.end(at).await
                };
                let both = futures_util::future::try_join(first_body, header_lanes.join());
                runtime::block_on(stop.or_stopped(url, both))
            })???;
            let header = handed(at, &with_header[8..data_start as usize], data_len, header);
            let both = futures_util::future::try_join(data_lanes.join(), header);
            runtime::block_on(stop.or_stopped(url, both))??;
            Ok(())
        })?
    }
}

/// The header `json` of the object at `at`, parsed ([`parsed_aside`]) and handed to
/// `header`.
async fn handed(
    at: &Location,
    json: &[u8],
    data_len: u64,
    header: &mut (dyn FnMut((Header, HeaderCensus)) + Send),
) -> Result<()> {
    header(parsed_aside(at, json, data_len).await?);
    test_pause("TENSORFERRY_TEST_OBJECT_HANDED");
    Ok(())
}

/// The header `json` of the object at `at` parsed (as [`parse_counted`] does, its errors
/// naming the object) on a thread of its own, so that the GETs beside it go on arriving.
async fn parsed_aside(at: &Location, json: &[u8], data_len: u64) -> Result<(Header, HeaderCensus)> {
    let json = json.to_vec();
    match tokio::task::spawn_blocking(move || parse_counted(&json, data_len)).await {
        Ok(parsed) => parsed.map_err(|e| e.in_file(Path::new(at.url()))),
        Err(e) => Err(failed(
            "parse the header of",
            at.url(),
            Cause::Other,
            e.to_string(),
        )),
    }
}

/// The first GET of an object, of its bytes `0..len`: what the store says of the object
/// (its size and version), and its body, to come.
async fn first_answer(
    at: &Location,
    len: u64,
    pinned: Option<&Pinned>,
) -> Result<(ObjectMeta, Body)> {
    let etag = pinned.and_then(|p| p.etag.clone());
    let first = answer(at, Some(GetRange::Bounded(0..len)), etag).await?;
    let meta = first.meta.clone();
    check_pinned(at, &meta, pinned)?;
    let body = Body::of(0..len.min(meta.size), first.into_stream());
    Ok((meta, body))
}

/// Loads the tensors `names` names of one safetensors object: the header's GET (a second
/// one for a long header), then only their byte ranges, in parallel ranged GETs.
fn load_subset(at: &Location, options: &ObjectOptions, names: &HashSet<String>) -> Result<Loaded> {
    let in_object = |e: Error| e.in_file(Path::new(at.url()));
    let header = fetch_header(at, options)?;
    let parsed = parse_counted(&header.json, header.data_len).map_err(in_object)?;
    test_pause("TENSORFERRY_TEST_OBJECT_PAUSE");
    let wanted: Vec<Range<u64>> = (parsed.0.tensors.iter())
        .filter(|t| names.contains(&t.name))
        .map(|t| t.begin as u64..t.end as u64)
        .collect();
    let head_len = header.data_head.len();
    let ranges = plan::after(plan::merged(wanted, plan::MERGE_GAP), head_len as u64);
    let parts = plan::parts(&ranges, options.part_bytes as u64);
    let mut data = AlignedBuffer::zeroed_small_pages(header.data_len as usize)?;
    data.as_mut_slice()[..head_len].copy_from_slice(&header.data_head);
    let jobs = jobs_of(as_uninit(data.as_mut_slice()), header.data_start, &parts);
    lanes::fetch_all(at, jobs, &header.version, options.concurrency, None)?;
    build(parsed, Arc::new(Storage::owned(data)), 0).map_err(in_object)
}

/// `bytes` as memory that may be written but not read: what the GETs fill.
fn as_uninit(bytes: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: same address and length; `MaybeUninit<u8>` has the layout of `u8`, and the
    // only writes through the result are of initialised bytes, so `bytes` stays valid.
    unsafe { &mut *(bytes as *mut [u8] as *mut [MaybeUninit<u8>]) }
}

/// The `(range, into)` of each of `parts` (sorted and disjoint, counted from the object's
/// byte `data_start`): its bytes of the object and its slice of `data` (which begins at
/// `data_start`).
fn jobs_of<'a>(
    data: &'a mut [MaybeUninit<u8>],
    data_start: u64,
    parts: &[Range<u64>],
) -> Vec<(Range<u64>, &'a mut [MaybeUninit<u8>])> {
    let mut jobs = Vec::with_capacity(parts.len());
    let mut rest = data;
    let mut rest_at = 0u64;
    for part in parts {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((part.start - rest_at) as usize);
        let (slice, tail) = tail.split_at_mut((part.end - part.start) as usize);
        jobs.push((data_start + part.start..data_start + part.end, slice));
        rest = tail;
        rest_at = part.end;
    }
    jobs
}

/// For tests only: with the environment variable `var` set to `<path>`, creates
/// `<path>.ready` and waits (up to 30 s) for `<path>.go`, so that a test can act at that
/// point of a load deterministically. `TENSORFERRY_TEST_OBJECT_PAUSE`: a load that has
/// its header's length, before it reads the data (to replace the object, or stop the
/// server, between the two). `TENSORFERRY_TEST_OBJECT_HANDED`: a whole load that has
/// handed its tree over, while its data still arrives.
pub(super) fn test_pause(var: &str) {
    let Some(base) = std::env::var_os(var) else {
        return;
    };
    let base = std::path::PathBuf::from(base);
    let with = |suffix: &str| {
        let mut p = base.clone().into_os_string();
        p.push(suffix);
        std::path::PathBuf::from(p)
    };
    let _ = std::fs::write(with(".ready"), b"");
    let go = with(".go");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !go.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_refused_range_is_an_empty_object_not_a_duration_that_reads_416() {
        for (cause, text, empty) in [
            (
                Cause::NotFound,
                "GET http://h/x in 416.2ms - 404 Not Found",
                false,
            ),
            (
                Cause::Other,
                "GET http://h/x in 1.416s - 503 Service Unavailable",
                false,
            ),
            (
                Cause::Other,
                "non-2xx status code: 416 Range Not Satisfiable",
                true,
            ),
            (Cause::Other, "<Code>InvalidRange</Code>", true),
        ] {
            let e = failed("read", "http://h/x", cause, text);
            assert_eq!(is_empty_object(&e), empty, "{text}");
        }
    }
}
