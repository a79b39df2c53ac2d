//! The safetensors header reader: reading and validating a header, trusting nothing in it.
//!
//! Two passes over the borrowed text, with one tokenizer ([`super::scan`]). The first
//! ([`count`]) checks the JSON and counts what the header describes (tensors, dimensions,
//! metadata, the recorded tree through [`super::tree_census`]) without building any of
//! it; [`super::budget`] refuses the header if loading it would take too much memory; the
//! second pass ([`build`]) allocates exactly what was counted. Faults are worded as
//! `serde_json` words them, with their line and column; syntax comes first, then the
//! budget, then the first entry at fault.

use std::collections::BTreeMap;

use super::budget;
use super::header::{Header, HeaderCensus, TensorEntry};
use super::scan::{Cursor, Fault, Scan, Stop};
use super::tree_census;
use super::tree_meta::shorten;
use super::tree_meta::TREE_METADATA_KEY;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::checked_nbytes;

/// Largest header accepted, in bytes (as the official implementation).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The largest dimension a header may give: int64's largest, as NumPy, PyTorch and every
/// other framework hold shapes (an empty tensor may have any other dimension).
const MAX_DIM: usize = i64::MAX as usize;

/// Validates the first 8 bytes and returns the header length; `file_len` bounds it.
pub(crate) fn header_len(prefix: &[u8], file_len: u64) -> Result<u64> {
    if file_len < 8 || prefix.len() < 8 {
        return Err(Error::format_at(
            0,
            format!("file is {file_len} bytes, shorter than the 8-byte header length"),
        ));
    }
    let n = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
    if let Some(kind) = (n > MAX_HEADER_BYTES || n > file_len - 8)
        .then(|| other_format(prefix))
        .flatten()
    {
        return Err(Error::format_at(
            0,
            format!("not a safetensors file: {kind}"),
        ));
    }
    if n > MAX_HEADER_BYTES {
        return Err(Error::format_at(
            0,
            format!("header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes"),
        ));
    }
    if n > file_len - 8 {
        return Err(Error::format_at(
            0,
            format!("header length {n} runs past the end of the file ({file_len} bytes)"),
        ));
    }
    if n < 2 {
        return Err(Error::format_at(
            8,
            format!("header of {n} bytes cannot hold a JSON object"),
        ));
    }
    Ok(n)
}

/// What a file that is not safetensors looks like from its first bytes, when it starts
/// like a format people confuse with it.
fn other_format(prefix: &[u8]) -> Option<&'static str> {
    let starts = |magic: &[u8]| prefix.starts_with(magic);
    Some(if starts(b"PK\x03\x04") {
        "it starts like a zip archive, as torch.save writes (load it with \
         torch.load(path, weights_only=True), then save it with tensorferry)"
    } else if prefix.len() >= 2 && prefix[0] == 0x80 && (2..=5).contains(&prefix[1]) {
        "it starts like a Python pickle (an old torch.save file?): tensorferry never \
         unpickles"
    } else if starts(b"\x89HDF") {
        "it starts like an HDF5 file (Keras .h5?)"
    } else if starts(b"\x93NUMPY") {
        "it starts like a NumPy .npy file"
    } else if starts(b"GGUF") {
        "it starts like a GGUF file"
    } else if prefix[..8]
        .iter()
        .all(|&b| b.is_ascii_graphic() || b.is_ascii_whitespace())
    {
        "it starts like text (a safetensors file starts with its header's length, 8 \
         bytes little-endian)"
    } else {
        return None;
    })
}

/// Parses and validates `header` (the JSON bytes) of a file whose data section holds
/// `data_len` bytes: every tensor must fit exactly, with no gap, overlap or trailing byte,
/// and loading the file must not take more memory than four times its size plus 4 MiB.
pub fn parse_header(header: &[u8], data_len: u64) -> Result<Header> {
    parse_counted(header, data_len).map(|(header, _)| header)
}

/// [`parse_header`], also returning the census taken on the way (it carries the counts of
/// the recorded tree, which a load needs).
pub(crate) fn parse_counted(header: &[u8], data_len: u64) -> Result<(Header, HeaderCensus)> {
    let data_start = 8 + header.len() as u64;
    let text = std::str::from_utf8(header)
        .map_err(|e| Error::format_at(8 + e.valid_up_to() as u64, "header is not valid UTF-8"))?;
    let (census, tree_text) = count(text, true).map_err(|f| not_json(&f.describe(text)))?;
    budget::check(&census, data_len)?;
    let (entries, metadata) =
        build(text, census.entries, tree_text, true).map_err(|stop| match stop {
            Stop::Json(f) => not_json(&f.describe(text)),
            Stop::Other(e) => e,
        })?;
    if let Some(name) = first_duplicate(&entries) {
        return Err(Error::format_in(
            &shorten(name),
            "name appears twice in the header",
        ));
    }
    check_coverage(&entries, data_start, data_len)?;
    let header = Header {
        tensors: entries,
        metadata,
        data_start,
    };
    Ok((header, census))
}

/// The census of the header `text` (for debug builds to check the writer's own).
#[cfg(debug_assertions)]
pub(crate) fn census_of(text: &str) -> Result<HeaderCensus> {
    count(text, true)
        .map(|(census, _)| census)
        .map_err(|f| not_json(&f.describe(text)))
}

/// The fault of a header that is not the JSON object of a safetensors header.
fn not_json(why: &str) -> Error {
    Error::format_at(
        8,
        format!("header is not a valid safetensors JSON object: {why}"),
    )
}

/// Checks the JSON of the header `text` and counts what it describes, and unescapes the
/// tree record if `__metadata__` holds one. Only the JSON's syntax and a top level that
/// is not an object are faults here: a value of the wrong type is counted as it comes
/// and left to [`build`], which words it. With `skim`, entries in the form writers write
/// are skimmed by [`skim_entry`] (tests compare it with the general reader alone).
#[inline]
fn count(text: &str, skim: bool) -> Scan<(HeaderCensus, Option<String>)> {
    let mut census = HeaderCensus {
        header_bytes: text.len() as u64,
        ..HeaderCensus::default()
    };
    let mut tree_text = None;
    let mut c = Cursor::new(text);
    c.object("a JSON object", |c, key| {
        census.saw_string(key.len());
        if key == "__metadata__" {
            return count_metadata(c, &mut census, &mut tree_text);
        }
        census.entries += 1;
        census.name_bytes += key.len() as u64;
        // Most entries are in the form every writer writes: skimmed in one tight loop.
        // Anything else is counted again from the entry's start by the general reader,
        // which also words its faults.
        let start = *c;
        if !skim || skim_entry(c, &mut census).is_none() {
            *c = start;
            count_entry(c, &mut census)?;
        }
        Ok(())
    })?;
    c.finish()?;
    census.tree = tree_text.as_deref().map(tree_census::count);
    Ok((census, tree_text))
}

/// Counts an entry in the form writers write, as [`count_entry`] counts it: an object of
/// the keys `dtype` (a string without escapes), `shape` (an array of plain integers) and
/// `data_offsets` (two plain integers), in any order. `None`, with `census` untouched,
/// for anything else, valid JSON or not: the caller then reads the entry again with
/// [`count_entry`], whose counts and faults are the ones that hold. Only valid JSON is
/// skimmed, so what it accepts [`count_entry`] accepts alike and counts the same.
#[inline]
fn skim_entry(c: &mut Cursor<'_>, census: &mut HeaderCensus) -> Option<()> {
    if c.peek() != Some(b'{') || c.open(b'{').ok()? {
        return None;
    }
    // Counted per shape, as [`count_entry`] counts them (a shape twice counts twice).
    let (mut dims, mut max_ndim, mut longest) = (0u64, 0u64, 0usize);
    loop {
        if c.eat_key("dtype") {
            longest = longest.max("dtype".len()).max(c.plain_str()?.len());
        } else if c.eat_key("shape") {
            longest = longest.max("shape".len());
            c.eat(b'[').ok()?;
            let mut ndim = 0u64;
            if !c.eat_if(b']') {
                loop {
                    c.plain_usize()?;
                    ndim += 1;
                    if !c.more(b']').ok()? {
                        break;
                    }
                }
            }
            dims += ndim;
            max_ndim = max_ndim.max(ndim);
        } else if c.eat_key("data_offsets") {
            longest = longest.max("data_offsets".len());
            c.eat(b'[').ok()?;
            c.plain_usize()?;
            c.eat(b',').ok()?;
            c.plain_usize()?;
            c.eat(b']').ok()?;
        } else {
            return None;
        }
        if !c.more(b'}').ok()? {
            break;
        }
    }
    census.saw_string(longest);
    census.dims += dims;
    census.max_ndim = census.max_ndim.max(max_ndim);
    Some(())
}

/// Counts an entry's strings and the dimensions of its shape (its values skipped).
fn count_entry(c: &mut Cursor<'_>, census: &mut HeaderCensus) -> Scan<()> {
    let value =
        |c: &mut Cursor<'_>, census: &mut HeaderCensus, field: Field| match (field, c.peek()) {
            (Field::DType, Some(b'"')) => c.str_len().map(|len| census.saw_string(len)),
            (Field::Shape, Some(b'[')) => {
                let ndim = u64::from(c.array("", |c| c.skip_value(3))?);
                census.dims += ndim;
                census.max_ndim = census.max_ndim.max(ndim);
                Ok(())
            }
            _ => c.skip_value(2),
        };
    match c.peek() {
        Some(b'{') => entry_fields(c, |c, key_len, field| {
            census.saw_string(key_len);
            value(c, census, field)
        }),
        Some(b'[') => {
            let mut i = 0;
            c.array("", |c| {
                i += 1;
                let field = [Field::DType, Field::Shape].get(i - 1).copied();
                value(c, census, field.unwrap_or(Field::Other))
            })
            .map(drop)
        }
        Some(b'"') => c.str_len().map(|len| census.saw_string(len)),
        _ => c.skip_value(1),
    }
}

/// Counts the `__metadata__` object (any other value is skipped, and refused by
/// [`build`]); its tree record, if any, is unescaped into `tree`.
fn count_metadata(
    c: &mut Cursor<'_>,
    census: &mut HeaderCensus,
    tree: &mut Option<String>,
) -> Scan<()> {
    if c.peek() != Some(b'{') {
        return c.skip_value(1);
    }
    c.object("", |c, key| {
        census.saw_string(key.len());
        census.metadata_pairs += 1;
        census.metadata_bytes += key.len() as u64;
        if c.peek() != Some(b'"') {
            return c.skip_value(2);
        }
        let len = { *c }.str_len()?;
        census.saw_string(len);
        census.metadata_bytes += len as u64;
        if key == TREE_METADATA_KEY {
            let mut text = String::with_capacity(len);
            c.str_into(&mut text)?;
            *tree = Some(text);
        } else {
            c.str_len()?;
        }
        Ok(())
    })
}

/// Builds the entries (room for `entries`) and the metadata of the header `text` that
/// [`count`] checked; `tree_text` is the record it unescaped. The first entry at fault
/// (a value of the wrong type, an unknown dtype, a shape that disagrees with its bytes)
/// is the error. With `plain`, entries in the form writers write are read by
/// [`plain_entry`] (tests compare it with the general reader alone).
#[inline]
fn build(
    text: &str,
    entries: u64,
    mut tree_text: Option<String>,
    plain: bool,
) -> std::result::Result<(Vec<TensorEntry>, BTreeMap<String, String>), Stop> {
    let mut tensors = Vec::with_capacity(usize::try_from(entries).unwrap_or(0));
    let mut metadata = BTreeMap::new();
    let mut seen_metadata = false;
    let mut dims = Vec::new();
    let mut c = Cursor::new(text);
    c.object("a JSON object", |c, key| {
        if key == "__metadata__" {
            metadata_into(c, &mut metadata, &mut tree_text).map_err(|f| {
                let why = format!("__metadata__ must map strings to strings: {}", f.what());
                Fault::new(f.at(), why)
            })?;
            if std::mem::replace(&mut seen_metadata, true) {
                let twice = Error::format_in(&key, "name appears twice in the header");
                return Err(Stop::Other(twice));
            }
            return Ok(());
        }
        // Most entries are in the form writers write, and sound: read in one tight loop,
        // their dims gathered on the stack. Any other is read again from its start by the
        // general reader, which words it.
        let start = *c;
        let mut small = [0usize; 8];
        if let Some((dtype, ndim, begin, end)) = plain.then(|| plain_entry(c, &mut small)).flatten()
        {
            tensors.push(TensorEntry {
                name: key.into_owned(),
                dtype,
                shape: small[..ndim].to_vec(),
                begin,
                end,
            });
            return Ok(());
        }
        *c = start;
        // The dims grow in one vector kept for every entry (the longest shape's growth);
        // each entry takes a copy of its exact length.
        dims.clear();
        let fields = entry(c, |d| dims.push(d))
            .map_err(|f| Fault::new(f.at(), format!("tensor {:?}: {}", shorten(&key), f.what())))?;
        tensors.push(validate_entry(
            &key,
            fields.dtype,
            dims.to_vec(),
            fields.begin,
            fields.end,
        )?);
        Ok(())
    })?;
    Ok((tensors, metadata))
}

/// The `__metadata__` map into `metadata`; the tree record is taken from `tree`, already
/// unescaped.
fn metadata_into(
    c: &mut Cursor<'_>,
    metadata: &mut BTreeMap<String, String>,
    tree: &mut Option<String>,
) -> Scan<()> {
    c.object("a map", |c, key| {
        if c.peek() != Some(b'"') {
            return Err(c.wrong_type("a string"));
        }
        let value = if key == TREE_METADATA_KEY {
            c.str_len()?;
            match tree.clone() {
                Some(text) => text,
                None => return Err(c.fault("the tree record changed while read")),
            }
        } else {
            let mut value = String::with_capacity({ *c }.str_len()?);
            c.str_into(&mut value)?;
            value
        };
        metadata.insert(key.into_owned(), value);
        Ok(())
    })
}

/// The fields of one entry, as read.
struct Fields {
    /// The dtype, or its code shortened when unknown.
    dtype: std::result::Result<DType, String>,
    begin: usize,
    end: usize,
}

/// The keys of an entry.
#[derive(Clone, Copy, PartialEq)]
enum Field {
    DType,
    Shape,
    Offsets,
    Other,
}

/// Calls `each` with every field of the entry object at the cursor (its key's length,
/// and the field it names), the cursor at its value; the keys writers write are compared
/// whole.
fn entry_fields(
    c: &mut Cursor<'_>,
    mut each: impl FnMut(&mut Cursor<'_>, usize, Field) -> Scan<()>,
) -> Scan<()> {
    if c.peek() != Some(b'{') {
        return Err(c.wrong_type("struct RawEntry"));
    }
    if c.open(b'{')? {
        return Ok(());
    }
    loop {
        let field = if c.eat_key("dtype") {
            Field::DType
        } else if c.eat_key("shape") {
            Field::Shape
        } else if c.eat_key("data_offsets") {
            Field::Offsets
        } else {
            let key = c.key()?;
            let field = Field::of(&key);
            each(c, key.len(), field)?;
            if !c.more(b'}')? {
                return Ok(());
            }
            continue;
        };
        each(c, field.name().len(), field)?;
        if !c.more(b'}')? {
            return Ok(());
        }
    }
}

impl Field {
    /// The field a key names.
    fn of(key: &str) -> Field {
        match key {
            "dtype" => Field::DType,
            "shape" => Field::Shape,
            "data_offsets" => Field::Offsets,
            _ => Field::Other,
        }
    }

    /// The name of the field, as a fault about it gives it.
    fn name(self) -> &'static str {
        match self {
            Field::DType => "dtype",
            Field::Shape => "shape",
            Field::Offsets => "data_offsets",
            Field::Other => "",
        }
    }
}

/// One entry at the cursor, `{"dtype": …, "shape": […], "data_offsets": [b, e]}` (fields
/// in any order, others skipped) or `[dtype, shape, data_offsets]`; each dimension of its
/// shape goes to `dim`. Every fault of type or
/// structure is a [`Fault`]; whether the fields agree is for [`validate_entry`].
fn entry(c: &mut Cursor<'_>, mut dim: impl FnMut(usize)) -> Scan<Fields> {
    const ORDER: [Field; 3] = [Field::DType, Field::Shape, Field::Offsets];
    let mut fields = Fields {
        dtype: Err(String::new()),
        begin: 0,
        end: 0,
    };
    let mut seen = [false; 3];
    let mut read = |c: &mut Cursor<'_>, field: Field| -> Scan<()> {
        let Some(i) = ORDER.iter().position(|&f| f == field) else {
            return c.skip_value(2);
        };
        if std::mem::replace(&mut seen[i], true) {
            return Err(c.fault(format!("duplicate field `{}`", field.name())));
        }
        match field {
            Field::DType => {
                if c.peek() != Some(b'"') {
                    return Err(c.wrong_type("a dtype code"));
                }
                let code = c.str()?;
                fields.dtype = DType::from_safetensors_code(&code).ok_or_else(|| shorten(&code));
            }
            Field::Shape => {
                c.array("a sequence", |c| {
                    dim(c.usize("usize")?);
                    Ok::<(), Fault>(())
                })?;
            }
            _ => (fields.begin, fields.end) = offsets(c)?,
        }
        Ok(())
    };
    const WANT: &str = "struct RawEntry with 3 elements";
    if c.peek() == Some(b'[') {
        let mut i = 0;
        c.array(WANT, |c| {
            let &field = ORDER
                .get(i)
                .ok_or_else(|| c.fault(format!("invalid length {}, expected {WANT}", i + 1)))?;
            i += 1;
            read(c, field)
        })?;
    } else {
        entry_fields(c, |c, _, field| read(c, field))?;
    }
    if let Some(i) = seen.iter().position(|s| !s) {
        return Err(c.fault(format!("missing field `{}`", ORDER[i].name())));
    }
    Ok(fields)
}

/// An entry in the form writers write (as [`skim_entry`] skims it, each field once, at
/// most eight dims, plain integers that fit) whose fields agree: a known dtype of one
/// value an element, whose shape's bytes are the span of the offsets. Its dims go to
/// `dims`; the result is its dtype, number of dims and offsets. `None` for any other
/// entry: [`entry`] then reads it, which for a sound entry reads the same.
#[inline]
fn plain_entry(c: &mut Cursor<'_>, dims: &mut [usize; 8]) -> Option<(DType, usize, usize, usize)> {
    if c.peek() != Some(b'{') || c.open(b'{').ok()? {
        return None;
    }
    let (mut dtype, mut shape, mut offsets) = (None, None, None);
    loop {
        if c.eat_key("dtype") {
            if dtype.is_some() {
                return None;
            }
            dtype = Some(DType::from_safetensors_code(c.plain_str()?)?);
        } else if c.eat_key("shape") {
            if shape.is_some() {
                return None;
            }
            c.eat(b'[').ok()?;
            let (mut ndim, mut numel) = (0usize, 1usize);
            if !c.eat_if(b']') {
                loop {
                    // A dimension beyond int64 takes the slow path, which names it.
                    let d = c.plain_usize().filter(|&d| d <= MAX_DIM)?;
                    *dims.get_mut(ndim)? = d;
                    ndim += 1;
                    numel = numel.checked_mul(d)?;
                    if !c.more(b']').ok()? {
                        break;
                    }
                }
            }
            shape = Some((ndim, numel));
        } else if c.eat_key("data_offsets") {
            if offsets.is_some() {
                return None;
            }
            c.eat(b'[').ok()?;
            let begin = c.plain_usize()?;
            c.eat(b',').ok()?;
            let end = c.plain_usize()?;
            c.eat(b']').ok()?;
            offsets = Some((begin, end));
        } else {
            return None;
        }
        if !c.more(b'}').ok()? {
            break;
        }
    }
    let (dtype, (ndim, numel), (begin, end)) = (dtype?, shape?, offsets?);
    let agree =
        dtype.lanes() == 1 && begin <= end && numel.checked_mul(dtype.size()) == Some(end - begin);
    agree.then_some((dtype, ndim, begin, end))
}

/// The `data_offsets` pair at the cursor.
fn offsets(c: &mut Cursor<'_>) -> Scan<(usize, usize)> {
    const WANT: &str = "a tuple of size 2";
    let length = |c: &Cursor<'_>, n: usize| c.fault(format!("invalid length {n}, expected {WANT}"));
    if c.peek() != Some(b'[') {
        return Err(c.wrong_type(WANT));
    }
    if c.open(b'[')? {
        return Err(length(c, 0));
    }
    let begin = c.usize("usize")?;
    if !c.more(b']')? {
        return Err(length(c, 1));
    }
    let end = c.usize("usize")?;
    if c.more(b']')? {
        return Err(length(c, 3));
    }
    Ok((begin, end))
}

/// A name two entries share, if any, the first one met again. The names go into a set
/// whose hash is seeded at random (foldhash, as hashbrown's own maps): no list of names
/// collides for every seed, so a file cannot make it quadratic, and each name costs one
/// hash and one probe.
fn first_duplicate(entries: &[TensorEntry]) -> Option<&str> {
    let mut seen = std::collections::HashSet::with_capacity_and_hasher(
        entries.len(),
        foldhash::fast::RandomState::default(),
    );
    entries
        .iter()
        .map(|e| e.name.as_str())
        .find(|name| !seen.insert(*name))
}

/// The entry `name` of `dtype`, `shape` and offsets `begin..end`, or its first fault.
fn validate_entry(
    name: &str,
    dtype: std::result::Result<DType, String>,
    shape: Vec<usize>,
    begin: usize,
    end: usize,
) -> Result<TensorEntry> {
    let at = shorten(name);
    let dtype = dtype.map_err(|code| Error::format_in(&at, format!("unknown dtype {code:?}")))?;
    if let Some(d) = shape.iter().find(|&&d| d > MAX_DIM) {
        return Err(Error::format_in(
            &at,
            format!(
                "dimension {d} of shape {} is beyond int64, which no framework holds",
                shape_text(&shape)
            ),
        ));
    }
    let shape = packed_shape(dtype, shape, &at)?;
    if begin > end {
        return Err(Error::format_in(
            &at,
            format!("data_offsets [{begin}, {end}] are reversed"),
        ));
    }
    let expected = checked_nbytes(dtype, &shape)
        .ok_or_else(|| Error::format_in(&at, format!("shape {} overflows", shape_text(&shape))))?;
    if expected != end - begin {
        return Err(Error::format_in(
            &at,
            format!(
                "{dtype} shape {} needs {expected} bytes but data_offsets [{begin}, {end}] span {}",
                shape_text(&shape),
                end - begin
            ),
        ));
    }
    Ok(TensorEntry {
        name: name.to_string(),
        dtype,
        shape,
        begin,
        end,
    })
}

/// The tensor shape of a header's `shape` of `dtype` (packed floats hold several values an
/// element, [`DType::tensor_shape`]); a shape whose values do not fill whole elements is
/// an [`Error::UnsupportedDType`] naming the tensor.
pub(crate) fn packed_shape(dtype: DType, shape: Vec<usize>, at: &str) -> Result<Vec<usize>> {
    if dtype.lanes() == 1 {
        return Ok(shape);
    }
    let text = shape_text(&shape);
    dtype
        .tensor_shape(shape)
        .ok_or_else(|| Error::UnsupportedDType {
            key: at.to_string(),
            dtype: dtype.safetensors_code().unwrap_or("?").to_string(),
            reason: format!(
                "shape {text}: tensorferry holds these values packed, {} to an element along the \
             last dimension (as PyTorch's {}), which must then be a multiple of {}",
                dtype.lanes(),
                dtype.name(),
                dtype.lanes()
            ),
        })
}

/// A shape for a message: in full when short, else its first dims and its length.
fn shape_text(shape: &[usize]) -> String {
    const SHOWN: usize = 8;
    if shape.len() <= SHOWN {
        return format!("{shape:?}");
    }
    let head: Vec<String> = shape[..SHOWN].iter().map(|d| d.to_string()).collect();
    format!("[{}, … ({} dims)]", head.join(", "), shape.len())
}

/// The tensors must tile the data section exactly: start at 0, no gap, no overlap, no tail.
fn check_coverage(tensors: &[TensorEntry], data_start: u64, data_len: u64) -> Result<()> {
    // Writers list the tensors in the order of their bytes: then a walk checks the tiling,
    // and only another order is sorted first (to word the fault the sorted walk finds).
    let mut at = 0usize;
    let tiled_in_order = tensors.iter().all(|t| {
        let next = t.begin == at;
        at = t.end;
        next
    });
    if tiled_in_order && at as u64 == data_len {
        return Ok(());
    }
    let mut order: Vec<&TensorEntry> = tensors.iter().collect();
    order.sort_unstable_by_key(|t| (t.begin, t.end));
    let mut at = 0usize;
    for t in order {
        if t.end as u64 > data_len {
            return Err(Error::Format {
                at: format!(
                    "tensor {:?} (byte {})",
                    shorten(&t.name),
                    data_start + t.begin as u64
                ),
                reason: format!(
                    "data_offsets [{}, {}] run past the end of the data section ({data_len} bytes)",
                    t.begin, t.end
                ),
            });
        }
        if t.begin < at {
            return Err(Error::Format {
                at: format!(
                    "tensor {:?} (byte {})",
                    shorten(&t.name),
                    data_start + t.begin as u64
                ),
                reason: format!("overlaps the tensor before it, which ends at data offset {at}"),
            });
        }
        if t.begin > at {
            return Err(Error::Format {
                at: format!("byte {}", data_start + at as u64),
                reason: format!(
                    "gap of {} bytes before tensor {:?} in the data section",
                    t.begin - at,
                    shorten(&t.name)
                ),
            });
        }
        at = t.end;
    }
    if (at as u64) < data_len {
        return Err(Error::format_at(
            data_start + at as u64,
            format!(
                "{} trailing bytes after the last tensor",
                data_len - at as u64
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(json: &str, data_len: u64) -> Result<Header> {
        parse_header(json.as_bytes(), data_len)
    }

    #[test]
    fn a_valid_header_parses_in_order() {
        let h = hdr(
            r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"},"a":{"dtype":"U8","shape":[],"data_offsets":[8,9]}}"#,
            9,
        )
        .unwrap();
        assert_eq!(h.tensors[0].name, "b");
        assert_eq!(h.tensors[1].shape, Vec::<usize>::new());
        assert_eq!(h.metadata["k"], "v");
    }

    #[test]
    fn an_entry_in_array_form_parses_as_serde_allows_it() {
        let h = hdr(r#"{"a":["U8",[1,2],[0,2]]}"#, 2).unwrap();
        assert_eq!(h.tensors[0].shape, [1, 2]);
    }

    #[test]
    fn a_header_costing_more_memory_than_the_budget_is_refused() {
        let dims = vec!["1"; 400_000].join(",");
        let json = format!(r#"{{"a":{{"dtype":"U8","shape":[{dims}],"data_offsets":[0,1]}}}}"#);
        let Err(refused) = hdr(&json, 1) else {
            panic!("a header of 400,000 dims before 1 byte of data was accepted");
        };
        let message = refused.to_string();
        assert!(
            message.contains("400000 dimensions"),
            "{}",
            shorten(&message)
        );
        // The same header before 100 MB of data: a cost in proportion, accepted.
        let big = json
            .replace("[0,1]", "[0,100000000]")
            .replacen("[1,", "[100000000,", 1);
        assert!(hdr(&big, 100_000_000).is_ok());
    }

    /// Headers at fault (the JSON, the data section's length) and words their error holds.
    #[test]
    fn faulty_headers_are_format_errors_saying_why() {
        for (json, data_len, words) in [
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                2,
                "twice",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
                "needs 12 bytes",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                2,
                "gap",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
                3,
                "overlaps",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                5,
                "trailing",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
                2,
                "past the end",
            ),
            (
                r#"{"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}"#,
                1,
                r#"unknown dtype "Q7""#,
            ),
            ("{not json", 0, "not a valid safetensors JSON object"),
            ("[1,2]", 0, "not a valid safetensors JSON object"),
            // Faults are worded with their place, as serde_json words them.
            (
                "{\"a\" 1}",
                0,
                "header is not a valid safetensors JSON object: expected `:` at line 1 column 6",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":"x","data_offsets":[0,0]}}"#,
                0,
                r#"tensor "a": invalid type: string "x", expected a sequence at line 1 column"#,
            ),
            (
                r#"{"a":{"shape":[],"data_offsets":[0,0]}}"#,
                0,
                "missing field `dtype`",
            ),
            (
                r#"{"__metadata__":{"k":1}}"#,
                0,
                "__metadata__ must map strings to strings: invalid type: integer `1`, expected a string",
            ),
            (
                r#"{"a":{"dtype":"Q7","shape":[],"data_offsets":[0,0]}}"#,
                0,
                r#"unknown dtype "Q7""#,
            ),
            // A syntax fault anywhere comes before a fault of an entry.
            (
                r#"{"a":{"dtype":"Q7","shape":[],"data_offsets":[0,0]},}"#,
                0,
                "key must be a string",
            ),
        ] {
            let e = hdr(json, data_len).unwrap_err();
            assert!(
                matches!(e, Error::Format { .. }) && e.to_string().contains(words),
                "{json}: {e}"
            );
        }
    }

    #[test]
    fn header_length_is_bounded_by_the_file_and_the_limit() {
        let huge = (MAX_HEADER_BYTES + 1).to_le_bytes();
        assert!(header_len(&huge, u64::MAX)
            .unwrap_err()
            .to_string()
            .contains("limit"));
        let past = 100u64.to_le_bytes();
        assert!(header_len(&past, 50)
            .unwrap_err()
            .to_string()
            .contains("past the end"));
        assert!(header_len(&[1, 2], 2).is_err());
    }

    /// A file holding the header `text` and `data_len` bytes of data.
    fn file(text: &str, data_len: usize) -> Vec<u8> {
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.extend((0..data_len).map(|i| i as u8));
        bytes
    }

    /// A header as writers write it, with a tree record, escapes and fields out of order.
    const WRITTEN: &str = r#"{"__metadata__":{"k":"v\"w\u00e9","tensorferry":"{\"format\":1,\"tree\":{\"dict\":[[\"a\",{\"tensor\":\"a\"}],[\"b\",{\"list\":[{\"int\":-3},{\"none\":null},{\"bool\":false},{\"str\":\"s\"}]}],[\"c\",{\"tensor\":\"c\"}]]}}"},"a":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]},"c":{"shape":[],"data_offsets":[8,9],"dtype":"U8"}}   "#;

    /// The files the differential tests read: both corpora, a written header, and every
    /// one-byte change (to a byte that matters to JSON) and every cut of that header.
    fn files() -> Vec<Vec<u8>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        for folder in ["../../fuzz/corpus/read_safetensors", "tests/corpus"] {
            for file in std::fs::read_dir(dir.join(folder)).unwrap() {
                files.push(std::fs::read(file.unwrap().path()).unwrap());
            }
        }
        let bytes = WRITTEN.as_bytes();
        for at in 0..bytes.len() {
            for b in *b"\"\\{}[],:019-eE.ntx u" {
                let mut changed = bytes.to_vec();
                changed[at] = b;
                if let Ok(text) = std::str::from_utf8(&changed) {
                    files.push(file(text, 9));
                }
            }
            files.push(file(&WRITTEN[..at], 9));
        }
        files.push(file(WRITTEN, 9));
        files
    }

    /// The header text of a file, and the length of its data, when it has both.
    fn split(bytes: &[u8]) -> Option<(&str, u64)> {
        let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let end = 8usize.checked_add(usize::try_from(n).ok()?)?;
        let text = std::str::from_utf8(bytes.get(8..end)?).ok()?;
        Some((text, (bytes.len() - end) as u64))
    }

    #[test]
    fn the_json_is_read_exactly_where_serde_json_reads_it() {
        let mut read = 0;
        for bytes in files() {
            let Some((text, _)) = split(&bytes) else {
                continue;
            };
            let oracle = serde_json::from_str::<serde_json::Value>(text);
            let mine = count(text, true);
            let oracle_reads = oracle.as_ref().is_ok_and(|v| v.is_object());
            assert_eq!(
                mine.is_ok(),
                oracle_reads,
                "{text}: {:?} / {oracle:?}",
                mine.err()
            );
            read += usize::from(mine.is_ok());
        }
        assert!(
            read > 100,
            "only {read} headers read: the test tests little"
        );
    }

    /// The fast paths for the entries writers write ([`skim_entry`], [`plain_entry`]) count,
    /// read and refuse every header exactly as the general reader alone does: the same
    /// census, the same entries, the same fault in the same words.
    #[test]
    fn the_fast_paths_read_what_the_general_reader_reads() {
        let entry = |body: &str| {
            format!(r#"{{"a":{body},"b":{{"dtype":"U8","shape":[1],"data_offsets":[8,9]}}}}"#)
        };
        let mut texts: Vec<String> = [
            r#"{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]}"#,
            r#"{ "dtype" : "F32", "shape" : [ 2 , 1 ] , "data_offsets" : [ 0 , 8 ] }"#,
            r#"{"shape":[2,1],"data_offsets":[0,8],"dtype":"F32"}"#,
            r#"{"dtype":"F32","shape":[2,1],"shape":[1,1,1,1,1,1,1,1,1,2],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,2],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[1,1,1,1,1,1,1,2],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[02],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}"#,
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0]}"#,
            r#"{"dtype":"F32","shape":[2],"data_offsets":[8,0]}"#,
            r#"{"dtype":"F32","shape":[3],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#,
            r#"{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F4","shape":[16],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F4","shape":[3],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[2]}"#,
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}"#,
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0,8],}"#,
            r#"{"dtype":"F32","shape":[2,],"data_offsets":[0,8]}"#,
            r#"{"dtype" :"F32","shape":[2],"data_offsets":[0,8]}"#,
            r#"{"dtype":3,"shape":[2],"data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":"2","data_offsets":[0,8]}"#,
            r#"{"dtype":"F32","shape":[2],"data_offsets":{}}"#,
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0,8]"#,
            r#"{}"#,
            r#"["F32",[2],[0,8]]"#,
            r#""F32""#,
            r#"7"#,
        ]
        .iter()
        .map(|body| entry(body))
        .collect();
        texts.extend(
            files()
                .iter()
                .filter_map(|bytes| split(bytes).map(|(text, _)| text.to_string())),
        );
        let (mut both_paths, mut built) = (0, 0);
        for text in &texts {
            let words = |stop: Stop| match stop {
                Stop::Json(f) => f.describe(text),
                Stop::Other(e) => e.to_string(),
            };
            let fast = count(text, true).map_err(|f| f.describe(text));
            let general = count(text, false).map_err(|f| f.describe(text));
            assert_eq!(format!("{fast:?}"), format!("{general:?}"), "{text}");
            let Ok((census, tree)) = general else {
                continue;
            };
            let fast = build(text, census.entries, tree.clone(), true).map_err(words);
            let general = build(text, census.entries, tree, false).map_err(words);
            assert_eq!(fast, general, "{text}");
            both_paths += 1;
            built += usize::from(fast.is_ok());
        }
        assert!(
            both_paths > 100 && built > 50,
            "only {both_paths} headers counted and {built} built: the test tests little"
        );
    }

    #[test]
    fn what_it_reads_the_safetensors_crate_reads_alike() {
        let (mut agreed, mut refused) = (0, 0);
        for bytes in files() {
            let Some((text, data_len)) = split(&bytes) else {
                continue;
            };
            let Ok(mine) = parse_header(text.as_bytes(), data_len) else {
                continue;
            };
            let Ok(theirs) = safetensors::SafeTensors::deserialize(&bytes) else {
                refused += 1;
                continue;
            };
            let data = &bytes[mine.data_start as usize..];
            assert_eq!(mine.tensors.len(), theirs.len(), "{text}");
            for t in &mine.tensors {
                let view = theirs.tensor(&t.name).unwrap();
                assert_eq!(
                    Some(&*format!("{:?}", view.dtype())),
                    t.dtype.safetensors_code()
                );
                assert_eq!(
                    view.shape(),
                    t.dtype.file_shape(&t.shape).unwrap(),
                    "{text}"
                );
                assert_eq!(view.data(), &data[t.begin..t.end], "{text}");
            }
            let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            let theirs_meta: BTreeMap<String, String> = meta
                .metadata()
                .clone()
                .unwrap_or_default()
                .into_iter()
                .collect();
            assert_eq!(mine.metadata, theirs_meta, "{text}");
            agreed += 1;
        }
        assert!(
            agreed > 20,
            "only {agreed} headers compared ({refused} refused by safetensors)"
        );
        assert!(
            refused <= agreed / 10,
            "safetensors refused {refused} headers read here"
        );
    }
}
