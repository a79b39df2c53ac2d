//! `tensorferry bench`: every path available on this machine, timed on state-dict-like
//! presets, each against the roof measured in the same run on the same bytes.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use tensorferry::io::{header_bytes, parse_header};
use tensorferry::memory::AlignedBuffer;
use tensorferry::{
    consolidate, load, save, DType, Device, LoadOptions, MoveOptions, Node, SaveOptions, Staging,
    Tensor, TensorDict,
};

use crate::out::{Failure, Out};

/// Options of `tensorferry bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Which dictionary to time.
    #[arg(long, value_enum, default_value_t = Preset::Gpt2)]
    preset: Preset,
    /// Multiplies every tensor's size (not the count), e.g. 0.1 for a quick run.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Runs of each measurement; the best is reported.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Folder for the files written (default: a temporary folder).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Also time moves to this device and back ("emu:0", "cuda:0"): one planned transfer
    /// per dictionary, against a loop of one transfer per tensor.
    #[arg(long)]
    device: Option<String>,
}

/// State-dict-like dictionaries.
#[derive(Clone, Copy, ValueEnum)]
enum Preset {
    /// GPT-2 small in float32: 148 tensors, about 500 MB.
    Gpt2,
    /// 20,000 tensors of 4 KiB each (float32).
    #[value(name = "tiny-20k")]
    Tiny20k,
    /// 100,000 tensors of 256 bytes each (float32).
    #[value(name = "tiny-100k")]
    Tiny100k,
    /// 10,000 tensors of 4 KiB each (float32).
    #[value(name = "tiny-10k")]
    Tiny10k,
    /// 1000 tensors of 64 x 64 float32 (16 KiB each).
    #[value(name = "tiny-1k")]
    Tiny1k,
    /// A 7B-parameter LLaMA-shaped state dict in bfloat16: 291 tensors, about 13.5 GB
    /// (use --scale to shrink it).
    #[value(name = "llama-like")]
    LlamaLike,
}

fn scaled(n: usize, scale: f64) -> usize {
    ((n as f64 * scale).round() as usize).max(1)
}

/// A float32 tensor of `shape` filled with non-zero bytes (untouched zero pages would
/// flatter reads).
fn filled(shape: &[usize], seed: usize) -> tensorferry::Result<Tensor> {
    filled_as(DType::F32, shape, seed)
}

/// A tensor of `dtype` and `shape` filled with non-zero bytes.
fn filled_as(dtype: DType, shape: &[usize], seed: usize) -> tensorferry::Result<Tensor> {
    let t = Tensor::zeros(dtype, shape)?;
    let mut buf = AlignedBuffer::zeroed(t.nbytes())?;
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i.wrapping_mul(31) ^ seed) as u8 | 1;
    }
    Tensor::from_bytes(dtype, shape.to_vec(), buf.as_slice())
}

fn build(preset: Preset, scale: f64) -> tensorferry::Result<TensorDict> {
    let mut d = TensorDict::new();
    match preset {
        Preset::Gpt2 => {
            let (e, ff) = (scaled(768, scale), scaled(3072, scale));
            d.insert("wte.weight", filled(&[scaled(50257, 1.0), e], 1)?);
            d.insert("wpe.weight", filled(&[1024, e], 2)?);
            for layer in 0..12 {
                let p = |s: &str| format!("h.{layer}.{s}");
                let shapes: [(&str, Vec<usize>); 12] = [
                    ("ln_1.weight", vec![e]),
                    ("ln_1.bias", vec![e]),
                    ("attn.c_attn.weight", vec![e, 3 * e]),
                    ("attn.c_attn.bias", vec![3 * e]),
                    ("attn.c_proj.weight", vec![e, e]),
                    ("attn.c_proj.bias", vec![e]),
                    ("ln_2.weight", vec![e]),
                    ("ln_2.bias", vec![e]),
                    ("mlp.c_fc.weight", vec![e, ff]),
                    ("mlp.c_fc.bias", vec![ff]),
                    ("mlp.c_proj.weight", vec![ff, e]),
                    ("mlp.c_proj.bias", vec![e]),
                ];
                for (i, (name, shape)) in shapes.iter().enumerate() {
                    d.insert(p(name), filled(shape, layer * 16 + i)?);
                }
            }
            d.insert("ln_f.weight", filled(&[e], 3)?);
            d.insert("ln_f.bias", filled(&[e], 4)?);
        }
        Preset::Tiny20k | Preset::Tiny10k => {
            let n = scaled(1024, scale);
            let count = if matches!(preset, Preset::Tiny20k) {
                20_000
            } else {
                10_000
            };
            for i in 0..count {
                d.insert(format!("t.{i}"), filled(&[n], i)?);
            }
        }
        Preset::Tiny100k => {
            let n = scaled(64, scale);
            for i in 0..100_000 {
                d.insert(format!("t.{i}"), filled(&[n], i)?);
            }
        }
        Preset::Tiny1k => {
            let n = scaled(64, scale);
            for i in 0..1000 {
                d.insert(format!("t.{i}"), filled(&[n, 64], i)?);
            }
        }
        Preset::LlamaLike => {
            let bf = |shape: &[usize], seed| filled_as(DType::BF16, shape, seed);
            let (h, ff, vocab) = (scaled(4096, scale), scaled(11008, scale), 32000);
            d.insert("model.embed_tokens.weight", bf(&[vocab, h], 1)?);
            for layer in 0..32 {
                let p = |s: &str| format!("model.layers.{layer}.{s}");
                let shapes: [(&str, Vec<usize>); 9] = [
                    ("self_attn.q_proj.weight", vec![h, h]),
                    ("self_attn.k_proj.weight", vec![h, h]),
                    ("self_attn.v_proj.weight", vec![h, h]),
                    ("self_attn.o_proj.weight", vec![h, h]),
                    ("mlp.gate_proj.weight", vec![ff, h]),
                    ("mlp.up_proj.weight", vec![ff, h]),
                    ("mlp.down_proj.weight", vec![h, ff]),
                    ("input_layernorm.weight", vec![h]),
                    ("post_attention_layernorm.weight", vec![h]),
                ];
                for (i, (name, shape)) in shapes.iter().enumerate() {
                    d.insert(p(name), bf(shape, layer * 16 + i)?);
                }
            }
            d.insert("model.norm.weight", bf(&[h], 2)?);
            d.insert("lm_head.weight", bf(&[vocab, h], 3)?);
        }
    }
    Ok(d)
}

fn best(
    repeat: usize,
    f: impl FnMut() -> tensorferry::Result<()>,
) -> tensorferry::Result<Duration> {
    best_after(repeat, || (), f)
}

/// The best time of `f`, each run after an untimed `setup`.
fn best_after(
    repeat: usize,
    mut setup: impl FnMut(),
    mut f: impl FnMut() -> tensorferry::Result<()>,
) -> tensorferry::Result<Duration> {
    let mut best = Duration::MAX;
    for _ in 0..repeat.max(1) {
        setup();
        let start = Instant::now();
        f()?;
        best = best.min(start.elapsed());
    }
    Ok(best)
}

fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl Fn(std::io::Error) -> tensorferry::Error + 'a {
    move |e| tensorferry::Error::Io {
        op,
        path: path.to_path_buf(),
        source: e,
    }
}

struct Row {
    path: &'static str,
    time: Duration,
    roof: Option<(&'static str, Duration)>,
}

/// Runs the benchmark and prints its table.
pub fn run(out: &mut Out<impl Write>, args: &BenchArgs) -> Result<(), Failure> {
    let tmp = tempfile::tempdir_in(args.dir.clone().unwrap_or_else(std::env::temp_dir))
        .map_err(io_err("create a folder in", Path::new(".")))?;
    let dir = tmp.path();
    let steps = 10u64;
    let bar = crate::progress::steps(steps);
    bar.set_message("building the dictionary");
    let dict = build(args.preset, args.scale)?;
    let total = dict.nbytes();
    let count = dict.tensor_count();
    let flat = consolidate(&dict)?;
    let source = flat.tensors()[0].1.storage().clone();
    let src_bytes = source.host_bytes().expect("host").to_vec();
    bar.inc(1);

    let r = args.repeat;
    let mut rows = Vec::new();
    bar.set_message("memcpy roof");
    let memcpy = best(r, || {
        let mut dst = AlignedBuffer::zeroed(src_bytes.len())?;
        dst.as_mut_slice().copy_from_slice(&src_bytes);
        std::hint::black_box(&dst);
        Ok(())
    })?;
    bar.inc(1);
    bar.set_message("memcpy per tensor");
    let tensors = dict.tensor_refs();
    let layout = tensorferry::consolidate::PackedLayout::plan(tensors.iter().map(|t| t.nbytes()));
    let gather = best(r, || {
        let mut dst = AlignedBuffer::zeroed(layout.total)?;
        let out = dst.as_mut_slice();
        for (t, &at) in tensors.iter().zip(&layout.offsets) {
            let src = t.contiguous_bytes().expect("contiguous host tensors");
            out[at..at + src.len()].copy_from_slice(src);
        }
        std::hint::black_box(&dst);
        Ok(())
    })?;
    bar.set_message("consolidate");
    let t = best(r, || consolidate(&dict).map(drop))?;
    rows.push(Row {
        path: "consolidate",
        time: t,
        roof: Some(("memcpy, fresh buffer", memcpy)),
    });
    rows.push(Row {
        path: "consolidate",
        time: t,
        roof: Some(("memcpy per tensor", gather)),
    });
    bar.inc(1);

    let raw_path = dir.join("raw.bin");
    let file_path = dir.join("bench.safetensors");
    let mut raw_write = Duration::ZERO;
    for fsync in [false, true] {
        bar.set_message(if fsync {
            "writes with fsync"
        } else {
            "writes to page cache"
        });
        // Both the roof and save write a new file: removing the old one (and freeing its
        // cached pages) happens outside the timed region for both.
        let raw = best_after(
            r,
            || drop(std::fs::remove_file(&raw_path)),
            || {
                let mut f = File::create(&raw_path).map_err(io_err("create", &raw_path))?;
                f.write_all(&src_bytes[..total.min(src_bytes.len())])
                    .map_err(io_err("write", &raw_path))?;
                if fsync {
                    f.sync_all().map_err(io_err("sync", &raw_path))?;
                }
                Ok(())
            },
        )?;
        if !fsync {
            raw_write = raw;
        }
        bar.inc(1);
        let opts = SaveOptions {
            fsync,
            ..Default::default()
        };
        let t = best_after(
            r,
            || drop(std::fs::remove_file(&file_path)),
            || save(&dict, &file_path, &opts),
        )?;
        rows.push(Row {
            path: if fsync {
                "save (fsync)"
            } else {
                "save (page cache)"
            },
            time: t,
            roof: Some((
                if fsync {
                    "raw write + fsync"
                } else {
                    "raw write"
                },
                raw,
            )),
        });
        bar.inc(1);
    }

    bar.set_message("reads");
    let file_len = std::fs::metadata(&file_path)
        .map_err(io_err("stat", &file_path))?
        .len() as usize;
    let raw_read = best(r, || {
        let mut f = File::open(&file_path).map_err(io_err("open", &file_path))?;
        let mut buf = AlignedBuffer::zeroed(file_len)?;
        f.read_exact(buf.as_mut_slice())
            .map_err(io_err("read", &file_path))?;
        std::hint::black_box(&buf);
        Ok(())
    })?;
    let t = best(r, || {
        load(
            &file_path,
            LoadOptions {
                mmap: false,
                direct: false,
                ..Default::default()
            },
        )
        .map(drop)
    })?;
    rows.push(Row {
        path: "load (read, cached)",
        time: t,
        roof: Some(("raw read, cached", raw_read)),
    });
    bar.inc(1);
    let t = best(r, || {
        load(
            &file_path,
            LoadOptions {
                mmap: true,
                direct: false,
                ..Default::default()
            },
        )
        .map(drop)
    })?;
    rows.push(Row {
        path: "load (mmap)",
        time: t,
        roof: None,
    });
    bar.inc(1);
    bar.set_message("headers");
    let root = Node::Dict(dict.clone());
    let options = SaveOptions::default();
    let t = best(r, || header_bytes(&root, &options).map(drop))?;
    rows.push(Row {
        path: "header build",
        time: t,
        roof: None,
    });
    let header = header_bytes(&root, &options)?;
    let data_len = (file_len - header.len()) as u64;
    let t = best(r, || parse_header(&header[8..], data_len).map(drop))?;
    rows.push(Row {
        path: "header parse",
        time: t,
        roof: None,
    });
    bar.inc(1);
    if let Some(name) = &args.device {
        bar.set_message("device moves");
        device_rows(name, &dict, r, &mut rows)?;
        let roofs = FileRoofs {
            path: &file_path,
            write: raw_write,
            read: raw_read,
        };
        device_file_rows(name, &dict, &roofs, r, &mut rows)?;
    }
    bar.finish_and_clear();

    print_table(out, args, total, count, &rows)
}

/// One timed move: its name, source, target, options and roof.
type Plan<'a> = (
    &'static str,
    &'a TensorDict,
    Device,
    MoveOptions,
    Option<(&'static str, Duration)>,
);

/// Moves to `device` and back, each direction against its roof measured in the same run
/// on the same number of bytes: one copy of one buffer of the dictionary's size between
/// the device and pinned host memory. Then: the whole dictionary in one plan into pinned
/// memory, into fresh ordinary memory through the staging ring and directly, and a loop
/// of one move per tensor (what a Python loop of `.to()` does).
fn device_rows(
    name: &str,
    dict: &TensorDict,
    r: usize,
    rows: &mut Vec<Row>,
) -> tensorferry::Result<()> {
    let device: Device = name.parse()?;
    let with = |pinned: bool, staging: Staging| MoveOptions {
        copy: true,
        pinned,
        staging,
        ..Default::default()
    };
    let ring = Staging::Ring {
        chunk_bytes: tensorferry::transfer::staging::AUTO_CHUNK_BYTES,
        depth: tensorferry::transfer::staging::AUTO_DEPTH,
    };
    // The roofs: one buffer of the same bytes, device -> pinned host, pinned host -> device.
    let total: usize = dict.tensor_refs().iter().map(|t| t.nbytes()).sum();
    let blob = filled_as(DType::U8, &[total.max(1)], 7)?.to(device, false)?;
    let move_one = |t: &Tensor, target: Device, options: MoveOptions| {
        tensorferry::move_tensors(&[t], target, options).map(|mut v| v.remove(0))
    };
    let d2h = best(r, || {
        move_one(&blob, Device::Cpu, with(true, Staging::Off)).map(drop)
    })?;
    let pinned_blob = move_one(&blob, Device::Cpu, with(true, Staging::Off))?;
    let h2d = best(r, || {
        move_one(&pinned_blob, device, with(false, Staging::Off)).map(drop)
    })?;
    let to_dev = Some(("1 copy from pinned", h2d));
    let to_host = Some(("1 copy into pinned", d2h));

    let there = dict.to(device, false)?;
    let pinned_host = there.to_with(Device::Cpu, with(true, Staging::Off))?;
    let plans: [Plan<'_>; 6] = [
        (
            "to host, pinned",
            &there,
            Device::Cpu,
            with(true, Staging::Off),
            to_host,
        ),
        (
            "to host, staged",
            &there,
            Device::Cpu,
            with(false, ring),
            to_host,
        ),
        (
            "to host, direct",
            &there,
            Device::Cpu,
            with(false, Staging::Off),
            to_host,
        ),
        (
            "to device, from pinned",
            &pinned_host,
            device,
            with(false, Staging::Off),
            to_dev,
        ),
        ("to device, staged", dict, device, with(false, ring), to_dev),
        (
            "to device, direct",
            dict,
            device,
            with(false, Staging::Off),
            to_dev,
        ),
    ];
    for (path, from, target, options, roof) in plans {
        let time = best(r, || from.to_with(target, options).map(drop))?;
        rows.push(Row { path, time, roof });
    }
    let t = best(r, || {
        for t in there.tensor_refs() {
            t.to(Device::Cpu, true)?;
        }
        Ok(())
    })?;
    rows.push(Row {
        path: "to host, per tensor",
        time: t,
        roof: to_host,
    });
    let t = best(r, || {
        for t in dict.tensor_refs() {
            t.to(device, true)?;
        }
        Ok(())
    })?;
    rows.push(Row {
        path: "to device, per tensor",
        time: t,
        roof: to_dev,
    });
    Ok(())
}

/// The file the host rows wrote, and the raw write and read of its bytes (page cache).
struct FileRoofs<'a> {
    path: &'a Path,
    write: Duration,
    read: Duration,
}

/// A save from the device (streamed into the file through the pinned ring) against a raw
/// write of the same bytes, and a load onto it (mapped, streamed through the ring)
/// against a raw read of the file.
fn device_file_rows(
    name: &str,
    dict: &TensorDict,
    roofs: &FileRoofs<'_>,
    r: usize,
    rows: &mut Vec<Row>,
) -> tensorferry::Result<()> {
    let device: Device = name.parse()?;
    let there = dict.to(device, false)?;
    let opts = SaveOptions {
        fsync: false,
        ..Default::default()
    };
    let time = best_after(
        r,
        || drop(std::fs::remove_file(roofs.path)),
        || save(&there, roofs.path, &opts),
    )?;
    rows.push(Row {
        path: "save from device",
        time,
        roof: Some(("raw write", roofs.write)),
    });
    let staged = MoveOptions {
        staging: Staging::Ring {
            chunk_bytes: tensorferry::transfer::staging::AUTO_CHUNK_BYTES,
            depth: tensorferry::transfer::staging::AUTO_DEPTH,
        },
        ..Default::default()
    };
    let time = best(r, || {
        let (mapped, _) = load(roofs.path, LoadOptions::default())?;
        mapped.to_with(device, staged).map(drop)
    })?;
    rows.push(Row {
        path: "load onto device",
        time,
        roof: Some(("raw read, cached", roofs.read)),
    });
    Ok(())
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn print_table(
    out: &mut Out<impl Write>,
    args: &BenchArgs,
    total: usize,
    count: usize,
    rows: &[Row],
) -> Result<(), Failure> {
    let preset = args
        .preset
        .to_possible_value()
        .expect("named")
        .get_name()
        .to_string();
    writeln!(
        out,
        "preset {preset} (scale {}): {count} tensors, {:.1} MB, best of {}",
        args.scale,
        total as f64 / 1e6,
        args.repeat
    )?;
    writeln!(
        out,
        "{:<22} {:>10} {:>8} {:>10}  {:<22} {:>8}",
        "path", "time ms", "GB/s", "us/leaf", "roof", "% roof"
    )?;
    for row in rows {
        let (roof_name, pct) = match row.roof {
            Some((name, roof)) => (
                name,
                format!(
                    "{:.0}%",
                    100.0 * roof.as_secs_f64() / row.time.as_secs_f64()
                ),
            ),
            None => ("-", "-".to_string()),
        };
        writeln!(
            out,
            "{:<22} {:>10.2} {:>8.2} {:>10.3}  {:<22} {:>8}",
            row.path,
            row.time.as_secs_f64() * 1e3,
            gbps(total, row.time),
            row.time.as_secs_f64() * 1e6 / count as f64,
            roof_name,
            pct
        )?;
    }
    let mut roofs: Vec<String> = Vec::new();
    for (name, d) in rows.iter().filter_map(|r| r.roof) {
        let line = format!("{name} {:.2} GB/s", gbps(total, d));
        if !roofs.contains(&line) {
            roofs.push(line);
        }
    }
    writeln!(out, "roofs measured in this run: {}", roofs.join("; "))
}
