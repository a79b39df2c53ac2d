//! Saving checkpoints to object storage.
//!
//! A file is one upload ([`super::upload`]): a single PUT when it fits one part, else a
//! multipart upload whose parts (the header, then the tensors' bytes: host memory sliced
//! without a copy, device memory through the staging ring) go up several at once. The
//! object appears whole when the upload completes; a failed upload is aborted, and the
//! previous object stays as it was.
//!
//! A sharded save uploads each shard under a name of its own for this save
//! (`stem-00001-of-00004.<save id>.safetensors`, which no earlier checkpoint names), then
//! the index naming them, last: the commit. Until then the previous checkpoint, index and
//! shards, is untouched and loads whole; after it, what the previous checkpoint held and
//! the new one does not is deleted (a single `stem.safetensors`, which readers would take
//! before an index, first).

use std::path::Path;

use object_store::PutPayload;

use super::failure::{cause_of, from_store, Cause};
use super::location::Location;
use super::options::ObjectOptions;
use super::runtime;
use super::upload::{put, upload};
use crate::error::{Error, Result};
use crate::io::checkpoint::commit::{saved_shard_name, stem_of};
use crate::io::checkpoint::index::{index_bytes, parse_index, INDEX_SUFFIX, MAX_INDEX_BYTES};
use crate::io::checkpoint::sharded::plan_save;
use crate::io::format::header_writer;
use crate::io::write::{header_and_tensors, SaveOptions};
use crate::tensor::Tensor;
use crate::transfer::staging::Ring;
use crate::tree::Node;

/// Saves `root` (checked by the caller as a local save checks it) to `url`: one object,
/// or with `max_shard_bytes` shards of at most that much tensor data and their index
/// (one object when it all fits). A URL ending in `/` means `url/model.safetensors`.
/// Tensors on a device stream through the staging ring `options` names into the parts
/// (with `Staging::Off`, they are copied to host memory first). Returns the objects written,
/// the index last.
pub fn save_url(
    root: &Node,
    url: &str,
    options: &SaveOptions,
    max_shard_bytes: Option<u64>,
) -> Result<Vec<String>> {
    let object_options = ObjectOptions::from_env();
    // Device tensors stream through this ring into the parts (none: copied to the host).
    let ring = options.staging.ring_for_stream();
    let at = Location::open(url, &object_options)?;
    let at = match at.is_folder() {
        true => at.sibling("model.safetensors"),
        false => at,
    };
    let paths = |node: &Node| node.tensors().into_iter().map(|(p, _)| p).collect();
    let Some(max) = max_shard_bytes else {
        let walked = header_writer::walk_node(root);
        let (header, tensors) = header_and_tensors(walked, || paths(root), options)?;
        return save_single(&at, header, &tensors, ring, &object_options);
    };
    let walked = header_writer::walk_node_recorded(root);
    let mut shard_options = options.clone();
    let Some(plan) = plan_save(&walked, || paths(root), &mut shard_options, max)? else {
        let (header, tensors) = header_and_tensors(walked, || paths(root), &shard_options)?;
        return save_single(&at, header, &tensors, ring, &object_options);
    };
    let stem = stem_of(at.name());
    let count = plan.shards.len();
    let mut files: Vec<String> = Vec::with_capacity(count);
    let mut names = Vec::with_capacity(count);
    for (i, (shard, shard_names)) in plan.shards.into_iter().enumerate() {
        files.push(saved_shard_name(stem, i + 1, count, &plan.id));
        names.push(shard_names);
        let (header, tensors) = header_and_tensors(
            header_writer::walk_node(&shard),
            || paths(&shard),
            &shard_options,
        )?;
        let uploaded = upload(
            &at.sibling(&files[i]),
            header,
            &tensors,
            ring,
            &object_options,
        );
        if let Err(e) = uploaded {
            // Shards of this save that no index names: gone, as far as the store lets us.
            for file in &files[..i] {
                let _ = delete(&at.sibling(file));
            }
            return Err(e);
        }
    }
    let text = index_bytes(&plan.metadata, &files, &names);
    let index = at.sibling(&format!("{stem}{INDEX_SUFFIX}"));
    let previous = previous_shards(&index)?;
    put(&index, PutPayload::from(text))?;
    // Committed. A single object of that name would be read before the index: it goes
    // first, then the previous checkpoint's shards.
    delete(&at)?;
    let mut written: Vec<String> = Vec::with_capacity(count + 1);
    for file in &files {
        written.push(at.sibling(file).url().to_string());
    }
    for old in previous {
        if !files.contains(&old) {
            delete(&at.sibling(&old))?;
        }
    }
    written.push(index.url().to_string());
    Ok(written)
}

/// Uploads one object, then removes a sharded checkpoint of the same name (which the
/// object now stands before).
fn save_single(
    at: &Location,
    header: Vec<u8>,
    tensors: &[Tensor],
    ring: Option<Ring>,
    options: &ObjectOptions,
) -> Result<Vec<String>> {
    upload(at, header, tensors, ring, options)?;
    let index = at.sibling(&format!("{}{INDEX_SUFFIX}", stem_of(at.name())));
    let previous = previous_shards(&index)?;
    if !previous.is_empty() {
        delete(&index)?;
        for old in previous {
            delete(&at.sibling(&old))?;
        }
    }
    Ok(vec![at.url().to_string()])
}

/// The shard names of the index at `index`; none when there is no index.
fn previous_shards(index: &Location) -> Result<Vec<String>> {
    // The whole object, unranged: an empty one is not a range refused (416).
    match super::load::get(index, None, None, MAX_INDEX_BYTES) {
        Ok((bytes, _)) => {
            // An index we cannot read names nothing we may delete.
            let Ok(parsed) = parse_index(&bytes, Path::new(index.url())) else {
                return Ok(Vec::new());
            };
            Ok(parsed.files().map(String::from).collect())
        }
        // Larger than any index may be: not one.
        Err(Error::Format { .. }) => Ok(Vec::new()),
        Err(e) => match cause_of(&e) {
            Some(Cause::NotFound) => Ok(Vec::new()),
            _ => Err(e),
        },
    }
}

/// Writes `bytes` as the object at `url` in one PUT: the object appears whole, or stays
/// as it was (for small files a caller commits with, such as a checkpoint's metadata).
pub fn put_url(url: &str, bytes: Vec<u8>, options: &ObjectOptions) -> Result<()> {
    put(&Location::open(url, options)?, PutPayload::from(bytes))
}

/// Deletes the object at `url`; an object already absent is no error.
pub fn delete_url(url: &str, options: &ObjectOptions) -> Result<()> {
    delete(&Location::open(url, options)?)
}

/// Deletes the object at `at`; an object already absent is no error.
fn delete(at: &Location) -> Result<()> {
    use object_store::ObjectStoreExt;
    match runtime::block_on(at.store().delete(at.key()))? {
        Ok(()) => Ok(()),
        Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(from_store("delete", at.url(), e)),
    }
}
