//! Recording a tree's nesting and plain values in a header's `__metadata__`, and
//! reading them back with every reference checked.
//!
//! Encoding (JSON): `{"format": 1, "tree": NODE}` where NODE is one of
//! `{"dict": [[key, NODE], …]}`, `{"list": [NODE, …]}`, `{"tuple": [NODE, …]}`,
//! `{"tensor": name}`, `{"none": null}`, `{"bool": b}`, `{"int": i}`,
//! `{"float": x | "nan" | "inf" | "-inf"}`, `{"str": s}`.

use std::collections::HashMap;

use serde_json::{json, Value as Json};

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::tree::{Node, TensorDict, Value};

const FORMAT_VERSION: u64 = 1;
const WHERE: &str = "__metadata__.tensorferry";

fn bad(reason: impl Into<String>) -> Error {
    Error::Format {
        at: WHERE.into(),
        reason: reason.into(),
    }
}

/// Encodes `root`; `name_of` gives the file name of each tensor, in tree order.
pub(crate) fn encode(root: &Node, names: &mut impl Iterator<Item = String>) -> String {
    json!({"format": FORMAT_VERSION, "tree": encode_node(root, names)}).to_string()
}

fn encode_node(node: &Node, names: &mut impl Iterator<Item = String>) -> Json {
    match node {
        Node::Dict(d) => json!({"dict": d
            .iter()
            .map(|(k, v)| json!([k, encode_node(v, names)]))
            .collect::<Vec<_>>()}),
        Node::List(items) => {
            json!({"list": items.iter().map(|v| encode_node(v, names)).collect::<Vec<_>>()})
        }
        Node::Tuple(items) => {
            json!({"tuple": items.iter().map(|v| encode_node(v, names)).collect::<Vec<_>>()})
        }
        Node::Tensor(_) => json!({"tensor": names.next().expect("one name per tensor")}),
        Node::Value(v) => match v {
            Value::None => json!({"none": null}),
            Value::Bool(b) => json!({"bool": b}),
            Value::Int(i) => json!({"int": i}),
            Value::Float(x) if x.is_nan() => json!({"float": "nan"}),
            Value::Float(x) if x.is_infinite() => {
                json!({"float": if *x > 0.0 { "inf" } else { "-inf" }})
            }
            Value::Float(x) => json!({"float": x}),
            Value::Str(s) => json!({"str": s}),
        },
    }
}

/// Rebuilds the tree recorded in `text`, taking each referenced tensor out of `tensors`;
/// every tensor must be referenced exactly once.
pub(crate) fn decode(text: &str, mut tensors: HashMap<String, Tensor>) -> Result<Node> {
    let doc: Json = serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    match doc.get("format").and_then(Json::as_u64) {
        Some(FORMAT_VERSION) => {}
        other => return Err(bad(format!("unsupported format version {other:?}"))),
    }
    let tree = doc.get("tree").ok_or_else(|| bad("missing \"tree\""))?;
    let root = decode_node(tree, &mut tensors, 0)?;
    if let Some(name) = tensors.keys().next() {
        return Err(bad(format!(
            "tensor {name:?} is in the file but not in the recorded tree"
        )));
    }
    Ok(root)
}

/// Deepest tree recorded: deeper ones would exceed the JSON parser's nesting limit.
pub(crate) const MAX_DEPTH: usize = 40;

fn decode_node(node: &Json, tensors: &mut HashMap<String, Tensor>, depth: usize) -> Result<Node> {
    if depth > MAX_DEPTH {
        return Err(bad(format!("tree nested deeper than {MAX_DEPTH} levels")));
    }
    let obj = node
        .as_object()
        .filter(|o| o.len() == 1)
        .ok_or_else(|| bad(format!("node {node} must be an object with one key")))?;
    let (kind, body) = obj.iter().next().expect("one key");
    Ok(match kind.as_str() {
        "dict" => {
            let pairs = body
                .as_array()
                .ok_or_else(|| bad("dict body must be an array"))?;
            let mut d = TensorDict::new();
            for pair in pairs {
                let (k, v) = match pair.as_array().map(Vec::as_slice) {
                    Some([Json::String(k), v]) => (k, v),
                    _ => return Err(bad(format!("dict entry {pair} must be [key, node]"))),
                };
                if d.insert(k.clone(), decode_node(v, tensors, depth + 1)?)
                    .is_some()
                {
                    return Err(bad(format!("dict key {k:?} appears twice")));
                }
            }
            Node::Dict(d)
        }
        "list" => Node::List(decode_items(kind, body, tensors, depth)?),
        "tuple" => Node::Tuple(decode_items(kind, body, tensors, depth)?),
        "tensor" => {
            let name = body
                .as_str()
                .ok_or_else(|| bad("tensor reference must be a string"))?;
            Node::Tensor(tensors.remove(name).ok_or_else(|| {
                bad(format!(
                    "tree refers to tensor {name:?}, which the file lacks or uses twice"
                ))
            })?)
        }
        "none" => Node::Value(Value::None),
        "bool" => Node::Value(Value::Bool(body.as_bool().ok_or_else(|| bad("bad bool"))?)),
        "int" => Node::Value(Value::Int(body.as_i64().ok_or_else(|| bad("bad int"))?)),
        "str" => Node::Value(Value::Str(
            body.as_str().ok_or_else(|| bad("bad str"))?.to_string(),
        )),
        "float" => Node::Value(Value::Float(match body {
            Json::String(s) if s == "nan" => f64::NAN,
            Json::String(s) if s == "inf" => f64::INFINITY,
            Json::String(s) if s == "-inf" => f64::NEG_INFINITY,
            other => other
                .as_f64()
                .ok_or_else(|| bad(format!("bad float {other}")))?,
        })),
        other => return Err(bad(format!("unknown node kind {other:?}"))),
    })
}

fn decode_items(
    kind: &str,
    body: &Json,
    tensors: &mut HashMap<String, Tensor>,
    depth: usize,
) -> Result<Vec<Node>> {
    body.as_array()
        .ok_or_else(|| bad(format!("{kind} body must be an array")))?
        .iter()
        .map(|n| decode_node(n, tensors, depth + 1))
        .collect()
}
