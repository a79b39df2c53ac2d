//! `tensorferry bench`: every path available on this machine, timed on state-dict-like
//! presets, each against the roof measured in the same run on the same bytes.
//!
//! A roof is the same bytes moved without tensorferry: a memcpy on one thread or on one per
//! core (the faster), a raw write or read, one copy of one buffer queued straight on
//! the device's backend. Each roof is measured before the rows and again after them, and
//! keeps the faster time. A row faster than its roof means the roof was mismeasured; it is
//! printed as such, never as a percentage above 100.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use tensorferry::internal::backend::{backend_for, CopyBatch, CopyOp, Direction, Event};
use tensorferry::internal::io::{header_bytes, parse_header};
use tensorferry::internal::memory::AlignedBuffer;
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

fn build(preset: Preset, scale: f64) -> tensorferry::Result<Node> {
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
    Ok(d.into())
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

/// A roof: what it is, and its best time.
type Roof = Option<(&'static str, Duration)>;

/// A row of the table: the path timed, its best time, and its roof.
type Row = (&'static str, Duration, Roof);

/// Threads of the many-thread memcpy roof: one per core. The roof is the faster of this and
/// one thread, the fastest plain way to copy the bytes here, whatever the library does.
fn copy_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Copies of the roofs are split into pieces of at most this many bytes, as consolidate
/// splits its own, so that one large tensor still spreads over every thread.
const ROOF_PIECE_BYTES: usize = 8 << 20;

/// Copies each `(source, offset)` into a fresh zeroed buffer of `total` bytes on `threads`
/// threads, each taking a run of pieces of about equal bytes: the memcpy a multi-threaded
/// copy of the same bytes into a new buffer is measured against.
fn memcpy_on_threads(
    sources: &[(&[u8], usize)],
    total: usize,
    threads: usize,
) -> tensorferry::Result<AlignedBuffer> {
    let mut pieces = Vec::new();
    for &(bytes, at) in sources {
        for (i, chunk) in bytes.chunks(ROOF_PIECE_BYTES).enumerate() {
            pieces.push((chunk, at + i * ROOF_PIECE_BYTES));
        }
    }
    let mut dst = AlignedBuffer::zeroed(total)?;
    let share = pieces
        .iter()
        .map(|p| p.0.len())
        .sum::<usize>()
        .div_ceil(threads.max(1));
    // Runs of consecutive pieces (their destinations rise), cut once a run holds its share.
    let mut runs: Vec<&[(&[u8], usize)]> = Vec::new();
    let (mut start, mut acc) = (0, 0);
    for (i, p) in pieces.iter().enumerate() {
        acc += p.0.len();
        if acc >= share && i + 1 < pieces.len() {
            runs.push(&pieces[start..=i]);
            (start, acc) = (i + 1, 0);
        }
    }
    runs.push(&pieces[start..]);
    std::thread::scope(|scope| {
        let mut rest = dst.as_mut_slice();
        let mut base = 0;
        for (i, run) in runs.iter().enumerate() {
            let end = runs.get(i + 1).map_or(base + rest.len(), |next| next[0].1);
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(end - base);
            let run_base = base;
            scope.spawn(move || {
                for &(bytes, at) in run.iter() {
                    mine[at - run_base..at - run_base + bytes.len()].copy_from_slice(bytes);
                }
            });
            (rest, base) = (tail, end);
        }
    });
    Ok(dst)
}

/// The best time of a memcpy of `sources` into a fresh buffer, on one thread or on
/// [`copy_threads`] threads, whichever is faster here.
fn memcpy_roof(
    r: usize,
    sources: &[(&[u8], usize)],
    total: usize,
) -> tensorferry::Result<Duration> {
    let mut roof = Duration::MAX;
    for threads in [1, copy_threads()] {
        roof = roof.min(best(r, || {
            std::hint::black_box(memcpy_on_threads(sources, total, threads)?);
            Ok(())
        })?);
        if copy_threads() == 1 {
            break;
        }
    }
    Ok(roof)
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
    // Consolidate copies on several threads: its roofs are memcpys on one thread per core
    // (or on one, if that is faster here), of one buffer and of every tensor.
    let packed = source.host_bytes().expect("host");
    let memcpy = memcpy_roof(r, &[(packed, 0)], packed.len())?;
    bar.inc(1);
    bar.set_message("memcpy per tensor");
    let tensors = dict.tensor_refs();
    let layout =
        tensorferry::internal::consolidate::PackedLayout::plan(tensors.iter().map(|t| t.nbytes()));
    let per_tensor: Vec<(&[u8], usize)> = tensors
        .iter()
        .zip(&layout.offsets)
        .map(|(t, &at)| (t.contiguous_bytes().expect("contiguous host tensors"), at))
        .collect();
    let gather = memcpy_roof(r, &per_tensor, layout.total)?;
    bar.set_message("consolidate");
    let t = best(r, || consolidate(&dict).map(drop))?;
    rows.push(("consolidate", t, Some(("memcpy, threads", memcpy))));
    rows.push((
        "consolidate",
        t,
        Some(("memcpy per tensor, threads", gather)),
    ));
    bar.inc(1);

    let raw_path = dir.join("raw.bin");
    let file_path = dir.join("bench.safetensors");
    let raw_bytes = &src_bytes[..total.min(src_bytes.len())];
    let mut write_roof = Duration::ZERO;
    let writes = [
        (
            false,
            "writes to page cache",
            "save (page cache)",
            "raw write",
        ),
        (
            true,
            "writes with fsync",
            "save (fsync)",
            "raw write + fsync",
        ),
    ];
    for (fsync, step, path, roof) in writes {
        bar.set_message(step);
        let raw = raw_write(r, &raw_path, raw_bytes, fsync)?;
        if !fsync {
            write_roof = raw;
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
        rows.push((path, t, Some((roof, raw))));
        bar.inc(1);
    }

    bar.set_message("reads");
    let file_len = std::fs::metadata(&file_path)
        .map_err(io_err("stat", &file_path))?
        .len() as usize;
    let read_roof = raw_read(r, &file_path)?;
    let t = best(r, || {
        load(
            &file_path,
            LoadOptions {
                mmap: tensorferry::Mapping::READ,
                direct: false,
                ..Default::default()
            },
        )
        .map(drop)
    })?;
    rows.push((
        "load (read, cached)",
        t,
        Some(("raw read, cached", read_roof)),
    ));
    bar.inc(1);
    let t = best(r, || {
        load(
            &file_path,
            LoadOptions {
                // SAFETY: the bench's own file, in its own temporary folder: nothing else
                // truncates or rewrites it while the tensors are alive.
                mmap: unsafe { tensorferry::Mapping::map() },
                direct: false,
                ..Default::default()
            },
        )
        .map(drop)
    })?;
    rows.push(("load (mmap)", t, None));
    bar.inc(1);
    bar.set_message("headers");
    let options = SaveOptions::default();
    // The tree as a fresh copy, its nodes side by side (as the walk of a dict built in one
    // go finds them), not scattered among the tensors' buffers allocated between them:
    // the walk's time then does not hang on where the allocator left those nodes.
    let tree = dict.clone();
    let t = best(r, || header_bytes(&tree, &options).map(drop))?;
    rows.push(("header build", t, None));
    let header = header_bytes(&tree, &options)?;
    let data_len = (file_len - header.len()) as u64;
    let t = best(r, || parse_header(&header[8..], data_len).map(drop))?;
    rows.push(("header parse", t, None));
    bar.inc(1);
    if let Some(name) = &args.device {
        bar.set_message("device moves");
        device_rows(name, &dict, r, &mut rows)?;
        let roofs = FileRoofs {
            path: &file_path,
            write: write_roof,
            read: read_roof,
        };
        device_file_rows(name, &dict, &roofs, r, &mut rows)?;
    }

    // Every roof once more, after the rows: on a shared machine a roof measured once, in a
    // busy moment, is beaten by rows timed in a quiet one. Each keeps its faster measurement.
    bar.set_message("roofs again");
    let mut again = vec![
        (
            "memcpy, threads",
            memcpy_roof(r, &[(packed, 0)], packed.len())?,
        ),
        (
            "memcpy per tensor, threads",
            memcpy_roof(r, &per_tensor, layout.total)?,
        ),
        ("raw write", raw_write(r, &raw_path, raw_bytes, false)?),
        (
            "raw write + fsync",
            raw_write(r, &raw_path, raw_bytes, true)?,
        ),
        ("raw read, cached", raw_read(r, &file_path)?),
    ];
    if let Some(name) = &args.device {
        let (d2h, h2d) = raw_device_copies(name.parse()?, total.max(1), r)?;
        again.push(("raw copy into pinned", d2h));
        again.push(("raw copy from pinned", h2d));
    }
    for (name, roof) in rows.iter_mut().filter_map(|row| row.2.as_mut()) {
        if let Some(&(_, later)) = again.iter().find(|(n, _)| n == name) {
            *roof = (*roof).min(later);
        }
    }
    bar.finish_and_clear();

    print_table(out, args, total, count, &rows)
}

/// The best time of writing `bytes` to a new file at `path` (then `fsync` if asked): the roof
/// of a save. Removing the previous file (and freeing its cached pages) happens outside the
/// timed region, as it does for the saves.
fn raw_write(r: usize, path: &Path, bytes: &[u8], fsync: bool) -> tensorferry::Result<Duration> {
    best_after(
        r,
        || drop(std::fs::remove_file(path)),
        || {
            let mut f = File::create(path).map_err(io_err("create", path))?;
            f.write_all(bytes).map_err(io_err("write", path))?;
            if fsync {
                f.sync_all().map_err(io_err("sync", path))?;
            }
            Ok(())
        },
    )
}

/// The best time of reading the whole file at `path` into a fresh buffer with one `read`:
/// the roof of a load.
fn raw_read(r: usize, path: &Path) -> tensorferry::Result<Duration> {
    let len = std::fs::metadata(path).map_err(io_err("stat", path))?.len() as usize;
    best(r, || {
        let mut f = File::open(path).map_err(io_err("open", path))?;
        let mut buf = AlignedBuffer::zeroed(len)?;
        f.read_exact(buf.as_mut_slice())
            .map_err(io_err("read", path))?;
        std::hint::black_box(&buf);
        Ok(())
    })
}

/// The staging ring that "auto" sizes.
fn auto_ring() -> Staging {
    use tensorferry::internal::transfer::staging::{AUTO_CHUNK_BYTES, AUTO_DEPTH};
    Staging::Ring {
        chunk_bytes: AUTO_CHUNK_BYTES,
        depth: AUTO_DEPTH,
    }
}

/// One timed move: its name, source, target, options and roof.
type Plan<'a> = (&'static str, &'a Node, Device, MoveOptions, Roof);

/// Moves to `device` and back, each direction against its roof measured in the same run
/// on the same number of bytes (see [`raw_device_copies`]). Then: the whole dictionary in
/// one plan into pinned memory, into fresh ordinary memory through the staging ring and
/// directly, and a loop of one move per tensor (what a Python loop of `.to()` does).
fn device_rows(name: &str, dict: &Node, r: usize, rows: &mut Vec<Row>) -> tensorferry::Result<()> {
    let device: Device = name.parse()?;
    let with = |pinned: bool, staging: Staging| MoveOptions {
        copy: true,
        pinned,
        staging,
        ..Default::default()
    };
    let ring = auto_ring();
    let total: usize = dict.tensor_refs().iter().map(|t| t.nbytes()).sum();
    let (d2h, h2d) = raw_device_copies(device, total.max(1), r)?;
    let to_dev = Some(("raw copy from pinned", h2d));
    let to_host = Some(("raw copy into pinned", d2h));

    let there = dict.to(device, false)?;
    let pinned_host = there.to_with(Device::Cpu, with(true, Staging::Off))?;
    let (cpu, off) = (Device::Cpu, Staging::Off);
    let plans: [Plan<'_>; 6] = [
        ("to host, pinned", &there, cpu, with(true, off), to_host),
        ("to host, staged", &there, cpu, with(false, ring), to_host),
        ("to host, direct", &there, cpu, with(false, off), to_host),
        (
            "to device, from pinned",
            &pinned_host,
            device,
            with(false, off),
            to_dev,
        ),
        ("to device, staged", dict, device, with(false, ring), to_dev),
        ("to device, direct", dict, device, with(false, off), to_dev),
    ];
    for (path, from, target, options, roof) in plans {
        let time = best(r, || from.to_with(target, options).map(drop))?;
        rows.push((path, time, roof));
    }
    let t = best(r, || {
        for t in there.tensor_refs() {
            t.to(Device::Cpu, true)?;
        }
        Ok(())
    })?;
    rows.push(("to host, per tensor", t, to_host));
    let t = best(r, || {
        for t in dict.tensor_refs() {
            t.to(device, true)?;
        }
        Ok(())
    })?;
    rows.push(("to device, per tensor", t, to_dev));
    Ok(())
}

/// The roofs of the device rows: one copy of one buffer of `total` bytes, device -> pinned
/// host and pinned host -> device, queued straight on the device's backend (the stream's
/// own copy: no planner, no staging, no allocation in the timed region). Returns the best
/// times of both directions.
fn raw_device_copies(
    device: Device,
    total: usize,
    r: usize,
) -> tensorferry::Result<(Duration, Duration)> {
    let backend = backend_for(device)?;
    let pinned = MoveOptions {
        copy: true,
        pinned: true,
        staging: Staging::Off,
        ..Default::default()
    };
    // Set up through the engine, outside the timed region: the device buffer that is read,
    // two pinned host buffers (one read, one written) and the device buffer written.
    let on_device = filled_as(DType::U8, &[total], 7)?.to(device, false)?;
    let mut pinned_pair =
        tensorferry::move_tensors(&[&on_device, &on_device], Device::Cpu, pinned)?;
    let pinned_dst = pinned_pair.pop().expect("two tensors moved");
    let pinned_src = pinned_pair.pop().expect("two tensors moved");
    for t in [&on_device, &pinned_src, &pinned_dst] {
        t.wait()?;
    }
    let device_dst = backend.alloc(total)?;
    let copy = |direction: Direction, src: *const u8, dst: *mut u8| {
        let event = Event::pending();
        // SAFETY: `src` and `dst` are `total` bytes of live memory of the kinds `direction`
        // names (set up above, ready, and held by this function until it returns), and this
        // copy is waited for before anything else reads or writes them: the pinned and
        // device destinations are this function's alone, never read.
        unsafe {
            let batch = CopyBatch {
                direction,
                ops: vec![CopyOp::new(src, dst, total)],
                waits: Vec::new(),
            };
            backend.submit(batch, Box::new(()), &event)
        };
        event.wait()
    };
    let d2h = best(r, || {
        copy(
            Direction::DeviceToHost,
            on_device.data_ptr(),
            pinned_dst.data_ptr().cast_mut(),
        )
    })?;
    let h2d = best(r, || {
        copy(
            Direction::HostToDevice,
            pinned_src.data_ptr(),
            device_dst.as_ptr().cast_mut(),
        )
    })?;
    Ok((d2h, h2d))
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
    dict: &Node,
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
    rows.push(("save from device", time, Some(("raw write", roofs.write))));
    let staged = MoveOptions {
        staging: auto_ring(),
        ..Default::default()
    };
    let time = best(r, || {
        // SAFETY: the bench's own file, in its own temporary folder: nothing else
        // truncates or rewrites it while the tensors are alive.
        let mmap = unsafe { tensorferry::Mapping::map() };
        let mapped = load(
            roofs.path,
            LoadOptions {
                mmap,
                ..Default::default()
            },
        )?
        .root;
        mapped.to_with(device, staged).map(drop)
    })?;
    rows.push((
        "load onto device",
        time,
        Some(("raw read, cached", roofs.read)),
    ));
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
        "{:<22} {:>10} {:>8} {:>10}  {:<26} {:>16}",
        "path", "time ms", "GB/s", "us/leaf", "roof", "% roof"
    )?;
    let mut mismeasured = false;
    for &(path, time, roof) in rows {
        let (roof_name, pct) = match roof {
            Some((name, roof)) => (name, percent_of_roof(time, roof)),
            None => ("-", "-".to_string()),
        };
        mismeasured |= pct == ROOF_MISMEASURED;
        writeln!(
            out,
            "{:<22} {:>10.2} {:>8.2} {:>10.3}  {:<26} {:>16}",
            path,
            time.as_secs_f64() * 1e3,
            gbps(total, time),
            time.as_secs_f64() * 1e6 / count as f64,
            roof_name,
            pct
        )?;
    }
    let mut roofs: Vec<String> = Vec::new();
    for (name, d) in rows.iter().filter_map(|row| row.2) {
        let line = format!("{name} {:.2} GB/s", gbps(total, d));
        if !roofs.contains(&line) {
            roofs.push(line);
        }
    }
    writeln!(
        out,
        "roofs measured in this run: {}; memcpy on 1 or {} threads, the faster",
        roofs.join("; "),
        copy_threads()
    )?;
    if mismeasured {
        writeln!(
            out,
            "{ROOF_MISMEASURED}: the row ran faster than its roof, so the roof did not measure \
             the fastest way to move those bytes here; no percentage is given"
        )?;
    }
    Ok(())
}

/// What the "% roof" column says of a row faster than its roof.
const ROOF_MISMEASURED: &str = "roof mismeasured";

/// A row's time as a percentage of its roof's speed, or [`ROOF_MISMEASURED`] when the
/// row ran faster than the roof: a roof that is beaten was mismeasured, never a win.
fn percent_of_roof(time: Duration, roof: Duration) -> String {
    if time < roof {
        return ROOF_MISMEASURED.to_string();
    }
    format!("{:.0}%", 100.0 * roof.as_secs_f64() / time.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_faster_than_its_roof_is_a_mismeasured_roof_not_a_percentage() {
        let ms = Duration::from_millis;
        assert_eq!(percent_of_roof(ms(80), ms(100)), ROOF_MISMEASURED);
        assert_eq!(percent_of_roof(ms(100), ms(100)), "100%");
        assert_eq!(percent_of_roof(ms(200), ms(100)), "50%");
    }

    #[test]
    fn the_threaded_memcpy_roof_copies_every_piece_to_its_offset() {
        let a: Vec<u8> = (0..20_000_000u32).map(|i| i as u8).collect();
        let b = vec![7u8; 100];
        let total = a.len() + 64 + b.len();
        for threads in [1, 2, 3, 8] {
            let out = memcpy_on_threads(&[(&a, 0), (&b, a.len() + 64)], total, threads).unwrap();
            assert_eq!(&out.as_slice()[..a.len()], &a[..]);
            assert_eq!(&out.as_slice()[a.len() + 64..], &b[..]);
        }
    }
}
