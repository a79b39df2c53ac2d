//! Building the tree a record describes, once [`super::tree_census`] has checked it.
//!
//! The census has already refused every malformed record and counted every dict, list
//! and tuple, so each is allocated at its exact size and no intermediate form of the
//! tree is ever built; what can still fail here is a tensor reference (missing, or used
//! twice), an alias to a tensor not taken before it, and a dict key given twice.

use super::scan::{Cursor, Stop};
use super::tree_census::{float, node_end, node_kind, pair_end, pair_key, string, Key, TreeCensus};
use super::tree_meta::{bad, Kind};
use crate::error::Result;
use crate::tensor::Tensor;
use crate::tree::{DictKey, Node, TensorDict, Value};

/// Where the tensors a record refers to come from.
pub(crate) trait TensorSource {
    /// The tensor named `name`; a name unknown or already taken is an error.
    fn take(&mut self, name: &str) -> Result<Tensor>;
}

/// Rebuilds the tree recorded in `text`, which `census` counted, taking each tensor it
/// refers to from `tensors`.
pub(crate) fn decode(
    text: &str,
    census: &TreeCensus,
    tensors: &mut dyn TensorSource,
) -> Result<Node> {
    let mut build = Build {
        lengths: census.lengths.iter(),
        tensors: Aliasing::new(census, tensors),
    };
    let mut c = Cursor::at(text, census.root_at);
    build.node(&mut c, 0).map_err(|stop| match stop {
        Stop::Other(e) => e,
        Stop::Json(f) => bad(format!(
            "not a valid tree record (it changed after its census): {}",
            f.describe(text)
        )),
    })
}

/// The tensors of a record: taken from their source, and those that aliases refer to kept
/// for them, so that every alias of a name is the very tensor its `tensor` node took.
pub(crate) struct Aliasing<'c> {
    census: &'c TreeCensus,
    source: &'c mut dyn TensorSource,
    /// The tensors taken so far that aliases refer to, at their names' places in
    /// [`TreeCensus::aliased`] (empty when no alias does).
    kept: Vec<Option<Tensor>>,
}

impl<'c> Aliasing<'c> {
    pub(crate) fn new(census: &'c TreeCensus, source: &'c mut dyn TensorSource) -> Self {
        Aliasing {
            census,
            source,
            kept: vec![None; census.aliased.len()],
        }
    }

    /// The tensor of a `{"tensor": name}` node, kept when an alias refers to it.
    pub(crate) fn take(&mut self, name: &str) -> Result<Tensor> {
        let t = self.source.take(name)?;
        if let Some(at) = self.census.aliased_at(name) {
            self.kept[at] = Some(t.clone());
        }
        Ok(t)
    }

    /// The tensor of an `{"alias": name}` node: the one an earlier node took.
    pub(crate) fn alias(&self, name: &str) -> Result<Tensor> {
        self.census
            .aliased_at(name)
            .and_then(|at| self.kept[at].clone())
            .ok_or_else(|| {
                bad(format!(
                    "an alias refers to tensor {:?}, which no earlier node of the tree took",
                    super::tree_meta::shorten(name)
                ))
            })
    }
}

/// What every level of a decoding shares.
struct Build<'c> {
    /// The census's container lengths, consumed in the same order.
    lengths: std::slice::Iter<'c, u32>,
    tensors: Aliasing<'c>,
}

impl Build<'_> {
    fn next_len(&mut self) -> usize {
        self.lengths.next().copied().unwrap_or(0) as usize
    }

    /// The node at the cursor, at `depth`.
    fn node(&mut self, c: &mut Cursor<'_>, depth: usize) -> std::result::Result<Node, Stop> {
        let node = match node_kind(c, depth)? {
            Kind::Dict => Node::Dict(self.dict(c, depth)?),
            k @ (Kind::List | Kind::Tuple) => {
                let mut nodes = Vec::with_capacity(self.next_len());
                c.array("an array", |c| {
                    nodes.push(self.node(c, depth + 1)?);
                    Ok::<(), Stop>(())
                })?;
                if k == Kind::List {
                    Node::List(nodes)
                } else {
                    Node::Tuple(nodes)
                }
            }
            Kind::Tensor => Node::Tensor(self.tensors.take(&string(c)?)?),
            Kind::Alias => Node::Tensor(self.tensors.alias(&string(c)?)?),
            Kind::None => c.null().map(|()| Node::Value(Value::None))?,
            Kind::Bool => Node::Value(Value::Bool(c.bool()?)),
            Kind::Int => Node::Value(Value::Int(c.i64()?)),
            Kind::Float => Node::Value(Value::Float(float(c)?)),
            Kind::Str => Node::Value(Value::Str(string(c)?.into_owned())),
        };
        node_end(c)?;
        Ok(node)
    }

    /// The entries of a dict, at their exact count; a key given twice is an error.
    fn dict(&mut self, c: &mut Cursor<'_>, depth: usize) -> std::result::Result<TensorDict, Stop> {
        let mut dict = TensorDict::with_capacity(self.next_len());
        let mut twice = false;
        c.array("an array", |c| {
            let key = pair_key(c)?;
            let node = self.node(c, depth + 1)?;
            pair_end(c)?;
            twice |= !dict.insert_new(key.into(), node);
            Ok::<(), Stop>(())
        })?;
        if twice {
            return Err(Stop::Other(bad(
                "not a valid tree record: a dict of the tree has the same key twice",
            )));
        }
        Ok(dict)
    }
}

impl From<Key<'_>> for DictKey {
    fn from(key: Key<'_>) -> DictKey {
        match key {
            Key::Str(s) => s.into_owned().into(),
            Key::Int(i) => i.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tree_census::count;
    use super::super::tree_meta::MAX_DEPTH;
    use super::*;
    use serde_json::Value as Json;

    /// Hands out a one-byte tensor for each of `names`, each once.
    struct Names(Vec<&'static str>);

    impl TensorSource for Names {
        fn take(&mut self, name: &str) -> Result<Tensor> {
            let at = self
                .0
                .iter()
                .position(|n| *n == name)
                .ok_or_else(|| bad("no"))?;
            self.0.remove(at);
            Tensor::from_bytes(crate::DType::U8, vec![1], &[7])
        }
    }

    fn names() -> Names {
        Names(vec!["a", "b"])
    }

    /// The tree of a record parsed by `serde_json`, as the format describes it: the
    /// oracle (`None` where the record is not a tree, or uses aliases).
    fn oracle(record: &str) -> Option<Node> {
        let doc: Json = serde_json::from_str(record).ok()?;
        let version = doc.get("format")?.as_u64()?;
        (1..=2).contains(&version).then_some(())?;
        oracle_node(doc.get("tree")?, 0, &mut names())
    }

    fn oracle_node(node: &Json, depth: usize, tensors: &mut Names) -> Option<Node> {
        let object = node
            .as_object()
            .filter(|o| o.len() == 1 && depth <= MAX_DEPTH)?;
        let (kind, v) = object.iter().next()?;
        let items = |tensors: &mut Names| -> Option<Vec<Node>> {
            v.as_array()?
                .iter()
                .map(|n| oracle_node(n, depth + 1, tensors))
                .collect()
        };
        Some(match kind.as_str() {
            "dict" => {
                let mut dict = TensorDict::new();
                for pair in v.as_array()? {
                    let [key, node] = pair.as_array()?.as_slice() else {
                        return None;
                    };
                    let key: DictKey = match key {
                        Json::String(s) => s.clone().into(),
                        k => k.as_i64()?.into(),
                    };
                    let node = oracle_node(node, depth + 1, tensors)?;
                    let before = dict.len();
                    dict.insert(key, node);
                    (dict.len() > before).then_some(())?;
                }
                Node::Dict(dict)
            }
            "list" => Node::List(items(tensors)?),
            "tuple" => Node::Tuple(items(tensors)?),
            "tensor" => Node::Tensor(tensors.take(v.as_str()?).ok()?),
            "none" => v.is_null().then_some(Node::Value(Value::None))?,
            "bool" => Node::Value(Value::Bool(v.as_bool()?)),
            "int" => Node::Value(Value::Int(v.as_i64()?)),
            "float" => Node::Value(Value::Float(match v {
                Json::String(s) if s == "nan" => f64::NAN,
                Json::String(s) if s == "inf" => f64::INFINITY,
                Json::String(s) if s == "-inf" => f64::NEG_INFINITY,
                n => n.as_f64()?,
            })),
            "str" => Node::Value(Value::Str(v.as_str()?.to_string())),
            _ => return None,
        })
    }

    fn read(record: &str) -> Result<Node> {
        let census = count(record)?;
        decode(record, &census, &mut names())
    }

    const RECORD: &str = r#"{"format":2,"tree":{"dict":[["x",{"list":[{"int":-1},{"tensor":"b"},{"float":1.5e3},{"bool":false}]}],[7,{"tensor":"a"}],["z\u00e9",{"tuple":[{"str":"s\n"},{"dict":[]},{"float":"-inf"}]}]]}}"#;

    /// What this reader builds, `serde_json` reads as the same tree; what `serde_json`
    /// cannot read as JSON, this reader refuses.
    fn agrees_with_the_oracle(record: &str) -> bool {
        let mine = read(record);
        if serde_json::from_str::<Json>(record).is_err() {
            assert!(mine.is_err(), "read what is not JSON: {record}");
        }
        let Ok(tree) = mine else {
            return false;
        };
        let want = oracle(record).unwrap_or_else(|| panic!("read what is no tree: {record}"));
        assert_eq!(format!("{tree:?}"), format!("{want:?}"), "{record}");
        true
    }

    #[test]
    fn every_one_byte_change_of_a_record_is_read_as_serde_json_reads_it() {
        assert!(agrees_with_the_oracle(RECORD));
        let bytes = RECORD.as_bytes();
        let mut read = 0;
        for at in 0..bytes.len() {
            for b in *b"\"{}[],:019-ab.e" {
                let mut changed = bytes.to_vec();
                changed[at] = b;
                if let Ok(text) = std::str::from_utf8(&changed) {
                    read += usize::from(agrees_with_the_oracle(text));
                }
            }
            agrees_with_the_oracle(&RECORD[..at]);
        }
        assert!(read > 50, "only {read} changed records read");
    }

    #[test]
    fn the_tree_corpus_is_read_as_serde_json_reads_it() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/tree_record");
        for file in std::fs::read_dir(dir).unwrap() {
            let bytes = std::fs::read(file.unwrap().path()).unwrap();
            if let Some(Ok(record)) = bytes.get(1..).map(std::str::from_utf8) {
                agrees_with_the_oracle(record);
            }
        }
    }

    #[test]
    fn references_to_tensors_are_checked() {
        let twice = r#"{"format":1,"tree":{"list":[{"tensor":"a"},{"tensor":"a"}]}}"#;
        assert!(read(twice).is_err());
        let alias = r#"{"format":2,"tree":{"list":[{"tensor":"a"},{"alias":"a"}]}}"#;
        let Node::List(items) = read(alias).unwrap() else {
            panic!("not a list");
        };
        assert_eq!(items.len(), 2);
        let early = r#"{"format":2,"tree":{"list":[{"alias":"a"},{"tensor":"a"}]}}"#;
        assert!(read(early)
            .unwrap_err()
            .to_string()
            .contains("no earlier node"));
        let same_key = r#"{"format":1,"tree":{"dict":[["k",{"none":null}],["k",{"none":null}]]}}"#;
        assert!(read(same_key)
            .unwrap_err()
            .to_string()
            .contains("same key twice"));
    }

    #[test]
    fn faults_are_worded_with_their_place() {
        let e = read(r#"{"format":1,"tree":{"what":1}}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown variant `what`, expected one of `dict`, `list`"),
            "{e}"
        );
        assert!(e.contains("at line 1 column 21"), "{e}");
        let e = read(r#"{"format":1,"tree":{"int":1,"str":"x"}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a node object has more than one key"), "{e}");
        let e = read(r#"{"format":3,"tree":{"none":null}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unsupported format version 3"), "{e}");
    }
}
