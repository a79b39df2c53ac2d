//! What the file tests share: the ways of loading, and saving and loading a dict in one
//! call. Each test binary uses a part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use tensorferry::{load, save, LoadOptions, Node, SaveOptions, Tensor, TensorDict};

/// Every way of loading: mapped, read into fresh memory, read with `O_DIRECT`.
pub fn every_way() -> [LoadOptions; 3] {
    [(true, false), (false, false), (false, true)].map(|(mmap, direct)| LoadOptions {
        // SAFETY: the tests' files live in their own temporary folders; nothing truncates
        // or rewrites them while their tensors are alive.
        mmap: if mmap {
            unsafe { tensorferry::Mapping::map() }
        } else {
            tensorferry::Mapping::READ
        },
        direct,
        ..Default::default()
    })
}

/// An `f32` tensor of `shape` holding `v`.
pub fn f32s(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

/// Saves the dict `d` at `path` (`d` stays the caller's, to compare with what loads).
pub fn save_dict(d: &TensorDict, path: impl AsRef<Path>, options: &SaveOptions) {
    save(&Node::from(d.clone()), path, options).unwrap()
}

/// The dict saved at `path`, with its user metadata.
pub fn load_dict(
    path: impl AsRef<Path>,
    options: LoadOptions,
) -> (TensorDict, BTreeMap<String, String>) {
    load(path, options).unwrap().into_dict().unwrap()
}

/// Saves `tree` at `path` with the default options, which must fail; the error.
pub fn save_err(tree: impl Into<Node>, path: impl AsRef<Path>) -> tensorferry::Error {
    save(&tree.into(), path, &SaveOptions::default()).unwrap_err()
}

/// The names of the tensors of the file at `path`, sorted, as the official reader lists them.
pub fn official_names(path: impl AsRef<Path>) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    names
}

/// Writes one-dimensional `f32` tensors and `metadata` at `path` with the official writer.
pub fn write_official(
    path: impl AsRef<Path>,
    tensors: &[(&str, &[f32])],
    metadata: Option<std::collections::HashMap<String, String>>,
) {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views = tensors.iter().zip(&data).map(|((name, v), data)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![v.len()], data);
        (*name, view.unwrap())
    });
    safetensors::serialize_to_file(views, metadata, path.as_ref()).unwrap();
}
