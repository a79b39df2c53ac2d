//! The fast reader of the tree records tensorferry writes, in two passes over borrowed
//! text: [`count`] checks the record against its regular form (the document as
//! `{"format":1,"tree":NODE}` or format 2, every node of a kind other than `float`, keys,
//! names and strings without escapes, integer keys) and takes the census [`super::tree_census`] takes; [`decode`]
//! then builds the tree with containers at their exact sizes, taking tensors by names
//! borrowed from the text. A record outside the regular form makes [`count`] say `None`,
//! and the `serde_json` readers, which accept all of it and word every error, take over.

use super::scan::Cursor;
use super::tree_census::TreeCensus;
use super::tree_decode::{Aliasing, TensorSource};
use super::tree_meta::{bad, decimal_len, version_understood, Kind, MAX_DEPTH};
use crate::error::Result;
use crate::tree::{DictKey, Node, TensorDict, Value};

/// Checks and counts the record `text`: the fast way when it is regular, else with the
/// `serde_json` census, which words every fault.
pub(crate) fn census(text: &str) -> Result<TreeCensus> {
    match count(text) {
        Some(census) => Ok(census),
        None => super::tree_census::count_tree(text),
    }
}

/// Checks and counts the regular record `text`; `None` when it is not regular.
pub(crate) fn count(text: &str) -> Option<TreeCensus> {
    let mut census = TreeCensus {
        fast: true,
        ..TreeCensus::default()
    };
    let mut c = document(text)?;
    count_node(&mut c, &mut census, 0)?;
    c.eat(b'}')?;
    c.finish()?;
    census.lengths.shrink_to_fit();
    census.settle_aliases();
    Some(census)
}

/// A cursor at the root node of the document `text`.
fn document(text: &str) -> Option<Cursor<'_>> {
    let mut c = Cursor::new(text);
    c.eat(b'{')?;
    (c.plain_str()? == "format").then_some(())?;
    c.eat(b':')?;
    version_understood(c.uint()?).then_some(())?;
    c.eat(b',')?;
    (c.plain_str()? == "tree").then_some(())?;
    c.eat(b':')?;
    Some(c)
}

/// The kind of the node object starting at the cursor, which moves to its value.
fn kind(c: &mut Cursor<'_>, depth: usize) -> Option<Kind> {
    if depth > MAX_DEPTH {
        return None;
    }
    c.eat(b'{')?;
    let kind = Kind::from_name(c.plain_str()?)?;
    c.eat(b':')?;
    Some(kind)
}

/// Calls `each` for every item of the array starting at the cursor; returns their count.
fn items<'a>(
    c: &mut Cursor<'a>,
    mut each: impl FnMut(&mut Cursor<'a>) -> Option<()>,
) -> Option<u32> {
    c.eat(b'[')?;
    if c.eat_if(b']') {
        return Some(0);
    }
    let mut n = 0u32;
    loop {
        each(c)?;
        n = n.checked_add(1)?;
        if !c.more(b']')? {
            return Some(n);
        }
    }
}

/// A dict key as the text holds it.
enum Key<'a> {
    Str(&'a str),
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

impl From<Key<'_>> for DictKey {
    fn from(key: Key<'_>) -> DictKey {
        match key {
            Key::Str(s) => s.into(),
            Key::Int(i) => i.into(),
        }
    }
}

/// The key of a `[key, node]` pair, the cursor moved to the node.
fn pair_key<'a>(c: &mut Cursor<'a>) -> Option<Key<'a>> {
    c.eat(b'[')?;
    let key = if c.peek()? == b'"' {
        Key::Str(c.plain_str()?)
    } else {
        Key::Int(c.int()?)
    };
    c.eat(b',')?;
    Some(key)
}

fn count_node(c: &mut Cursor<'_>, census: &mut TreeCensus, depth: usize) -> Option<()> {
    match kind(c, depth)? {
        k @ (Kind::Dict | Kind::List | Kind::Tuple) => {
            let slot = census.lengths.len();
            census.lengths.push(0);
            let n = if k == Kind::Dict {
                items(c, |c| {
                    let key = pair_key(c)?;
                    census.saw_string(key.len());
                    census.string_bytes += key.len() as u64;
                    count_node(c, census, depth + 1)?;
                    c.eat(b']')
                })?
            } else {
                items(c, |c| count_node(c, census, depth + 1))?
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
            let len = c.plain_str()?.len();
            census.saw_string(len);
            if k == Kind::Str {
                census.string_bytes += len as u64;
            }
        }
        Kind::Alias => {
            let name = c.plain_str()?;
            census.saw_string(name.len());
            census.aliased.push(name.to_string());
        }
        Kind::None => c.word("null")?,
        Kind::Bool => bool_value(c).map(drop)?,
        Kind::Int => c.int().map(drop)?,
        Kind::Float => return None,
    }
    c.eat(b'}')
}

fn bool_value(c: &mut Cursor<'_>) -> Option<bool> {
    match c.peek()? {
        b't' => c.word("true").map(|()| true),
        _ => c.word("false").map(|()| false),
    }
}

/// Builds the tree of the record `text`, which [`count`] counted as `census`, taking
/// each tensor it names from `tensors`.
pub(crate) fn decode(
    text: &str,
    census: &TreeCensus,
    tensors: &mut dyn TensorSource,
) -> Result<Node> {
    let mut build = Build {
        lengths: census.lengths.iter(),
        tensors: Aliasing::new(census, tensors),
    };
    let unexpected = || bad("the tree record changed between its census and its decoding");
    let mut c = document(text).ok_or_else(unexpected)?;
    build.node(&mut c, 0)?.ok_or_else(unexpected)
}

/// What every level of a decoding shares.
struct Build<'c> {
    lengths: std::slice::Iter<'c, u32>,
    tensors: Aliasing<'c>,
}

impl Build<'_> {
    fn next_len(&mut self) -> usize {
        self.lengths.next().copied().unwrap_or(0) as usize
    }

    /// The node at the cursor; `Ok(None)` where the text is not what [`count`] checked.
    fn node(&mut self, c: &mut Cursor<'_>, depth: usize) -> Result<Option<Node>> {
        let Some(kind) = kind(c, depth) else {
            return Ok(None);
        };
        let node = match kind {
            Kind::Dict => match self.dict(c, depth)? {
                Some(d) => Node::Dict(d),
                None => return Ok(None),
            },
            k @ (Kind::List | Kind::Tuple) => {
                let mut nodes = Vec::with_capacity(self.next_len());
                let mut failure = None;
                let read = items(c, |c| match self.node(c, depth + 1) {
                    Ok(node) => node.map(|n| nodes.push(n)),
                    Err(e) => {
                        failure = Some(e);
                        None
                    }
                });
                if let Some(e) = failure {
                    return Err(e);
                }
                if read.is_none() {
                    return Ok(None);
                }
                if k == Kind::List {
                    Node::List(nodes)
                } else {
                    Node::Tuple(nodes)
                }
            }
            Kind::Tensor => match c.plain_str() {
                Some(name) => Node::Tensor(self.tensors.take(name)?),
                None => return Ok(None),
            },
            Kind::Alias => match c.plain_str() {
                Some(name) => Node::Tensor(self.tensors.alias(name)?),
                None => return Ok(None),
            },
            leaf => match value(c, leaf) {
                Some(v) => Node::Value(v),
                None => return Ok(None),
            },
        };
        Ok(c.eat(b'}').map(|()| node))
    }

    /// The entries of a dict, at their exact count; a key given twice is an error.
    fn dict(&mut self, c: &mut Cursor<'_>, depth: usize) -> Result<Option<TensorDict>> {
        let len = self.next_len();
        let mut failure = None;
        let mut broken = false;
        let dict: TensorDict = DictPairs {
            build: self,
            c,
            depth,
            left: len,
            started: false,
            failure: &mut failure,
            broken: &mut broken,
        }
        .collect();
        if let Some(e) = failure {
            return Err(e);
        }
        if broken {
            return Ok(None);
        }
        if dict.len() != len {
            return Err(bad(
                "not a valid tree record: a dict of the tree has the same key twice",
            ));
        }
        Ok(Some(dict))
    }
}

/// A plain value of kind `kind`.
fn value(c: &mut Cursor<'_>, kind: Kind) -> Option<Value> {
    Some(match kind {
        Kind::None => c.word("null").map(|()| Value::None)?,
        Kind::Bool => Value::Bool(bool_value(c)?),
        Kind::Int => Value::Int(c.int()?),
        Kind::Str => Value::Str(c.plain_str()?.to_string()),
        _ => return None,
    })
}

/// The `[key, node]` pairs of a dict as an iterator (so the dict reserves its size once);
/// an error or a text not as counted ends it and is kept.
struct DictPairs<'b, 'c, 't> {
    build: &'b mut Build<'c>,
    c: &'b mut Cursor<'t>,
    depth: usize,
    left: usize,
    started: bool,
    failure: &'b mut Option<crate::Error>,
    broken: &'b mut bool,
}

impl DictPairs<'_, '_, '_> {
    /// The next pair; `Ok(None)` at the end, `Err(None)` where the text is not as counted.
    fn pair(&mut self) -> std::result::Result<Option<(DictKey, Node)>, Option<crate::Error>> {
        let c = &mut *self.c;
        if !self.started {
            self.started = true;
            c.eat(b'[').ok_or(None)?;
            if c.eat_if(b']') {
                return Ok(None);
            }
        } else if !c.more(b']').ok_or(None)? {
            return Ok(None);
        }
        let key = pair_key(c).ok_or(None)?;
        let node = self
            .build
            .node(c, self.depth + 1)
            .map_err(Some)?
            .ok_or(None)?;
        c.eat(b']').ok_or(None)?;
        Ok(Some((key.into(), node)))
    }
}

impl Iterator for DictPairs<'_, '_, '_> {
    type Item = (DictKey, Node);
    fn next(&mut self) -> Option<(DictKey, Node)> {
        if self.failure.is_some() || *self.broken {
            return None;
        }
        match self.pair() {
            Ok(pair) => {
                self.left = self.left.saturating_sub(1);
                pair
            }
            Err(Some(e)) => {
                *self.failure = Some(e);
                None
            }
            Err(None) => {
                *self.broken = true;
                None
            }
        }
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::tree_census::count_tree;

    #[test]
    fn the_regular_form_is_counted_as_the_serde_census_counts_it() {
        let record = r#"{"format":1,"tree":{"dict":[["a",{"list":[{"int":-1},{"none":null},{"bool":true}]}],["b",{"tensor":"b"}],["c",{"str":"xyz"}],["d",{"tuple":[]}],["e",{"dict":[]}]]}}"#;
        let fast = count(record).unwrap();
        let slow = count_tree(record).unwrap();
        assert_eq!(fast.lengths, slow.lengths);
        assert_eq!(
            (fast.dicts, fast.dict_entries, fast.sequences, fast.items),
            (slow.dicts, slow.dict_entries, slow.sequences, slow.items)
        );
        assert_eq!(
            (fast.string_bytes, fast.longest_string),
            (slow.string_bytes, slow.longest_string)
        );
    }

    /// Hands out a one-byte tensor for each of `names`, each once.
    struct Names(Vec<&'static str>);

    impl TensorSource for Names {
        fn take(&mut self, name: &str) -> Result<crate::Tensor> {
            let at = self
                .0
                .iter()
                .position(|n| *n == name)
                .ok_or_else(|| bad("no"))?;
            self.0.remove(at);
            crate::Tensor::from_bytes(crate::DType::U8, vec![1], &[7])
        }
    }

    /// Both decoders, on the record each census counted.
    fn both(record: &str) -> (String, String) {
        let fast = count(record).map_or(Ok(Node::Value(Value::None)), |c| {
            decode(record, &c, &mut Names(vec!["a", "b"]))
        });
        let slow = count_tree(record).and_then(|c| {
            super::super::tree_decode::decode(record, &c, &mut Names(vec!["a", "b"]))
        });
        (format!("{fast:?}"), format!("{slow:?}"))
    }

    #[test]
    fn both_decoders_build_the_same_tree_or_the_same_refusal() {
        let record = r#"{"format":1,"tree":{"dict":[["x",{"list":[{"int":-1},{"tensor":"b"},{"bool":false}]}],["y",{"tensor":"a"}],["z",{"tuple":[{"str":"s"},{"dict":[]}]}]]}}"#;
        let (fast, slow) = both(record);
        assert_eq!(fast, slow);
        assert!(fast.starts_with("Ok("), "{fast}");
        let bytes = record.as_bytes();
        for at in 0..bytes.len() {
            for b in *b"\"{}[],:01-ab" {
                let mut changed = bytes.to_vec();
                changed[at] = b;
                let Ok(text) = std::str::from_utf8(&changed) else {
                    continue;
                };
                if count(text).is_some() {
                    let (fast, slow) = both(text);
                    // Refusals are worded differently; trees and the fact of refusing agree.
                    assert_eq!(fast.starts_with("Ok("), slow.starts_with("Ok("), "{text}");
                    if fast.starts_with("Ok(") {
                        assert_eq!(fast, slow, "{text}");
                    }
                }
            }
        }
    }

    #[test]
    fn other_forms_are_left_to_the_serde_reader() {
        for record in [
            r#"{"tree":{"none":null},"format":1}"#,
            r#"{"format":1,"tree":{"float":1.5}}"#,
            r#"{"format":1,"tree":{"str":"a\"b"}}"#,
            r#"{"format":3,"tree":{"none":null}}"#,
            r#"{"format":1,"tree":{"none":null},"x":1}"#,
            r#"{"format":1,"tree":{"int":1,"str":"x"}}"#,
            r#"{"format":1,"tree":{"dict":[["a"]]}}"#,
        ] {
            assert!(count(record).is_none(), "{record}");
        }
    }
}
