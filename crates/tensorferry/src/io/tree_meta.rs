//! Recording a tree's nesting and plain values in a header's `__metadata__`, and
//! reading them back with every reference checked.
//!
//! Encoding (JSON): `{"format": 1, "tree": NODE}` where NODE is one of
//! `{"dict": [[key, NODE], …]}`, `{"list": [NODE, …]}`, `{"tuple": [NODE, …]}`,
//! `{"tensor": name}`, `{"none": null}`, `{"bool": b}`, `{"int": i}`,
//! `{"float": x | "nan" | "inf" | "-inf"}`, `{"str": s}`.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::tree::{Node, TensorDict, Value};

const FORMAT_VERSION: u64 = 1;
const WHERE: &str = "__metadata__.tensorferry";

/// Deepest tree recorded: deeper ones would exceed the JSON parser's nesting limit.
pub(crate) const MAX_DEPTH: usize = 40;

fn bad(reason: impl Into<String>) -> Error {
    Error::Format {
        at: WHERE.into(),
        reason: reason.into(),
    }
}

/// The recorded form of a node; serde's external tagging gives `{"kind": body}`.
#[derive(Serialize, Deserialize)]
enum Repr {
    #[serde(rename = "dict")]
    Dict(Vec<(String, Repr)>),
    #[serde(rename = "list")]
    List(Vec<Repr>),
    #[serde(rename = "tuple")]
    Tuple(Vec<Repr>),
    #[serde(rename = "tensor")]
    Tensor(String),
    #[serde(rename = "none")]
    None(()),
    #[serde(rename = "bool")]
    Bool(bool),
    #[serde(rename = "int")]
    Int(i64),
    #[serde(rename = "float")]
    Float(FloatRepr),
    #[serde(rename = "str")]
    Str(String),
}

/// A float: a JSON number when finite, else "nan", "inf" or "-inf".
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum FloatRepr {
    Finite(f64),
    Special(String),
}

#[derive(Serialize, Deserialize)]
struct Doc {
    format: u64,
    tree: Repr,
}

/// Encodes `root`; `names` gives the file name of each tensor, in tree order.
pub(crate) fn encode(root: &Node, names: &mut impl Iterator<Item = String>) -> String {
    let doc = Doc {
        format: FORMAT_VERSION,
        tree: to_repr(root, names),
    };
    serde_json::to_string(&doc).expect("a tree always serialises")
}

fn to_repr(node: &Node, names: &mut impl Iterator<Item = String>) -> Repr {
    match node {
        Node::Dict(d) => Repr::Dict(
            d.iter()
                .map(|(k, v)| (k.to_string(), to_repr(v, names)))
                .collect(),
        ),
        Node::List(items) => Repr::List(items.iter().map(|v| to_repr(v, names)).collect()),
        Node::Tuple(items) => Repr::Tuple(items.iter().map(|v| to_repr(v, names)).collect()),
        Node::Tensor(_) => Repr::Tensor(names.next().expect("one name per tensor")),
        Node::Value(v) => match v {
            Value::None => Repr::None(()),
            Value::Bool(b) => Repr::Bool(*b),
            Value::Int(i) => Repr::Int(*i),
            Value::Float(x) if x.is_nan() => Repr::Float(FloatRepr::Special("nan".into())),
            Value::Float(x) if x.is_infinite() => Repr::Float(FloatRepr::Special(
                if *x > 0.0 { "inf" } else { "-inf" }.into(),
            )),
            Value::Float(x) => Repr::Float(FloatRepr::Finite(*x)),
            Value::Str(s) => Repr::Str(s.clone()),
        },
    }
}

/// Rebuilds the tree recorded in `text`, taking each referenced tensor out of `tensors`;
/// every tensor must be referenced exactly once.
pub(crate) fn decode(text: &str, mut tensors: HashMap<String, Tensor>) -> Result<Node> {
    let doc: Doc =
        serde_json::from_str(text).map_err(|e| bad(format!("not a valid tree record: {e}")))?;
    if doc.format != FORMAT_VERSION {
        return Err(bad(format!("unsupported format version {}", doc.format)));
    }
    let root = from_repr(doc.tree, &mut tensors)?;
    if let Some(name) = tensors.keys().next() {
        return Err(bad(format!(
            "tensor {name:?} is in the file but not in the recorded tree"
        )));
    }
    Ok(root)
}

fn from_repr(repr: Repr, tensors: &mut HashMap<String, Tensor>) -> Result<Node> {
    let items = |v: Vec<Repr>, tensors: &mut HashMap<String, Tensor>| -> Result<Vec<Node>> {
        v.into_iter().map(|r| from_repr(r, tensors)).collect()
    };
    Ok(match repr {
        Repr::Dict(pairs) => {
            let mut d = TensorDict::new();
            for (k, v) in pairs {
                if d.get(&k).is_some() {
                    return Err(bad(format!("dict key {k:?} appears twice")));
                }
                let node = from_repr(v, tensors)?;
                d.insert(k, node);
            }
            Node::Dict(d)
        }
        Repr::List(v) => Node::List(items(v, tensors)?),
        Repr::Tuple(v) => Node::Tuple(items(v, tensors)?),
        Repr::Tensor(name) => Node::Tensor(tensors.remove(&name).ok_or_else(|| {
            bad(format!(
                "tree refers to tensor {name:?}, which the file lacks or uses twice"
            ))
        })?),
        Repr::None(()) => Node::Value(Value::None),
        Repr::Bool(b) => Node::Value(Value::Bool(b)),
        Repr::Int(i) => Node::Value(Value::Int(i)),
        Repr::Str(s) => Node::Value(Value::Str(s)),
        Repr::Float(FloatRepr::Finite(x)) => Node::Value(Value::Float(x)),
        Repr::Float(FloatRepr::Special(s)) => Node::Value(Value::Float(match s.as_str() {
            "nan" => f64::NAN,
            "inf" => f64::INFINITY,
            "-inf" => f64::NEG_INFINITY,
            other => return Err(bad(format!("bad float {other:?}"))),
        })),
    })
}
