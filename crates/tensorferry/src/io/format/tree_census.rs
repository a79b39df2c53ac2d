//! Checking a tree record and counting its nodes, before anything is built from it.
//!
//! The record is read once, with nothing allocated but the list of container lengths
//! (and the names aliases refer to): every syntax and type fault, an unknown kind, a wrong
//! format version and a nesting deeper than [`MAX_DEPTH`] are reported here, in the order
//! of the text, so that the memory budget can be decided on exact counts and
//! [`super::tree_decode`] can allocate exactly what they say.

use super::scan::{Cursor, Number, Scan};
use super::tree_meta::{bad, decimal_len, shorten, version_understood, Kind, KINDS, MAX_DEPTH};
use crate::error::Result;

/// What a tree record holds, counted.
#[derive(Clone, Debug, Default)]
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
    /// Bytes of the longest string.
    pub(crate) longest_string: u64,
    /// The length of every dict, list and tuple, in the order the record lists them.
    pub(crate) lengths: Vec<u32>,
    /// The names `{"alias": name}` nodes refer to, sorted, each once: the decoder keeps
    /// the tensors of these names when it takes them (none for most records).
    pub(crate) aliased: Vec<String>,
    /// Where the root node starts in the record's text.
    pub(crate) root_at: usize,
}

/// Checks the record `text` and counts what it holds.
pub(crate) fn count(text: &str) -> Result<TreeCensus> {
    let mut census = TreeCensus::default();
    count_document(text, &mut census)
        .map_err(|f| bad(format!("not a valid tree record: {}", f.describe(text))))?;
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

/// The document: `{"format": 1 | 2, "tree": NODE}` (other keys skipped).
fn count_document(text: &str, census: &mut TreeCensus) -> Scan<()> {
    let (mut format, mut tree) = (false, false);
    let mut c = Cursor::new(text);
    c.object("a tree record object", |c, key| {
        match &*key {
            "format" => {
                if std::mem::replace(&mut format, true) {
                    return Err(c.fault("duplicate field `format`"));
                }
                let at = *c;
                let version = c.usize("u64")?;
                if !version_understood(version as u64) {
                    return Err(at.fault(format!("unsupported format version {version}")));
                }
            }
            "tree" => {
                if std::mem::replace(&mut tree, true) {
                    return Err(c.fault("duplicate field `tree`"));
                }
                c.peek();
                census.root_at = c.pos();
                count_node(c, census, 0)?;
            }
            _ => c.skip_value(1)?,
        }
        Ok(())
    })?;
    let missing = |field: &str| c.fault(format!("missing field `{field}`"));
    match (format, tree) {
        (false, _) => return Err(missing("format")),
        (_, false) => return Err(missing("tree")),
        _ => {}
    }
    c.finish()
}

/// The kind of the node object at the cursor at `depth`, the cursor moved to its value.
pub(crate) fn node_kind(c: &mut Cursor<'_>, depth: usize) -> Scan<Kind> {
    if depth > MAX_DEPTH {
        return Err(c.fault(format!("the tree is nested deeper than {MAX_DEPTH} levels")));
    }
    if c.peek() != Some(b'{') {
        return Err(c.wrong_type("a node object with one key"));
    }
    if c.open(b'{')? {
        return Err(c.fault("a node object has no kind"));
    }
    let at = *c;
    let name = c.key()?;
    Kind::from_name(&name).ok_or_else(|| {
        let kinds: Vec<String> = KINDS.iter().map(|(k, _)| format!("`{k}`")).collect();
        at.fault(format!(
            "unknown variant `{}`, expected one of {}",
            shorten(&name),
            kinds.join(", ")
        ))
    })
}

/// Closes a node object: it has one key.
pub(crate) fn node_end(c: &mut Cursor<'_>) -> Scan<()> {
    if c.more(b'}')? {
        return Err(c.fault("a node object has more than one key"));
    }
    Ok(())
}

fn count_node(c: &mut Cursor<'_>, census: &mut TreeCensus, depth: usize) -> Scan<()> {
    match node_kind(c, depth)? {
        k @ (Kind::Dict | Kind::List | Kind::Tuple) => {
            let slot = census.lengths.len();
            census.lengths.push(0);
            let n = if k == Kind::Dict {
                c.array("an array", |c| {
                    let len = pair_key(c)?.len();
                    census.saw_string(len);
                    census.string_bytes += len as u64;
                    count_node(c, census, depth + 1)?;
                    pair_end(c)
                })?
            } else {
                c.array("an array", |c| count_node(c, census, depth + 1))?
            };
            census.lengths[slot] = n;
            if k == Kind::Dict {
                census.dicts += 1;
                census.dict_entries += u64::from(n);
            } else {
                census.sequences += 1;
                census.items += u64::from(n);
            }
        }
        k @ (Kind::Tensor | Kind::Str) => {
            let len = string(c)?.len();
            census.saw_string(len);
            if k == Kind::Str {
                census.string_bytes += len as u64;
            }
        }
        Kind::Alias => {
            let name = string(c)?;
            census.saw_string(name.len());
            census.aliased.push(name.into_owned());
        }
        Kind::None => c.null()?,
        Kind::Bool => c.bool().map(drop)?,
        Kind::Int => c.i64().map(drop)?,
        Kind::Float => float(c).map(drop)?,
    }
    node_end(c)
}

/// The string value at the cursor.
pub(crate) fn string<'a>(c: &mut Cursor<'a>) -> Scan<std::borrow::Cow<'a, str>> {
    if c.peek() != Some(b'"') {
        return Err(c.wrong_type("a string"));
    }
    c.str()
}

/// A dict key as the text holds it.
pub(crate) enum Key<'a> {
    /// A string key.
    Str(std::borrow::Cow<'a, str>),
    /// An integer key (format 2).
    Int(i64),
}

impl Key<'_> {
    /// The length of the key's text, as held in a dict.
    fn len(&self) -> usize {
        match self {
            Key::Str(s) => s.len(),
            Key::Int(i) => decimal_len(*i),
        }
    }
}

/// The key of a `[key, node]` pair, the cursor moved to the node.
pub(crate) fn pair_key<'a>(c: &mut Cursor<'a>) -> Scan<Key<'a>> {
    const PAIR: &str = "a [key, node] pair";
    if c.peek() != Some(b'[') {
        return Err(c.wrong_type(PAIR));
    }
    if c.open(b'[')? {
        return Err(c.fault(format!("invalid length 0, expected {PAIR}")));
    }
    const WANT: &str = "a dict key (a string or an integer)";
    let at = *c;
    let key =
        match c.peek() {
            Some(b'"') => Key::Str(c.str()?),
            Some(b'-' | b'0'..=b'9') => match c.number()? {
                Number::I(i) => Key::Int(i),
                Number::U(u) => Key::Int(i64::try_from(u).map_err(|_| {
                    at.fault(format!("the integer key {u} does not fit in 64 bits"))
                })?),
                Number::F(_) => return Err(at.wrong_type(WANT)),
            },
            _ => return Err(c.wrong_type(WANT)),
        };
    if !c.more(b']')? {
        return Err(c.fault(format!("invalid length 1, expected {PAIR}")));
    }
    Ok(key)
}

/// Closes a `[key, node]` pair.
pub(crate) fn pair_end(c: &mut Cursor<'_>) -> Scan<()> {
    if c.more(b']')? {
        return Err(c.fault("invalid length 3, expected a [key, node] pair"));
    }
    Ok(())
}

/// A float: a JSON number, or "nan", "inf", "-inf".
pub(crate) fn float(c: &mut Cursor<'_>) -> Scan<f64> {
    match c.peek() {
        Some(b'-' | b'0'..=b'9') => Ok(match c.number()? {
            Number::U(u) => u as f64,
            Number::I(i) => i as f64,
            Number::F(f) => f,
        }),
        Some(b'"') => {
            let at = *c;
            match &*c.str()? {
                "nan" => Ok(f64::NAN),
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                other => Err(at.fault(format!("bad float {:?}", shorten(other)))),
            }
        }
        _ => Err(c.wrong_type(r#"a number, "nan", "inf" or "-inf""#)),
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
        let c = count(&record(
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
            let e = count(&bad).unwrap_err();
            assert!(matches!(e, crate::Error::Format { .. }), "{bad}: {e}");
        }
    }

    #[test]
    fn integer_keys_and_aliases_are_counted() {
        let c = count(
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
            assert!(count(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn nesting_is_bounded_by_the_walk_itself() {
        let mut tree = String::from(r#"{"none":null}"#);
        for _ in 0..MAX_DEPTH {
            tree = format!(r#"{{"list":[{tree}]}}"#);
        }
        assert!(count(&record(&tree)).is_ok());
        let deeper = format!(r#"{{"list":[{tree}]}}"#);
        let e = count(&record(&deeper)).unwrap_err();
        assert!(e.to_string().contains("deeper than 40"), "{e}");
    }
}
