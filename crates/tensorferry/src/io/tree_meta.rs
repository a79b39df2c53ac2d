//! Recording a tree's nesting and plain values in a header's `__metadata__`: the format,
//! and the pieces its two readers share ([`super::tree_census`] counts a record and checks
//! it, [`super::tree_decode`] builds the tree from it); [`super::header_writer`] writes it.
//!
//! Encoding (JSON): `{"format": 1, "tree": NODE}` where NODE is one of
//! `{"dict": [[key, NODE], …]}`, `{"list": [NODE, …]}`, `{"tuple": [NODE, …]}`,
//! `{"tensor": name}`, `{"none": null}`, `{"bool": b}`, `{"int": i}`,
//! `{"float": x | "nan" | "inf" | "-inf"}`, `{"str": s}`.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Visitor};

use crate::error::Error;

/// The version of the record written and understood.
pub(crate) const FORMAT_VERSION: u64 = 1;
const WHERE: &str = "__metadata__.tensorferry";

/// Deepest tree recorded (the root is at depth 0): deeper ones would exceed the JSON
/// parser's nesting limit (128; a dict level takes three).
pub(crate) const MAX_DEPTH: usize = 40;

/// A [`Error::Format`] about the tree record.
pub(crate) fn bad(reason: impl Into<String>) -> Error {
    Error::Format {
        at: WHERE.into(),
        reason: reason.into(),
    }
}

/// The kind of a node: the one key of its JSON object.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Kind {
    Dict,
    List,
    Tuple,
    Tensor,
    None,
    Bool,
    Int,
    Float,
    Str,
}

impl Kind {
    /// The kind a record names `name` (the one key of a node's object), if any.
    pub(crate) fn from_name(name: &str) -> Option<Kind> {
        Some(match name {
            "dict" => Kind::Dict,
            "list" => Kind::List,
            "tuple" => Kind::Tuple,
            "tensor" => Kind::Tensor,
            "none" => Kind::None,
            "bool" => Kind::Bool,
            "int" => Kind::Int,
            "float" => Kind::Float,
            "str" => Kind::Str,
            _ => return None,
        })
    }
}

const KINDS: &[&str] = &[
    "dict", "list", "tuple", "tensor", "none", "bool", "int", "float", "str",
];

/// Reads a node's kind.
pub(crate) struct KindSeed;

/// The kind of the node object `map` starts (its one key), refusing nodes deeper than
/// [`MAX_DEPTH`]: the prologue both readers of a record share.
pub(crate) fn node_kind<'de, A: serde::de::MapAccess<'de>>(
    map: &mut A,
    depth: usize,
) -> std::result::Result<Kind, A::Error> {
    use serde::de::Error as _;
    if depth > MAX_DEPTH {
        return Err(A::Error::custom(format!(
            "the tree is nested deeper than {MAX_DEPTH} levels"
        )));
    }
    map.next_key_seed(KindSeed)?
        .ok_or_else(|| A::Error::custom("a node object has no kind"))
}

impl<'de> DeserializeSeed<'de> for KindSeed {
    type Value = Kind;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Kind, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KindSeed {
    type Value = Kind;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a node kind")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Kind, E> {
        Kind::from_name(v).ok_or_else(|| E::unknown_variant(&shorten(v), KINDS))
    }
}

/// Reads a float: a JSON number, or "nan", "inf", "-inf".
pub(crate) struct FloatSeed;

impl<'de> DeserializeSeed<'de> for FloatSeed {
    type Value = f64;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<f64, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FloatSeed {
    type Value = f64;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(r#"a number, "nan", "inf" or "-inf""#)
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<f64, E> {
        Ok(v)
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<f64, E> {
        Ok(v as f64)
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<f64, E> {
        Ok(v as f64)
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<f64, E> {
        match v {
            "nan" => Ok(f64::NAN),
            "inf" => Ok(f64::INFINITY),
            "-inf" => Ok(f64::NEG_INFINITY),
            other => Err(E::custom(format!("bad float {:?}", shorten(other)))),
        }
    }
}

/// At most the first 64 characters of `s`, for error messages about hostile input.
pub(crate) fn shorten(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}
