//! `tensorferry inspect FILE [--json]`.

use std::path::Path;

use serde_json::json;
use tensorferry::{load_node, LoadOptions};

/// Prints what the file holds: a table, or JSON.
pub fn run(file: &Path, as_json: bool) -> tensorferry::Result<()> {
    // Mapping costs the header only; no tensor byte is read.
    let loaded = load_node(
        file,
        LoadOptions {
            mmap: true,
            direct: false,
            ..Default::default()
        },
    )?;
    let tensors = loaded.root.tensors();
    if as_json {
        let rows: Vec<_> = tensors
            .iter()
            .map(|(path, t)| {
                json!({
                    "path": path.0,
                    "name": path.dotted(),
                    "dtype": t.dtype().name(),
                    "shape": t.shape(),
                    "bytes": t.nbytes(),
                })
            })
            .collect();
        let total: usize = tensors.iter().map(|(_, t)| t.nbytes()).sum();
        let doc = json!({"tensors": rows, "total_bytes": total, "metadata": loaded.metadata});
        println!(
            "{}",
            serde_json::to_string_pretty(&doc).expect("serialisable")
        );
        return Ok(());
    }
    let width = tensors
        .iter()
        .map(|(p, _)| p.to_string().len())
        .max()
        .unwrap_or(4)
        .max(4);
    println!(
        "{:<width$}  {:<13}  {:<20}  {:>12}",
        "path", "dtype", "shape", "bytes"
    );
    let mut total = 0;
    for (path, t) in &tensors {
        total += t.nbytes();
        println!(
            "{:<width$}  {:<13}  {:<20}  {:>12}",
            path.to_string(),
            t.dtype().name(),
            format!("{:?}", t.shape()),
            t.nbytes()
        );
    }
    println!("{} tensors, {} bytes", tensors.len(), total);
    for (k, v) in &loaded.metadata {
        println!("metadata {k}: {v}");
    }
    Ok(())
}
