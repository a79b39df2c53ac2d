//! Building the tree a record describes, once [`super::tree_census`] has checked it.
//!
//! The census has already refused every malformed record and counted every dict, list
//! and tuple, so each is allocated at its exact size and no intermediate form of the
//! tree is ever built; what can still fail here is a tensor reference (missing, or used
//! twice), an alias to a tensor not taken before it, and a dict key given twice.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::tree_census::{DocField, DocKey, TreeCensus};
use super::tree_meta::{bad, node_kind, FloatSeed, KeySeed, Kind};
use crate::error::{Error, Result};
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
    if census.fast {
        return super::fast_tree::decode(text, census, tensors);
    }
    let mut ctx = Ctx {
        lengths: census.lengths.iter(),
        tensors: Aliasing::new(census, tensors),
        failure: None,
    };
    let mut de = serde_json::Deserializer::from_str(text);
    let built = BuildDoc(&mut ctx).deserialize(&mut de).and_then(|root| {
        de.end()?;
        Ok(root)
    });
    match (built, ctx.failure.take()) {
        (_, Some(failure)) => Err(failure),
        (Ok(root), None) => Ok(root),
        (Err(e), None) => Err(bad(format!("not a valid tree record: {e}"))),
    }
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

/// What every level of the build shares.
struct Ctx<'c> {
    /// The census's container lengths, consumed in the same order.
    lengths: std::slice::Iter<'c, u32>,
    tensors: Aliasing<'c>,
    /// An error of ours raised inside the parse (serde's errors carry only text).
    failure: Option<Error>,
}

impl Ctx<'_> {
    fn next_len(&mut self) -> usize {
        self.lengths.next().copied().unwrap_or(0) as usize
    }
}

/// The document; returns the root.
struct BuildDoc<'a, 'c>(&'a mut Ctx<'c>);

impl<'de> DeserializeSeed<'de> for BuildDoc<'_, '_> {
    type Value = Node;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Node, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BuildDoc<'_, '_> {
    type Value = Node;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a tree record object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Node, A::Error> {
        use serde::de::Error as _;
        let mut root = None;
        while let Some(key) = map.next_key_seed(DocKey)? {
            match key {
                DocField::Tree if root.is_none() => {
                    root = Some(map.next_value_seed(BuildNode {
                        ctx: &mut *self.0,
                        depth: 0,
                    })?);
                }
                DocField::Tree => return Err(A::Error::duplicate_field("tree")),
                DocField::Format | DocField::Other => map.next_value::<IgnoredAny>().map(drop)?,
            }
        }
        root.ok_or_else(|| A::Error::missing_field("tree"))
    }
}

/// One node at `depth`.
struct BuildNode<'a, 'c> {
    ctx: &'a mut Ctx<'c>,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for BuildNode<'_, '_> {
    type Value = Node;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Node, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BuildNode<'_, '_> {
    type Value = Node;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a node object with one key")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Node, A::Error> {
        use serde::de::Error as _;
        let kind = node_kind(&mut map, self.depth)?;
        let (ctx, depth) = (self.ctx, self.depth);
        let node = match kind {
            Kind::Dict => Node::Dict(map.next_value_seed(BuildDict { ctx, depth })?),
            Kind::List => Node::List(map.next_value_seed(BuildItems { ctx, depth })?),
            Kind::Tuple => Node::Tuple(map.next_value_seed(BuildItems { ctx, depth })?),
            Kind::Tensor => Node::Tensor(map.next_value_seed(TakeTensor { ctx, alias: false })?),
            Kind::Alias => Node::Tensor(map.next_value_seed(TakeTensor { ctx, alias: true })?),
            Kind::None => map.next_value::<()>().map(|()| Node::Value(Value::None))?,
            Kind::Bool => Node::Value(Value::Bool(map.next_value()?)),
            Kind::Int => Node::Value(Value::Int(map.next_value()?)),
            Kind::Float => Node::Value(Value::Float(map.next_value_seed(FloatSeed)?)),
            Kind::Str => Node::Value(Value::Str(map.next_value()?)),
        };
        if map.next_key::<IgnoredAny>()?.is_some() {
            return Err(A::Error::custom("a node object has more than one key"));
        }
        Ok(node)
    }
}

/// The items of a list or tuple whose node is at `depth`, at their exact count.
struct BuildItems<'a, 'c> {
    ctx: &'a mut Ctx<'c>,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for BuildItems<'_, '_> {
    type Value = Vec<Node>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Vec<Node>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for BuildItems<'_, '_> {
    type Value = Vec<Node>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of nodes")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Vec<Node>, A::Error> {
        let mut items = Vec::with_capacity(self.ctx.next_len());
        while let Some(node) = seq.next_element_seed(BuildNode {
            ctx: &mut *self.ctx,
            depth: self.depth + 1,
        })? {
            items.push(node);
        }
        Ok(items)
    }
}

/// The entries of a dict whose node is at `depth`, at their exact count.
struct BuildDict<'a, 'c> {
    ctx: &'a mut Ctx<'c>,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for BuildDict<'_, '_> {
    type Value = TensorDict;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<TensorDict, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for BuildDict<'_, '_> {
    type Value = TensorDict;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of [key, node] pairs")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<TensorDict, A::Error> {
        use serde::de::Error as _;
        let len = self.ctx.next_len();
        // Collected straight from the parser: the dict reserves `len` once, from the hint.
        let mut pairs = Pairs {
            seq: &mut seq,
            ctx: &mut *self.ctx,
            depth: self.depth + 1,
            left: len,
            failure: None,
            input: PhantomData,
        };
        let dict: TensorDict = pairs.by_ref().collect();
        if let Some(e) = pairs.failure {
            return Err(e);
        }
        if dict.len() != len {
            return Err(A::Error::custom(
                "a dict of the tree has the same key twice",
            ));
        }
        Ok(dict)
    }
}

/// The `[key, node]` pairs of a dict as an iterator; the first error ends it and is kept.
struct Pairs<'s, 'c, 'de, A: SeqAccess<'de>> {
    seq: &'s mut A,
    ctx: &'s mut Ctx<'c>,
    depth: usize,
    left: usize,
    failure: Option<A::Error>,
    input: PhantomData<&'de ()>,
}

impl<'de, A: SeqAccess<'de>> Iterator for Pairs<'_, '_, 'de, A> {
    type Item = (DictKey, Node);
    fn next(&mut self) -> Option<(DictKey, Node)> {
        if self.failure.is_some() {
            return None;
        }
        let seed = BuildPair {
            ctx: &mut *self.ctx,
            depth: self.depth,
        };
        match self.seq.next_element_seed(seed) {
            Ok(Some(pair)) => {
                self.left = self.left.saturating_sub(1);
                Some(pair)
            }
            Ok(None) => None,
            Err(e) => {
                self.failure = Some(e);
                None
            }
        }
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, None)
    }
}

/// One `[key, node]` pair, the node at `depth`.
struct BuildPair<'a, 'c> {
    ctx: &'a mut Ctx<'c>,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for BuildPair<'_, '_> {
    type Value = (DictKey, Node);
    fn deserialize<D: Deserializer<'de>>(
        self,
        d: D,
    ) -> std::result::Result<(DictKey, Node), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for BuildPair<'_, '_> {
    type Value = (DictKey, Node);
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a [key, node] pair")
    }
    fn visit_seq<A: SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<(DictKey, Node), A::Error> {
        use serde::de::Error as _;
        let key = seq
            .next_element_seed(KeySeed)?
            .ok_or_else(|| A::Error::invalid_length(0, &"a [key, node] pair"))?;
        let node = seq
            .next_element_seed(BuildNode {
                ctx: self.ctx,
                depth: self.depth,
            })?
            .ok_or_else(|| A::Error::invalid_length(1, &"a [key, node] pair"))?;
        if seq.next_element::<IgnoredAny>()?.is_some() {
            return Err(A::Error::invalid_length(3, &"a [key, node] pair"));
        }
        Ok((key, node))
    }
}

/// A tensor reference: the tensor, taken from the source, or for an alias the tensor an
/// earlier reference took.
struct TakeTensor<'a, 'c> {
    ctx: &'a mut Ctx<'c>,
    alias: bool,
}

impl<'de> DeserializeSeed<'de> for TakeTensor<'_, '_> {
    type Value = Tensor;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Tensor, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for TakeTensor<'_, '_> {
    type Value = Tensor;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a tensor name")
    }
    fn visit_str<E: serde::de::Error>(self, name: &str) -> std::result::Result<Tensor, E> {
        let ctx = self.ctx;
        let taken = if self.alias {
            ctx.tensors.alias(name)
        } else {
            ctx.tensors.take(name)
        };
        taken.map_err(|e| {
            ctx.failure = Some(e);
            E::custom("tensor reference failed")
        })
    }
}
