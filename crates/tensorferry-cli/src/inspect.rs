//! `tensorferry inspect PATH [--json]`: the tensors of a checkpoint and their totals.
//!
//! A file is read as `load` reads it (mapped: only its header is read), so a tree
//! saved by tensorferry shows its nested paths and a tied tensor (stored once) shows at
//! each of its places. A sharded checkpoint is read from its index and its shards' headers
//! alone, whatever their size: a row per tensor each shard stores, named as in the files.
//! Totals count what the files store: a tied tensor once.
//!
//! Names and metadata are whatever the file's author wrote: the table shows them with
//! control characters escaped ([`escaped`]), the JSON with every such character as a JSON
//! escape, so a file cannot act on the terminal that shows it.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::json;
use tensorferry::internal::io::{read_header, shard_files};
use tensorferry::{load, LoadOptions};

use crate::escape::{escaped, json_escaped};
use crate::out::{Failure, Out};

/// Prints what the checkpoint at `path` holds: a table, or JSON.
pub fn run(out: &mut Out<impl Write>, path: &Path, as_json: bool) -> Result<(), Failure> {
    let checkpoint = match shard_files(path)? {
        Some((index, mut shards)) => {
            // model-00001-of-0000N first, as a listing of the folder shows them.
            shards.sort();
            Checkpoint::of_shards(index, &shards)?
        }
        None => Checkpoint::of_file(path)?,
    };
    if as_json {
        print_json(out, &checkpoint)
    } else {
        print_table(out, &checkpoint)
    }
}

/// One tensor of the checkpoint.
struct Row {
    /// Its key path (for a shard, the one name the file gives it).
    path: Vec<String>,
    /// Its name in the file (the path joined with ".").
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: u64,
    /// The shard that stores it, for a sharded checkpoint.
    file: Option<String>,
    /// For a tied tensor's other places: the name under which the file stores it.
    same_as: Option<String>,
}

/// Tensors and bytes, of one dtype or one file or all.
#[derive(Default, Clone, Copy)]
struct Total {
    tensors: u64,
    bytes: u64,
}

impl Total {
    fn add(&mut self, bytes: u64) {
        self.tensors += 1;
        self.bytes += bytes;
    }
}

/// What makes two tensors of one load the same tensor: address, dtype, shape and strides.
type View = (usize, &'static str, Vec<usize>, Vec<isize>);

/// What inspect shows of a checkpoint.
struct Checkpoint {
    rows: Vec<Row>,
    metadata: BTreeMap<String, String>,
    /// The index, for a sharded checkpoint.
    index: Option<PathBuf>,
    /// Every shard's file name and totals, in the index's order.
    shards: Vec<(String, Total)>,
}

impl Checkpoint {
    /// One safetensors file (or the one in a folder), mapped: its header is all it reads.
    fn of_file(path: &Path) -> Result<Self, Failure> {
        let loaded = load(
            path,
            LoadOptions {
                // SAFETY: the command reads the header from the map and never a tensor's
                // bytes, and the map lives only for this one command: a file truncated in
                // those moments ends the command with SIGBUS, the risk `inspect` takes so
                // as not to read a file of many gigabytes to print its header.
                mmap: unsafe { tensorferry::Mapping::map() },
                direct: false,
                ..Default::default()
            },
        )?;
        // A tied tensor is one tensor at several places: the first is the stored one.
        let mut stored: HashMap<View, String> = HashMap::new();
        let rows = loaded
            .root
            .tensors()
            .into_iter()
            .map(|(path, t)| {
                let name = path.dotted();
                let same_as = if t.nbytes() == 0 {
                    None
                } else {
                    let view = (
                        t.data_ptr() as usize,
                        t.dtype().name(),
                        t.shape().to_vec(),
                        t.strides().to_vec(),
                    );
                    match stored.get(&view) {
                        Some(first) => Some(first.clone()),
                        None => {
                            stored.insert(view, name.clone());
                            None
                        }
                    }
                };
                Row {
                    path: path.0,
                    name,
                    dtype: t.dtype().name(),
                    shape: t.shape().to_vec(),
                    bytes: t.nbytes() as u64,
                    file: None,
                    same_as,
                }
            })
            .collect();
        Ok(Checkpoint {
            rows,
            metadata: loaded.metadata,
            index: None,
            shards: Vec::new(),
        })
    }

    /// A sharded checkpoint: every shard's header, and the first one's metadata (as a load
    /// returns it).
    fn of_shards(index: PathBuf, shards: &[PathBuf]) -> Result<Self, Failure> {
        let mut rows = Vec::new();
        let mut metadata = BTreeMap::new();
        let mut totals = Vec::with_capacity(shards.len());
        for (i, shard) in shards.iter().enumerate() {
            let header = read_header(shard)?;
            let file = file_name(shard);
            let mut total = Total::default();
            for t in header.tensors {
                let bytes = (t.end - t.begin) as u64;
                total.add(bytes);
                rows.push(Row {
                    path: vec![t.name.clone()],
                    name: t.name,
                    dtype: t.dtype.name(),
                    shape: t.shape,
                    bytes,
                    file: Some(file.clone()),
                    same_as: None,
                });
            }
            totals.push((file, total));
            if i == 0 {
                metadata = header.metadata;
            }
        }
        Ok(Checkpoint {
            rows,
            metadata,
            index: Some(index),
            shards: totals,
        })
    }

    /// Everything stored, and what each dtype takes (dtypes in order of first use).
    fn totals(&self) -> (Total, Vec<(&'static str, Total)>) {
        let mut all = Total::default();
        let mut by_dtype: Vec<(&'static str, Total)> = Vec::new();
        for row in self.rows.iter().filter(|r| r.same_as.is_none()) {
            all.add(row.bytes);
            match by_dtype.iter_mut().find(|(d, _)| *d == row.dtype) {
                Some((_, total)) => total.add(row.bytes),
                None => {
                    let mut total = Total::default();
                    total.add(row.bytes);
                    by_dtype.push((row.dtype, total));
                }
            }
        }
        (all, by_dtype)
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy()
        .into_owned()
}

fn print_json(out: &mut Out<impl Write>, checkpoint: &Checkpoint) -> Result<(), Failure> {
    let rows: Vec<_> = checkpoint
        .rows
        .iter()
        .map(|r| {
            let mut row = json!({
                "path": r.path,
                "name": r.name,
                "dtype": r.dtype,
                "shape": r.shape,
                "bytes": r.bytes,
            });
            if let Some(file) = &r.file {
                row["file"] = json!(file);
            }
            if let Some(first) = &r.same_as {
                row["same_as"] = json!(first);
            }
            row
        })
        .collect();
    let (all, by_dtype) = checkpoint.totals();
    let dtypes: serde_json::Map<String, serde_json::Value> = by_dtype
        .iter()
        .map(|(d, t)| {
            (
                d.to_string(),
                json!({"tensors": t.tensors, "bytes": t.bytes}),
            )
        })
        .collect();
    let mut doc = json!({
        "tensors": rows,
        "total_tensors": all.tensors,
        "total_bytes": all.bytes,
        "dtypes": dtypes,
        "metadata": checkpoint.metadata,
    });
    if let Some(index) = &checkpoint.index {
        doc["index"] = json!(index.to_string_lossy());
        doc["shards"] = checkpoint
            .shards
            .iter()
            .map(|(file, t)| json!({"file": file, "tensors": t.tensors, "bytes": t.bytes}))
            .collect();
    }
    // A tree of strings and numbers always serialises: failing to is a bug.
    let text = serde_json::to_string_pretty(&doc)
        .map_err(|e| Failure::Internal(format!("the JSON output: {e}")))?;
    writeln!(out, "{}", json_escaped(&text))
}

fn print_table(out: &mut Out<impl Write>, checkpoint: &Checkpoint) -> Result<(), Failure> {
    let names: Vec<String> = checkpoint
        .rows
        .iter()
        .map(|r| escaped(&r.path.join("/")).into_owned())
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
    for (name, r) in names.iter().zip(&checkpoint.rows) {
        let bytes = match &r.same_as {
            Some(first) => format!("same as {}", escaped(first)),
            None => r.bytes.to_string(),
        };
        let shape = format!("{:?}", r.shape);
        writeln!(
            out,
            "{name:<width$}  {:<13}  {shape:<20}  {bytes:>12}",
            r.dtype
        )?;
    }
    let (all, by_dtype) = checkpoint.totals();
    writeln!(out, "{}", described(all))?;
    for (dtype, t) in &by_dtype {
        writeln!(out, "  {dtype}: {}", described(*t))?;
    }
    let tied = checkpoint.rows.len() as u64 - all.tensors;
    if tied > 0 {
        writeln!(
            out,
            "  {tied} more paths name a tied tensor (stored once, counted once)"
        )?;
    }
    if let Some(index) = &checkpoint.index {
        let index = escaped(&index.to_string_lossy()).into_owned();
        writeln!(out, "{} shards of {index}:", checkpoint.shards.len())?;
        for (file, t) in &checkpoint.shards {
            writeln!(out, "  {}: {}", escaped(file), described(*t))?;
        }
    }
    for (k, v) in &checkpoint.metadata {
        writeln!(out, "metadata {}: {}", escaped(k), escaped(v))?;
    }
    Ok(())
}

/// `3 tensors, 326 bytes (326 B)`.
fn described(total: Total) -> String {
    let s = if total.tensors == 1 { "" } else { "s" };
    format!(
        "{} tensor{s}, {} bytes ({})",
        total.tensors,
        total.bytes,
        human(total.bytes)
    )
}

/// `bytes` in decimal units, as checkpoint sizes are given (`5GB` shards): `497.8 MB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KB", "MB", "GB", "TB", "PB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1000.0 {
            break;
        }
        value /= 1000.0;
        unit = u;
    }
    format!("{value:.1} {unit}")
}

#[cfg(test)]
mod tests {
    use super::human;

    #[test]
    fn sizes_read_in_decimal_units() {
        assert_eq!(human(999), "999 B");
        assert_eq!(human(1000), "1.0 KB");
        assert_eq!(human(497_759_232), "497.8 MB");
        assert_eq!(human(5_000_000_000), "5.0 GB");
    }
}
