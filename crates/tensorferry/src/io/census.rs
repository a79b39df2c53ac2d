//! Counting what a header describes without building any of it.
//!
//! A first, allocation-free pass over the header's JSON counts tensors, dimensions,
//! metadata entries and string bytes (and, through [`super::tree_census`], the nodes of
//! the recorded tree). [`super::budget`] turns the counts into an upper bound of the
//! memory a load takes, before the second pass builds anything, and the second pass
//! allocates exactly what the counts say.
//!
//! The pass is lenient about everything but the JSON syntax and the top-level object:
//! a value of the wrong type is skipped here and reported, with the tensor's name, by
//! the pass that builds.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::tree_census::{self, TreeCensus};
use super::TREE_METADATA_KEY;
use crate::error::{Error, Result};

/// What a header describes, counted.
#[derive(Debug, Default)]
pub(crate) struct HeaderCensus {
    /// Bytes of the header's JSON.
    pub(crate) header_bytes: u64,
    /// Tensor entries.
    pub(crate) entries: u64,
    /// Dimensions of all shapes together.
    pub(crate) dims: u64,
    /// Dimensions of the longest shape.
    pub(crate) max_ndim: u64,
    /// Bytes of all tensor names.
    pub(crate) name_bytes: u64,
    /// Entries of `__metadata__`.
    pub(crate) metadata_pairs: u64,
    /// Bytes of the keys and string values of `__metadata__`.
    pub(crate) metadata_bytes: u64,
    /// Bytes of the longest string the parse copies out (its scratch space grows to it).
    pub(crate) longest_string: u64,
    /// The recorded tree, counted, when `__metadata__` holds one (an error when it does not
    /// parse: the load reports it, a header read does not care).
    pub(crate) tree: Option<Result<TreeCensus>>,
}

/// Counts what the header `text` describes; only malformed JSON, or JSON that is not an
/// object, is an error.
pub(crate) fn count_header(text: &str) -> Result<HeaderCensus> {
    let mut census = HeaderCensus {
        header_bytes: text.len() as u64,
        ..HeaderCensus::default()
    };
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = Top(&mut census)
        .deserialize(&mut de)
        .and_then(|()| de.end());
    parsed.map_err(|e| {
        Error::format_at(
            8,
            format!("header is not a valid safetensors JSON object: {e}"),
        )
    })?;
    Ok(census)
}

impl HeaderCensus {
    /// Notes a string of `len` bytes.
    pub(crate) fn saw_string(&mut self, len: usize) {
        self.longest_string = self.longest_string.max(len as u64);
    }
}

/// Accepts and skips any value a visitor has no interest in (the lenient part).
macro_rules! skip_other_values {
    ($($method:ident($ty:ty)),*) => {$(
        fn $method<E: serde::de::Error>(self, _: $ty) -> std::result::Result<(), E> {
            Ok(())
        }
    )*};
}

macro_rules! skip_everything_else {
    () => {
        skip_other_values!(
            visit_bool(bool),
            visit_i64(i64),
            visit_u64(u64),
            visit_f64(f64)
        );

        fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<(), E> {
            Ok(())
        }
    };
}

/// The top-level object.
struct Top<'a>(&'a mut HeaderCensus);

impl<'de> DeserializeSeed<'de> for Top<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        while let Some(len) = map.next_key_seed(MeasuredStr)? {
            self.0.saw_string(len.len);
            if len.is_metadata {
                map.next_value_seed(Metadata(self.0))?;
            } else {
                self.0.entries += 1;
                self.0.name_bytes += len.len as u64;
                map.next_value_seed(Entry(self.0))?;
            }
        }
        Ok(())
    }
}

/// A key: its length, and whether it is `__metadata__`.
struct MeasuredStr;

struct Measured {
    len: usize,
    is_metadata: bool,
}

impl<'de> DeserializeSeed<'de> for MeasuredStr {
    type Value = Measured;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Measured, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for MeasuredStr {
    type Value = Measured;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Measured, E> {
        Ok(Measured {
            len: v.len(),
            is_metadata: v == "__metadata__",
        })
    }
}

/// One tensor entry: the dtype string, the shape's length, other fields skipped.
struct Entry<'a>(&'a mut HeaderCensus);

impl<'de> DeserializeSeed<'de> for Entry<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Entry<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a tensor entry")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        while let Some((len, field)) = map.next_key_seed(EntryField)? {
            self.0.saw_string(len);
            match field {
                Some(role) => map.next_value_seed(AnyValue(self.0, role))?,
                // Skipped by the parse that builds too: no copy, nothing to count.
                None => map.next_value::<IgnoredAny>().map(drop)?,
            }
        }
        Ok(())
    }
    /// The array form `[dtype, shape, data_offsets]`, which the derived parse accepts too.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        if seq
            .next_element_seed(AnyValue(self.0, Role::Dtype))?
            .is_none()
        {
            return Ok(());
        }
        if seq
            .next_element_seed(AnyValue(self.0, Role::Shape))?
            .is_none()
        {
            return Ok(());
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<(), E> {
        self.0.saw_string(v.len());
        Ok(())
    }
    skip_everything_else!();
}

/// What a value found inside an entry or the metadata is counted as.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    /// An entry's dtype.
    Dtype,
    /// An entry's shape: an array's length counts as dimensions.
    Shape,
    /// A metadata value.
    Metadata,
    /// The metadata value that records the tree.
    Tree,
}

/// A field name of an entry: its length, and the role of its value (`None`: skipped).
struct EntryField;

impl<'de> DeserializeSeed<'de> for EntryField {
    type Value = (usize, Option<Role>);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for EntryField {
    type Value = (usize, Option<Role>);
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Self::Value, E> {
        let role = match v {
            "dtype" => Some(Role::Dtype),
            "shape" => Some(Role::Shape),
            _ => None,
        };
        Ok((v.len(), role))
    }
}

/// Any value: strings measured, arrays counted as shapes where the role says so.
struct AnyValue<'a>(&'a mut HeaderCensus, Role);

impl<'de> DeserializeSeed<'de> for AnyValue<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for AnyValue<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<(), E> {
        let AnyValue(census, role) = self;
        census.saw_string(v.len());
        if matches!(role, Role::Metadata | Role::Tree) {
            census.metadata_bytes += v.len() as u64;
        }
        if role == Role::Tree {
            census.tree = Some(tree_census::count_tree(v));
        }
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let AnyValue(census, role) = self;
        let mut n = 0u64;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            n += 1;
        }
        if role == Role::Shape {
            census.dims += n;
            census.max_ndim = census.max_ndim.max(n);
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> std::result::Result<(), A::Error> {
        IgnoredAny.visit_map(map).map(drop)
    }
    skip_everything_else!();
}

/// The `__metadata__` object: every key and string value measured, the tree counted.
struct Metadata<'a>(&'a mut HeaderCensus);

impl<'de> DeserializeSeed<'de> for Metadata<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Metadata<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the metadata object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        while let Some(key) = map.next_key_seed(MetadataKey)? {
            self.0.saw_string(key.0);
            self.0.metadata_pairs += 1;
            self.0.metadata_bytes += key.0 as u64;
            let role = if key.1 { Role::Tree } else { Role::Metadata };
            map.next_value_seed(AnyValue(self.0, role))?;
        }
        Ok(())
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<(), E> {
        self.0.saw_string(v.len());
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> std::result::Result<(), A::Error> {
        IgnoredAny.visit_seq(seq).map(drop)
    }
    skip_everything_else!();
}

/// A metadata key: its length, and whether it is tensorferry's reserved key.
struct MetadataKey;

impl<'de> DeserializeSeed<'de> for MetadataKey {
    type Value = (usize, bool);
    fn deserialize<D: Deserializer<'de>>(
        self,
        d: D,
    ) -> std::result::Result<(usize, bool), D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for MetadataKey {
    type Value = (usize, bool);
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<(usize, bool), E> {
        Ok((v.len(), v == TREE_METADATA_KEY))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_entries_dims_names_and_metadata() {
        let c = count_header(
            r#"{"ab":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"__metadata__":{"k":"vv"},"c":{"dtype":"U8","shape":[],"data_offsets":[24,24]}}"#,
        )
        .unwrap();
        assert_eq!((c.entries, c.dims, c.max_ndim, c.name_bytes), (2, 2, 2, 3));
        assert_eq!((c.metadata_pairs, c.metadata_bytes), (1, 3));
        assert!(c.tree.is_none());
    }

    #[test]
    fn entries_in_array_form_are_counted_too() {
        let c = count_header(r#"{"a":["U8",[1,1,1],[0,1]]}"#).unwrap();
        assert_eq!((c.entries, c.dims, c.max_ndim), (1, 3, 3));
    }

    #[test]
    fn wrong_types_are_left_to_the_parse_that_builds() {
        let c = count_header(r#"{"a":5,"b":{"shape":{"x":1},"dtype":[1,2]},"__metadata__":[1]}"#)
            .unwrap();
        assert_eq!(c.entries, 2);
    }

    #[test]
    fn bad_json_and_non_objects_are_format_errors() {
        assert!(matches!(count_header("{"), Err(Error::Format { .. })));
        assert!(matches!(count_header("[1]"), Err(Error::Format { .. })));
        assert!(matches!(count_header("{} x"), Err(Error::Format { .. })));
    }
}
