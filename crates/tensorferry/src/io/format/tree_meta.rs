//! Recording a tree's nesting and plain values in a header's `__metadata__`: the format,
//! and the pieces its reader shares ([`super::tree_census`] counts a record and checks
//! it, [`super::tree_decode`] builds the tree from it); [`super::header_writer`] writes it.
//!
//! Encoding (JSON): `{"format": 1 | 2, "tree": NODE}` where NODE is one of
//! `{"dict": [[key, NODE], …]}`, `{"list": [NODE, …]}`, `{"tuple": [NODE, …]}`,
//! `{"tensor": name}`, `{"none": null}`, `{"bool": b}`, `{"int": i}`,
//! `{"float": x | "nan" | "inf" | "-inf"}`, `{"str": s}`.
//!
//! Format 2 adds two forms: a dict key that is a JSON integer (an integer key, such as
//! the parameter indices of PyTorch's optimizer state; its tensors are named by its
//! decimal text), and `{"alias": name}`, the tensor that an earlier `{"tensor": name}`
//! node (in record order) took: one tensor under several keys, its bytes stored once. A
//! writer marks a record 2 only when it uses them, so that every other file stays
//! readable by readers of format 1; readers take both.

use crate::error::Error;

/// The `__metadata__` key under which tensorferry records a tree's structure.
pub(crate) const TREE_METADATA_KEY: &str = "tensorferry";

/// The version of a record that uses nothing of format 2.
pub(crate) const FORMAT_VERSION: u64 = 1;

/// The newest version understood: integer keys and aliases.
pub(crate) const FORMAT_VERSION_NEWEST: u64 = 2;

/// True for the versions of the record this build reads.
pub(crate) fn version_understood(version: u64) -> bool {
    (FORMAT_VERSION..=FORMAT_VERSION_NEWEST).contains(&version)
}
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
    Alias,
    None,
    Bool,
    Int,
    Float,
    Str,
}

impl Kind {
    /// The kind a record names `name` (the one key of a node's object), if any.
    pub(crate) fn from_name(name: &str) -> Option<Kind> {
        KINDS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, kind)| kind)
    }
}

/// The names of the kinds, in the order a fault about an unknown one lists them.
pub(crate) const KINDS: [(&str, Kind); 10] = [
    ("dict", Kind::Dict),
    ("list", Kind::List),
    ("tuple", Kind::Tuple),
    ("tensor", Kind::Tensor),
    ("alias", Kind::Alias),
    ("none", Kind::None),
    ("bool", Kind::Bool),
    ("int", Kind::Int),
    ("float", Kind::Float),
    ("str", Kind::Str),
];

/// The length of the decimal text of `i`, which an integer key is held as.
pub(crate) fn decimal_len(i: i64) -> usize {
    let digits = i
        .unsigned_abs()
        .checked_ilog10()
        .map_or(1, |l| l as usize + 1);
    digits + usize::from(i < 0)
}

/// At most the first 64 characters of `s`, for error messages about hostile input.
pub(crate) fn shorten(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn decimal_lengths_are_those_of_the_text() {
        for i in [0i64, 7, -7, 10, -10, 99, 100, i64::MAX, i64::MIN] {
            assert_eq!(super::decimal_len(i), i.to_string().len(), "{i}");
        }
    }
}
