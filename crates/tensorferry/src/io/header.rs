//! Parsing and validating a safetensors header, trusting nothing in it.
//!
//! Two passes: [`super::census`] counts what the header describes and
//! [`super::budget`] refuses it if loading would take too much memory; then the parse
//! that builds allocates exactly what was counted.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::budget;
use super::census::{count_header, HeaderCensus};
use super::fast_header::{self, Built};
use super::name_hash::name_hash;
use super::tree_meta::shorten;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::checked_nbytes;

/// Largest header accepted, in bytes (as the official implementation).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor described by a header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// The tensor's name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range inside the data section.
    pub begin: usize,
    /// End of the byte range (exclusive).
    pub end: usize,
}

/// A validated header.
#[derive(Clone, Debug, Default)]
pub struct Header {
    /// The tensors, in the order the header lists them.
    pub tensors: Vec<TensorEntry>,
    /// The `__metadata__` string map.
    pub metadata: BTreeMap<String, String>,
    /// File offset of the data section (8 + header length).
    pub data_start: u64,
}

/// One tensor entry as written in the header, before validation.
#[derive(Deserialize)]
struct RawEntry {
    dtype: DTypeCode,
    #[serde(deserialize_with = "exact_shape")]
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// A dtype code: the dtype, or the (shortened) unknown code.
struct DTypeCode(std::result::Result<DType, String>);

impl<'de> Deserialize<'de> for DTypeCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = DTypeCode;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a dtype code")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<DTypeCode, E> {
                Ok(DTypeCode(
                    DType::from_safetensors_code(v).ok_or_else(|| shorten(v)),
                ))
            }
        }
        d.deserialize_str(V)
    }
}

/// A shape, its vector no longer than its length (the census counted one word per dim).
fn exact_shape<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<usize>, D::Error> {
    let mut shape = Vec::<usize>::deserialize(d)?;
    shape.shrink_to_fit();
    Ok(shape)
}

/// The header's top-level object: validated entries in order and the metadata.
#[derive(Default)]
struct RawHeader {
    entries: Vec<TensorEntry>,
    metadata: Option<BTreeMap<String, String>>,
}

/// Builds a [`RawHeader`] with room for `entries`; a fault of ours goes to `failure`.
struct HeaderSeed<'a> {
    entries: usize,
    failure: &'a mut Option<Error>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = RawHeader;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<RawHeader, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = RawHeader;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<RawHeader, A::Error> {
        use serde::de::Error as _;
        let mut out = RawHeader {
            entries: Vec::with_capacity(self.entries),
            metadata: None,
        };
        let mut fail = |e: Error| {
            *self.failure = Some(e);
            A::Error::custom("invalid entry")
        };
        while let Some(name) = map.next_key::<String>()? {
            if name == "__metadata__" {
                let m = map.next_value::<BTreeMap<String, String>>().map_err(|e| {
                    A::Error::custom(format!("__metadata__ must map strings to strings: {e}"))
                })?;
                if out.metadata.replace(m).is_some() {
                    return Err(fail(Error::format_in(
                        &name,
                        "name appears twice in the header",
                    )));
                }
                continue;
            }
            let entry = map
                .next_value::<RawEntry>()
                .map_err(|e| A::Error::custom(format!("tensor {:?}: {e}", shorten(&name))))?;
            out.entries
                .push(validate_entry(name, entry).map_err(&mut fail)?);
        }
        Ok(out)
    }
}

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
    let fast = match fast_header::count(text) {
        Some(counted) => {
            budget::check(&counted.census, data_len)?;
            fast_header::build(text, counted)
        }
        None => None,
    };
    let (entries, metadata, census) = match fast {
        Some(built) => built,
        None => parse_slow(text, data_len)?,
    };
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

/// The entries, metadata and census of any header `text`, read with `serde_json` (for
/// headers [`fast_header`] does not read), every fault worded.
pub(super) fn parse_slow(text: &str, data_len: u64) -> Result<Built> {
    let census = count_header(text)?;
    budget::check(&census, data_len)?;
    let mut failure = None;
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = HeaderSeed {
        entries: census.entries as usize,
        failure: &mut failure,
    }
    .deserialize(&mut de)
    .and_then(|raw| de.end().map(|()| raw));
    let raw = match (parsed, failure) {
        (_, Some(fault)) => return Err(fault),
        (Ok(raw), None) => raw,
        (Err(e), None) => {
            return Err(Error::format_at(
                8,
                format!("header is not a valid safetensors JSON object: {e}"),
            ))
        }
    };
    Ok((raw.entries, raw.metadata.unwrap_or_default(), census))
}

/// A name two entries share, if any. The entries are sorted by the hash of their name
/// (two words each), and only those of equal hashes are compared by name: hostile names
/// that share a hash cost a sort by name of their run, never a quadratic walk.
fn first_duplicate(entries: &[TensorEntry]) -> Option<&str> {
    let mut keyed: Vec<(u64, usize)> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| (name_hash(&e.name), i))
        .collect();
    keyed.sort_unstable();
    let name = |k: &(u64, usize)| entries[k.1].name.as_str();
    let mut start = 0;
    while start < keyed.len() {
        let hash = keyed[start].0;
        // Runs are short (one entry, but for a collision): a walk, not a search.
        let mut end = start + 1;
        while keyed.get(end).is_some_and(|k| k.0 == hash) {
            end += 1;
        }
        let run = &mut keyed[start..end];
        if run.len() > 1 {
            run.sort_unstable_by(|a, b| name(a).cmp(name(b)));
            if let Some(w) = run.windows(2).find(|w| name(&w[0]) == name(&w[1])) {
                return Some(name(&w[0]));
            }
        }
        start = end;
    }
    None
}

fn validate_entry(name: String, e: RawEntry) -> Result<TensorEntry> {
    let at = shorten(&name);
    let dtype = e
        .dtype
        .0
        .map_err(|code| Error::format_in(&at, format!("unknown dtype {code:?}")))?;
    let shape = packed_shape(dtype, e.shape, &at)?;
    let (begin, end) = e.data_offsets;
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
        name,
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

    #[test]
    fn duplicate_names_are_rejected() {
        let e = hdr(
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
            2,
        )
        .unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
    }

    #[test]
    fn shape_and_span_must_agree() {
        let e = hdr(
            r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            8,
        )
        .unwrap_err();
        assert!(e.to_string().contains("needs 12 bytes"), "{e}");
    }

    #[test]
    fn gaps_overlaps_and_trailing_bytes_are_rejected() {
        let gap = hdr(
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
            2,
        )
        .unwrap_err();
        assert!(gap.to_string().contains("gap"), "{gap}");
        let overlap = hdr(
            r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
            3,
        )
        .unwrap_err();
        assert!(overlap.to_string().contains("overlaps"), "{overlap}");
        let tail = hdr(
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
            5,
        )
        .unwrap_err();
        assert!(tail.to_string().contains("trailing"), "{tail}");
        let past = hdr(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            2,
        )
        .unwrap_err();
        assert!(past.to_string().contains("past the end"), "{past}");
    }

    #[test]
    fn unknown_dtypes_and_bad_json_are_format_errors() {
        assert!(matches!(
            hdr(
                r#"{"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}"#,
                1
            ),
            Err(Error::Format { .. })
        ));
        assert!(matches!(hdr("{not json", 0), Err(Error::Format { .. })));
        assert!(matches!(hdr("[1,2]", 0), Err(Error::Format { .. })));
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
}
