//! Checking a tree record and counting its nodes, before anything is built from it.
//!
//! The record is parsed once with nothing allocated but the list of container lengths:
//! every syntax and type fault, an unknown kind, a wrong format version and a nesting
//! deeper than [`MAX_DEPTH`](super::tree_meta::MAX_DEPTH) are reported here, so that the memory budget can be decided
//! on exact counts and [`super::tree_decode`] can allocate exactly what they say.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::tree_meta::{bad, decimal_len, node_kind, version_understood, FloatSeed, Kind};
use crate::error::Result;

/// What a tree record holds, counted.
#[derive(Debug, Default)]
pub(crate) struct TreeCensus {
    /// Dicts.
    pub(crate) dicts: u64,
    /// Entries of all dicts together.
    pub(crate) dict_entries: u64,
    /// Lists and tuples.
    pub(crate) sequences: u64,
    /// Items of all lists and tuples together.
    pub(crate) items: u64,
    /// Bytes of all dict keys and string values.
    pub(crate) string_bytes: u64,
    /// Bytes of the longest string (the parser's scratch space grows to it).
    pub(crate) longest_string: u64,
    /// The length of every dict, list and tuple, in the order the record lists them.
    pub(crate) lengths: Vec<u32>,
    /// The names `{"alias": name}` nodes refer to, sorted, each once: the decoder keeps
    /// the tensors of these names when it takes them (none for most records).
    pub(crate) aliased: Vec<String>,
    /// Counted by [`super::fast_tree`], whose decoder then builds the tree.
    pub(crate) fast: bool,
}

/// Checks the record `text` and counts what it holds.
pub(crate) fn count_tree(text: &str) -> Result<TreeCensus> {
    let mut census = TreeCensus::default();
    let mut de = serde_json::Deserializer::from_str(text);
    CountDoc(&mut census)
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|e| bad(format!("not a valid tree record: {e}")))?;
    census.lengths.shrink_to_fit();
    census.settle_aliases();
    Ok(census)
}

impl TreeCensus {
    /// Notes a string of `len` bytes.
    pub(crate) fn saw_string(&mut self, len: usize) {
        self.longest_string = self.longest_string.max(len as u64);
    }

    /// Sorts the aliased names and keeps each once, for the decoder's searches.
    pub(crate) fn settle_aliases(&mut self) {
        if !self.aliased.is_empty() {
            self.aliased.sort_unstable();
            self.aliased.dedup();
        }
    }

    /// Where `name` is in [`TreeCensus::aliased`], when aliases refer to it.
    pub(crate) fn aliased_at(&self, name: &str) -> Option<usize> {
        if self.aliased.is_empty() {
            return None;
        }
        self.aliased.binary_search_by(|a| a.as_str().cmp(name)).ok()
    }
}

/// The document: `{"format": 1, "tree": NODE}` (other keys skipped).
struct CountDoc<'a>(&'a mut TreeCensus);

impl<'de> DeserializeSeed<'de> for CountDoc<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for CountDoc<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a tree record object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        use serde::de::Error as _;
        let (mut format, mut tree) = (false, false);
        while let Some(key) = map.next_key_seed(DocKey)? {
            match key {
                DocField::Format if format => return Err(A::Error::duplicate_field("format")),
                DocField::Tree if tree => return Err(A::Error::duplicate_field("tree")),
                DocField::Format => {
                    format = true;
                    let version: u64 = map.next_value()?;
                    if !version_understood(version) {
                        return Err(A::Error::custom(format!(
                            "unsupported format version {version}"
                        )));
                    }
                }
                DocField::Tree => {
                    tree = true;
                    map.next_value_seed(CountNode {
                        census: &mut *self.0,
                        depth: 0,
                    })?;
                }
                DocField::Other => map.next_value::<IgnoredAny>().map(drop)?,
            }
        }
        match (format, tree) {
            (false, _) => Err(A::Error::missing_field("format")),
            (_, false) => Err(A::Error::missing_field("tree")),
            _ => Ok(()),
        }
    }
}

/// A key of the document, as [`DocKey`] reads it.
#[derive(Clone, Copy)]
pub(crate) enum DocField {
    Format,
    Tree,
    Other,
}

/// Reads a key of the document.
pub(crate) struct DocKey;

impl<'de> DeserializeSeed<'de> for DocKey {
    type Value = DocField;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<DocField, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for DocKey {
    type Value = DocField;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<DocField, E> {
        Ok(match v {
            "format" => DocField::Format,
            "tree" => DocField::Tree,
            _ => DocField::Other,
        })
    }
}

/// One node at `depth` (the root is at 0).
struct CountNode<'a> {
    census: &'a mut TreeCensus,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for CountNode<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for CountNode<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a node object with one key")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        use serde::de::Error as _;
        let kind = node_kind(&mut map, self.depth)?;
        let census = self.census;
        match kind {
            Kind::Dict | Kind::List | Kind::Tuple => map.next_value_seed(CountItems {
                census,
                depth: self.depth,
                pairs: kind == Kind::Dict,
            })?,
            Kind::Tensor | Kind::Str => {
                let len = map.next_value_seed(StrLen)?;
                census.saw_string(len);
                if kind == Kind::Str {
                    census.string_bytes += len as u64;
                }
            }
            Kind::Alias => {
                let name: String = map.next_value()?;
                census.saw_string(name.len());
                census.aliased.push(name);
            }
            Kind::None => map.next_value::<()>()?,
            Kind::Bool => map.next_value::<bool>().map(drop)?,
            Kind::Int => map.next_value::<i64>().map(drop)?,
            Kind::Float => map.next_value_seed(FloatSeed).map(drop)?,
        }
        if map.next_key::<IgnoredAny>()?.is_some() {
            return Err(A::Error::custom("a node object has more than one key"));
        }
        Ok(())
    }
}

/// The items of a list or tuple, or the `[key, node]` pairs of a dict, of a node at `depth`.
struct CountItems<'a> {
    census: &'a mut TreeCensus,
    depth: usize,
    pairs: bool,
}

impl<'de> DeserializeSeed<'de> for CountItems<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for CountItems<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        use serde::de::Error as _;
        let census = self.census;
        let slot = census.lengths.len();
        census.lengths.push(0);
        let mut n = 0u32;
        loop {
            let more = if self.pairs {
                seq.next_element_seed(CountPair {
                    census: &mut *census,
                    depth: self.depth + 1,
                })?
            } else {
                seq.next_element_seed(CountNode {
                    census: &mut *census,
                    depth: self.depth + 1,
                })?
            };
            if more.is_none() {
                break;
            }
            n = n
                .checked_add(1)
                .ok_or_else(|| A::Error::custom("a dict, list or tuple is too long"))?;
        }
        census.lengths[slot] = n;
        if self.pairs {
            census.dicts += 1;
            census.dict_entries += u64::from(n);
        } else {
            census.sequences += 1;
            census.items += u64::from(n);
        }
        Ok(())
    }
}

/// A dict entry: `[key, node]`, the node at `depth`.
struct CountPair<'a> {
    census: &'a mut TreeCensus,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for CountPair<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for CountPair<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a [key, node] pair")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        use serde::de::Error as _;
        let len = seq
            .next_element_seed(KeyLen)?
            .ok_or_else(|| A::Error::invalid_length(0, &self))?;
        self.census.saw_string(len);
        self.census.string_bytes += len as u64;
        seq.next_element_seed(CountNode {
            census: &mut *self.census,
            depth: self.depth,
        })?
        .ok_or_else(|| A::Error::invalid_length(1, &"a [key, node] pair"))?;
        if seq.next_element::<IgnoredAny>()?.is_some() {
            return Err(A::Error::invalid_length(3, &"a [key, node] pair"));
        }
        Ok(())
    }
}

/// The length of a dict key's text: a string's, or an integer key's decimal text.
struct KeyLen;

impl<'de> DeserializeSeed<'de> for KeyLen {
    type Value = usize;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<usize, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for KeyLen {
    type Value = usize;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a dict key (a string or an integer)")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<usize, E> {
        Ok(v.len())
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<usize, E> {
        Ok(decimal_len(v))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<usize, E> {
        i64::try_from(v)
            .map(decimal_len)
            .map_err(|_| E::custom(format!("the integer key {v} does not fit in 64 bits")))
    }
}

/// A string's length.
struct StrLen;

impl<'de> DeserializeSeed<'de> for StrLen {
    type Value = usize;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<usize, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for StrLen {
    type Value = usize;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<usize, E> {
        Ok(v.len())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tree_meta::MAX_DEPTH;
    use super::*;

    fn record(tree: &str) -> String {
        format!(r#"{{"format":1,"tree":{tree}}}"#)
    }

    #[test]
    fn counts_containers_in_order() {
        let c = count_tree(&record(
            r#"{"dict":[["a",{"list":[{"int":1},{"none":null}]}],["b",{"tensor":"t"}],["c",{"str":"xyz"}]]}"#,
        ))
        .unwrap();
        assert_eq!(c.lengths, [3, 2]);
        assert_eq!(
            (c.dicts, c.dict_entries, c.sequences, c.items),
            (1, 3, 1, 2)
        );
        assert_eq!(c.string_bytes, 3 + 3);
    }

    #[test]
    fn faults_are_format_errors() {
        for bad in [
            record(r#"{"dict":[["a"]]}"#),
            record(r#"{"dict":[["a",{"int":1},3]]}"#),
            record(r#"{"int":1,"str":"x"}"#),
            record(r#"{}"#),
            record(r#"{"float":"nope"}"#),
            record(r#"{"int":1.5}"#),
            record(r#"{"what":1}"#),
            r#"{"format":3,"tree":{"none":null}}"#.to_string(),
            r#"{"tree":{"none":null}}"#.to_string(),
            r#"{"format":1}"#.to_string(),
            r#"{"format":1,"format":1,"tree":{"none":null}}"#.to_string(),
        ] {
            let e = count_tree(&bad).unwrap_err();
            assert!(matches!(e, crate::Error::Format { .. }), "{bad}: {e}");
        }
    }

    #[test]
    fn integer_keys_and_aliases_are_counted() {
        let c = count_tree(
            r#"{"format":2,"tree":{"dict":[[0,{"tensor":"a"}],[-12,{"alias":"a"}],["x",{"alias":"a"}]]}}"#,
        )
        .unwrap();
        assert_eq!((c.dicts, c.dict_entries), (1, 3));
        assert_eq!(c.string_bytes, 1 + 3 + 1);
        assert_eq!(c.aliased, ["a"]);
        assert_eq!((c.aliased_at("a"), c.aliased_at("b")), (Some(0), None));
        for bad in [
            r#"{"format":2,"tree":{"dict":[[1.5,{"none":null}]]}}"#,
            r#"{"format":2,"tree":{"dict":[[9223372036854775808,{"none":null}]]}}"#,
            r#"{"format":3,"tree":{"none":null}}"#,
            r#"{"format":2,"tree":{"alias":1}}"#,
        ] {
            assert!(count_tree(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn nesting_is_bounded_by_the_walk_itself() {
        let mut tree = String::from(r#"{"none":null}"#);
        for _ in 0..MAX_DEPTH {
            tree = format!(r#"{{"list":[{tree}]}}"#);
        }
        assert!(count_tree(&record(&tree)).is_ok());
        let deeper = format!(r#"{{"list":[{tree}]}}"#);
        let e = count_tree(&record(&deeper)).unwrap_err();
        assert!(e.to_string().contains("deeper than 40"), "{e}");
    }
}
