//! The fast reader of the headers every writer emits, in two passes over borrowed text.
//!
//! The first pass ([`count`]) checks the text against the regular form of a header
//! (entries of exactly `dtype`, `shape` and `data_offsets`, in any order; a
//! `__metadata__` object of strings; [`super::scan`]'s subset of JSON) and takes the same
//! census as [`super::census`] without allocating; the budget is checked on it; the
//! second pass ([`build`]) allocates exactly what was counted. A header outside the
//! regular form, or a semantic fault such as an unknown dtype, makes either pass say
//! `None`: [`super::header`] then reads it with `serde_json`, which words every error.

use std::collections::BTreeMap;

use super::census::HeaderCensus;
use super::header::TensorEntry;
use super::scan::Cursor;
use super::{fast_tree, TREE_METADATA_KEY};
use crate::dtype::DType;

/// A header read: its entries in order, its metadata, and the census taken on the way.
pub(crate) type Built = (Vec<TensorEntry>, BTreeMap<String, String>, HeaderCensus);

/// What the first pass found: the census, and the tree record unescaped, if any.
pub(crate) struct Counted {
    pub(crate) census: HeaderCensus,
    tree_text: Option<String>,
}

/// The keys of an entry.
#[derive(Clone, Copy)]
enum Field {
    DType,
    Shape,
    Offsets,
}

/// The fields of one entry, as read.
struct Fields {
    dtype: DType,
    begin: usize,
    end: usize,
}

/// Counts what the regular header `text` describes; `None` when it is not regular.
pub(crate) fn count(text: &str) -> Option<Counted> {
    let mut census = HeaderCensus {
        header_bytes: text.len() as u64,
        ..HeaderCensus::default()
    };
    let mut tree_text = None;
    let mut c = Cursor::new(text);
    let mut seen_metadata = false;
    walk_top(&mut c, |c, key| {
        census.saw_string(key.len());
        if key == "__metadata__" {
            if std::mem::replace(&mut seen_metadata, true) {
                return None;
            }
            return count_metadata(c, &mut census, &mut tree_text);
        }
        census.entries += 1;
        census.name_bytes += key.len() as u64;
        let ndim = skim_entry(c)?;
        // The census measures the field names and the dtype code too: at most 12 bytes.
        census.saw_string(12);
        census.dims += ndim;
        census.max_ndim = census.max_ndim.max(ndim);
        Some(())
    })?;
    c.finish()?;
    census.tree = tree_text.as_deref().map(fast_tree::census);
    Some(Counted { census, tree_text })
}

/// Builds the entries and the metadata of the header `text` that [`count`] counted.
pub(crate) fn build(text: &str, counted: Counted) -> Option<Built> {
    let mut entries = Vec::with_capacity(usize::try_from(counted.census.entries).ok()?);
    let mut metadata = BTreeMap::new();
    let mut tree_text = counted.tree_text;
    let mut c = Cursor::new(text);
    walk_top(&mut c, |c, key| {
        if key == "__metadata__" {
            return build_metadata(c, &mut metadata, &mut tree_text);
        }
        // Up to eight dims are gathered on the stack; a longer shape is read again into a
        // vector of its exact length.
        let start = *c;
        let (mut small, mut ndim) = ([0usize; 8], 0usize);
        let fields = entry(c, |d| {
            if let Some(slot) = small.get_mut(ndim) {
                *slot = d;
            }
            ndim += 1;
        })?;
        let shape = match small.get(..ndim) {
            Some(dims) => dims.to_vec(),
            None => {
                let mut shape = Vec::with_capacity(ndim);
                entry(&mut { start }, |d| shape.push(d))?;
                shape
            }
        };
        // Packed floats: the header counts values, the tensor elements.
        let shape = fields.dtype.tensor_shape(shape)?;
        entries.push(TensorEntry {
            name: key.to_string(),
            dtype: fields.dtype,
            shape,
            begin: fields.begin,
            end: fields.end,
        });
        Some(())
    })?;
    Some((entries, metadata, counted.census))
}

/// Calls `each` with every key of the top-level object, the cursor at its value.
fn walk_top<'a>(
    c: &mut Cursor<'a>,
    mut each: impl FnMut(&mut Cursor<'a>, &'a str) -> Option<()>,
) -> Option<()> {
    c.eat(b'{')?;
    if c.eat_if(b'}') {
        return Some(());
    }
    loop {
        let key = c.plain_str()?;
        c.eat(b':')?;
        each(c, key)?;
        if !c.more(b'}')? {
            return Some(());
        }
    }
}

/// Skips one entry object, counting the dimensions of its shape: [`entry`]'s tokens
/// without their values. A text it skims but [`entry`] refuses (an unknown dtype, a field
/// twice, a number out of range, sizes that disagree) fails [`build`], and the slow
/// reader then counts and words it: the counts matter only for texts that build.
fn skim_entry(c: &mut Cursor<'_>) -> Option<u64> {
    c.eat(b'{')?;
    let mut ndim = 0u64;
    loop {
        if c.eat_key("dtype") {
            c.eat(b':')?;
            c.plain_str()?;
        } else if c.eat_key("shape") {
            c.eat(b':')?;
            c.eat(b'[')?;
            if !c.eat_if(b']') {
                loop {
                    c.digits()?;
                    ndim += 1;
                    if !c.more(b']')? {
                        break;
                    }
                }
            }
        } else if c.eat_key("data_offsets") {
            c.eat(b':')?;
            c.eat(b'[')?;
            c.digits()?;
            c.eat(b',')?;
            c.digits()?;
            c.eat(b']')?;
        } else {
            return None;
        }
        if !c.more(b'}')? {
            return Some(ndim);
        }
    }
}

/// One entry object; each dimension of its shape goes to `dim`. `None` also for an entry
/// whose dtype is unknown or whose shape does not match its offsets (the slow reader
/// words those).
fn entry(c: &mut Cursor<'_>, mut dim: impl FnMut(usize)) -> Option<Fields> {
    c.eat(b'{')?;
    let (mut dtype, mut offsets, mut shape_bytes) = (None, None, None);
    loop {
        // The three keys are compared whole; any other key ends the fast read.
        let key = if c.eat_key("dtype") {
            Field::DType
        } else if c.eat_key("shape") {
            Field::Shape
        } else if c.eat_key("data_offsets") {
            Field::Offsets
        } else {
            return None;
        };
        match key {
            Field::DType if dtype.is_none() => {
                c.eat(b':')?;
                dtype = Some(DType::from_safetensors_code(c.plain_str()?)?);
            }
            Field::Shape if shape_bytes.is_none() => {
                c.eat(b':')?;
                c.eat(b'[')?;
                let mut numel = 1usize;
                if !c.eat_if(b']') {
                    loop {
                        let d = c.usize()?;
                        numel = numel.checked_mul(d)?;
                        dim(d);
                        if !c.more(b']')? {
                            break;
                        }
                    }
                }
                shape_bytes = Some(numel);
            }
            Field::Offsets if offsets.is_none() => {
                c.eat(b':')?;
                c.eat(b'[')?;
                let begin = c.usize()?;
                c.eat(b',')?;
                let end = c.usize()?;
                c.eat(b']')?;
                offsets = Some((begin, end));
            }
            _ => return None,
        }
        if !c.more(b'}')? {
            break;
        }
    }
    let (dtype, (begin, end), numel) = (dtype?, offsets?, shape_bytes?);
    // Packed floats: `numel` counts values, [`DType::lanes`] to an element.
    let lanes = dtype.lanes();
    let nbytes = (numel % lanes == 0).then(|| (numel / lanes).checked_mul(dtype.size()))??;
    (begin <= end && end - begin == nbytes).then_some(Fields { dtype, begin, end })
}

/// Counts the `__metadata__` object; its tree record, if any, is unescaped into `tree`.
fn count_metadata(
    c: &mut Cursor<'_>,
    census: &mut HeaderCensus,
    tree: &mut Option<String>,
) -> Option<()> {
    walk_top(c, |c, key| {
        census.saw_string(key.len());
        census.metadata_pairs += 1;
        census.metadata_bytes += key.len() as u64;
        let len = { *c }.unescaped_len()?;
        census.saw_string(len);
        census.metadata_bytes += len as u64;
        if key == TREE_METADATA_KEY {
            if tree.is_some() {
                return None;
            }
            let mut text = String::with_capacity(len);
            c.unescaped_into(&mut text)?;
            *tree = Some(text);
        } else {
            c.unescaped_len()?;
        }
        Some(())
    })
}

/// Builds the `__metadata__` map; the tree record is taken from `tree`, already unescaped.
fn build_metadata(
    c: &mut Cursor<'_>,
    metadata: &mut BTreeMap<String, String>,
    tree: &mut Option<String>,
) -> Option<()> {
    walk_top(c, |c, key| {
        let value = if key == TREE_METADATA_KEY {
            c.unescaped_len()?;
            tree.take()?
        } else {
            let mut value = String::with_capacity({ *c }.unescaped_len()?);
            c.unescaped_into(&mut value)?;
            value
        };
        metadata.insert(key.to_string(), value);
        Some(())
    })
}

#[cfg(test)]
mod tests {
    use super::super::header::parse_slow;
    use super::*;

    /// Where the fast reader reads a header, it reads what the `serde_json` one reads.
    fn agrees_with_serde(text: &str) {
        let Some(built) = count(text).and_then(|counted| build(text, counted)) else {
            return;
        };
        let (entries, metadata, c) = built;
        let (slow_entries, slow_metadata, s) = parse_slow(text, 1 << 40)
            .unwrap_or_else(|e| panic!("fast read what serde refuses ({e}): {text}"));
        assert_eq!(entries, slow_entries, "{text}");
        assert_eq!(metadata, slow_metadata, "{text}");
        let numbers = |c: &HeaderCensus| {
            [
                c.header_bytes,
                c.entries,
                c.dims,
                c.max_ndim,
                c.name_bytes,
                c.metadata_pairs,
                c.metadata_bytes,
                c.longest_string,
            ]
        };
        assert_eq!(numbers(&c), numbers(&s), "{text}");
        match (&c.tree, &s.tree) {
            (None, None) | (Some(Err(_)), Some(Err(_))) => {}
            (Some(Ok(f)), Some(Ok(s))) => {
                let counts = |t: &super::super::tree_census::TreeCensus| {
                    (
                        [t.dicts, t.dict_entries, t.sequences, t.items],
                        [t.string_bytes, t.longest_string],
                        t.lengths.clone(),
                    )
                };
                assert_eq!(counts(f), counts(s), "{text}");
            }
            (f, s) => panic!("tree census differs: {f:?} vs {s:?}: {text}"),
        }
    }

    const WRITTEN: &str = r#"{"__metadata__":{"k":"v\"w","tensorferry":"{\"format\":1,\"tree\":{\"dict\":[[\"a\",{\"tensor\":\"a\"}],[\"b\",{\"list\":[{\"int\":-3},{\"none\":null},{\"bool\":false},{\"str\":\"s\"}]}],[\"c\",{\"tensor\":\"c\"}]]}}"},"a":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]},"c":{"shape":[],"data_offsets":[8,9],"dtype":"U8"}}   "#;

    #[test]
    fn a_written_header_is_read_fast_and_as_serde_reads_it() {
        assert!(count(WRITTEN).and_then(|c| build(WRITTEN, c)).is_some());
        agrees_with_serde(WRITTEN);
        let tree = count(WRITTEN).unwrap().census.tree.unwrap().unwrap();
        assert!(tree.fast);
    }

    #[test]
    fn every_one_byte_change_is_read_as_serde_reads_it_or_left_to_serde() {
        let bytes = WRITTEN.as_bytes();
        for at in 0..bytes.len() {
            for b in *b"\"{}[],:019-eE. tx" {
                let mut changed = bytes.to_vec();
                changed[at] = b;
                if let Ok(text) = std::str::from_utf8(&changed) {
                    agrees_with_serde(text);
                }
            }
            agrees_with_serde(&WRITTEN[..at]);
        }
    }

    #[test]
    fn the_fuzz_corpus_is_read_as_serde_reads_it_or_left_to_serde() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for folder in ["../../fuzz/corpus/read_safetensors", "tests/corpus"] {
            for file in std::fs::read_dir(dir.join(folder)).unwrap() {
                let bytes = std::fs::read(file.unwrap().path()).unwrap();
                let end = bytes.get(..8).map_or(0, |p| {
                    u64::from_le_bytes(p.try_into().unwrap()).min(bytes.len() as u64 - 8) as usize
                });
                if let Some(Ok(text)) = bytes.get(8..8 + end).map(std::str::from_utf8) {
                    agrees_with_serde(text);
                }
            }
        }
    }
}
