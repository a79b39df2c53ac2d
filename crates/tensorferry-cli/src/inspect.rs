//! `tensorferry inspect FILE [--json]`.
//!
//! Names and metadata are whatever the file's author wrote: the table shows them with
//! control characters escaped ([`escaped`]), the JSON with every such character as a JSON
//! escape, so a file cannot act on the terminal that shows it.

use std::io::Write;
use std::path::Path;

use serde_json::json;
use tensorferry::{load_node, LoadOptions, Loaded};

use crate::escape::{escaped, json_escaped};
use crate::out::{Failure, Out};

/// Prints what the file holds: a table, or JSON.
pub fn run(out: &mut Out<impl Write>, file: &Path, as_json: bool) -> Result<(), Failure> {
    // Mapping costs the header only; no tensor byte is read.
    let loaded = load_node(
        file,
        LoadOptions {
            mmap: true,
            direct: false,
            ..Default::default()
        },
    )?;
    if as_json {
        print_json(out, &loaded)
    } else {
        print_table(out, &loaded)
    }
}

fn print_json(out: &mut Out<impl Write>, loaded: &Loaded) -> Result<(), Failure> {
    let tensors = loaded.root.tensors();
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
    // A tree of strings and numbers always serialises: failing to is a bug.
    let text = serde_json::to_string_pretty(&doc)
        .map_err(|e| Failure::Internal(format!("the JSON output: {e}")))?;
    writeln!(out, "{}", json_escaped(&text))
}

fn print_table(out: &mut Out<impl Write>, loaded: &Loaded) -> Result<(), Failure> {
    let tensors = loaded.root.tensors();
    let names: Vec<String> = tensors
        .iter()
        .map(|(p, _)| escaped(&p.to_string()).into_owned())
        .collect();
    let width = names
        .iter()
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(4)
        .max(4);
    writeln!(
        out,
        "{:<width$}  {:<13}  {:<20}  {:>12}",
        "path", "dtype", "shape", "bytes"
    )?;
    let mut total = 0;
    for (name, (_, t)) in names.iter().zip(&tensors) {
        total += t.nbytes();
        writeln!(
            out,
            "{:<width$}  {:<13}  {:<20}  {:>12}",
            name,
            t.dtype().name(),
            format!("{:?}", t.shape()),
            t.nbytes()
        )?;
    }
    writeln!(out, "{} tensors, {} bytes", tensors.len(), total)?;
    for (k, v) in &loaded.metadata {
        writeln!(out, "metadata {}: {}", escaped(k), escaped(v))?;
    }
    Ok(())
}
