//! Parsing and validating a safetensors header, trusting nothing in it.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;

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
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// The header's top-level object: entries in order (duplicates kept, to be reported)
/// and the metadata.
#[derive(Default)]
struct RawHeader {
    entries: Vec<(String, RawEntry)>,
    metadata: Option<BTreeMap<String, String>>,
    duplicate: Option<String>,
}

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawHeader, A::Error> {
                use serde::de::Error as _;
                let mut out = RawHeader::default();
                while let Some(name) = map.next_key::<String>()? {
                    if name == "__metadata__" {
                        let m = map.next_value::<BTreeMap<String, String>>().map_err(|e| {
                            A::Error::custom(format!(
                                "__metadata__ must map strings to strings: {e}"
                            ))
                        })?;
                        if out.metadata.replace(m).is_some() {
                            out.duplicate.get_or_insert(name);
                        }
                        continue;
                    }
                    let entry = map
                        .next_value::<RawEntry>()
                        .map_err(|e| A::Error::custom(format!("tensor {name:?}: {e}")))?;
                    out.entries.push((name, entry));
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
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

/// Parses and validates `header` (the JSON bytes) of a file whose data section holds
/// `data_len` bytes: every tensor must fit exactly, with no gap, overlap or trailing byte.
pub fn parse_header(header: &[u8], data_len: u64) -> Result<Header> {
    let data_start = 8 + header.len() as u64;
    let text = std::str::from_utf8(header)
        .map_err(|e| Error::format_at(8 + e.valid_up_to() as u64, "header is not valid UTF-8"))?;
    let raw: RawHeader = serde_json::from_str(text).map_err(|e| {
        Error::format_at(
            8,
            format!("header is not a valid safetensors JSON object: {e}"),
        )
    })?;
    if let Some(name) = raw.duplicate {
        return Err(Error::format_in(&name, "name appears twice in the header"));
    }
    let mut seen = HashSet::with_capacity(raw.entries.len());
    for (name, _) in &raw.entries {
        if !seen.insert(name.as_str()) {
            return Err(Error::format_in(name, "name appears twice in the header"));
        }
    }
    let tensors = raw
        .entries
        .into_iter()
        .map(|(name, e)| validate_entry(name, e))
        .collect::<Result<Vec<_>>>()?;
    check_coverage(&tensors, data_start, data_len)?;
    Ok(Header {
        tensors,
        metadata: raw.metadata.unwrap_or_default(),
        data_start,
    })
}

fn validate_entry(name: String, e: RawEntry) -> Result<TensorEntry> {
    let dtype = DType::from_safetensors_code(&e.dtype)
        .ok_or_else(|| Error::format_in(&name, format!("unknown dtype {:?}", e.dtype)))?;
    let shape = e.shape;
    let (begin, end) = e.data_offsets;
    if begin > end {
        return Err(Error::format_in(
            &name,
            format!("data_offsets [{begin}, {end}] are reversed"),
        ));
    }
    let expected = checked_nbytes(dtype, &shape)
        .ok_or_else(|| Error::format_in(&name, format!("shape {shape:?} overflows")))?;
    if expected != end - begin {
        return Err(Error::format_in(
            &name,
            format!(
                "{dtype} shape {shape:?} needs {expected} bytes but data_offsets [{begin}, {end}] span {}",
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

/// The tensors must tile the data section exactly: start at 0, no gap, no overlap, no tail.
fn check_coverage(tensors: &[TensorEntry], data_start: u64, data_len: u64) -> Result<()> {
    let mut order: Vec<&TensorEntry> = tensors.iter().collect();
    order.sort_by_key(|t| (t.begin, t.end));
    let mut at = 0usize;
    for t in order {
        if t.end as u64 > data_len {
            return Err(Error::Format {
                at: format!("tensor {:?} (byte {})", t.name, data_start + t.begin as u64),
                reason: format!(
                    "data_offsets [{}, {}] run past the end of the data section ({data_len} bytes)",
                    t.begin, t.end
                ),
            });
        }
        if t.begin < at {
            return Err(Error::Format {
                at: format!("tensor {:?} (byte {})", t.name, data_start + t.begin as u64),
                reason: format!("overlaps the tensor before it, which ends at data offset {at}"),
            });
        }
        if t.begin > at {
            return Err(Error::Format {
                at: format!("byte {}", data_start + at as u64),
                reason: format!(
                    "gap of {} bytes before tensor {:?} in the data section",
                    t.begin - at,
                    t.name
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
