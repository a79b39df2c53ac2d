//! The `tensorferry` command: what this machine offers, what a checkpoint holds, how fast
//! every path runs here.
//!
//! The whole command is [`run`]: the binary's `main` calls it, and so does the Python
//! package's `tensorferry` console script (through `tensorferry._native.cli_main`), so
//! `cargo install --path crates/tensorferry-cli` and `pip install tensorferry` give one
//! command that behaves alike. Only `convert` differs: it reads PyTorch pickles, which
//! takes PyTorch, so the Python entry point runs it itself and this crate's `convert`
//! says so.
//!
//! How it ends, for scripts, is what `--help` says (`AFTER_HELP`): a reader of the output
//! that stops early ends the command quietly with status 0, as ripgrep does, so a pipeline
//! under `set -o pipefail` does not fail because `head` had read enough. Never a panic's
//! backtrace, status 101 or an abort.

#![deny(missing_docs)]

mod bench;
mod escape;
mod info;
mod inspect;
mod out;
pub mod progress;

pub use inspect::human;
use std::ffi::OsString;
use std::io::{self, BufWriter};
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use out::{Failure, Out};

/// What `--help` says of the exit status and of escaping.
const AFTER_HELP: &str = "\
Exit status:
  0  success; also when the reader of the output stops early
     (`tensorferry inspect f | head -1`): the command then ends quietly
  1  any other failure (a full disk, a damaged file, ...), told in one line on stderr
  2  a command line that cannot be parsed
Control characters in names, metadata and messages are printed escaped (\\u{1b}).";

/// The one line `convert` prints where PyTorch cannot be reached.
pub const CONVERT_NEEDS_PYTHON: &str = "convert reads PyTorch checkpoints, which takes PyTorch: \
     run it from the Python package (pip install tensorferry torch), whose `tensorferry` \
     command runs convert";

/// Move whole dictionaries of tensors between GPU memory, host memory and files.
#[derive(Parser)]
#[command(name = "tensorferry", version, about, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Version, devices found, and the CUDA driver or the exact reason none is usable.
    Info,
    /// Tensors, totals (tensors, bytes, bytes per dtype) and metadata of a checkpoint.
    ///
    /// Names, dtype, shape and bytes of every tensor, then the totals and the metadata, of
    /// a safetensors file, a sharded checkpoint (its `*.safetensors.index.json`), or a
    /// folder holding one. Read from the headers alone: no tensor byte is read.
    Inspect {
        /// A safetensors file, a `*.safetensors.index.json`, or a folder holding one.
        path: PathBuf,
        /// Print JSON for scripts instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Turn a PyTorch checkpoint (.bin, .pt) into safetensors (from the Python package).
    ///
    /// Turns a PyTorch pickle checkpoint (`.bin`, `.pt`, a `pytorch_model.bin.index.json`,
    /// or a folder holding one) into a safetensors file, or shards and an index, with
    /// progress. It reads pickles with PyTorch, so it runs from the Python package's
    /// `tensorferry` command (pip install tensorferry torch), whose
    /// `tensorferry convert --help` lists its options.
    Convert {
        /// Whatever follows: `convert` is parsed by the Python package.
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            hide = true,
            num_args = 0..
        )]
        args: Vec<OsString>,
    },
    /// Time every path available here on state-dict-like presets, against measured roofs.
    Bench(bench::BenchArgs),
}

/// Runs the command line `args` (the program's name first, as `std::env::args_os`
/// gives it) and returns the exit status: 0, 1 or 2 (see the crate's documentation).
/// Output goes to this process's stdout and stderr. A panic in the command is caught and
/// reported in one line; the panic hook in place before the call is restored after it.
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return usage(&e),
    };
    out::exit_status(out::catching_panics(|| run_command(cli.command)))
}

/// Runs `command` with its output into a buffered, locked stdout, flushed at the end
/// (also after a failure, so that what was printed before it is not lost).
fn run_command(command: Command) -> Result<(), Failure> {
    let mut out = Out::new(BufWriter::new(io::stdout().lock()));
    let result = match command {
        Command::Info => info::run(&mut out),
        Command::Inspect { path, json } => inspect::run(&mut out, &path, json),
        Command::Convert { .. } => Err(Failure::Refused(CONVERT_NEEDS_PYTHON.into())),
        Command::Bench(args) => bench::run(&mut out, &args),
    };
    result.and(out.flush())
}

/// Help and version on stdout (status 0), a usage error on stderr (status 2), as clap
/// would; help or version that cannot be written is a failure like any other output's
/// ([`clap::Error::exit`] ignores it and says 0).
fn usage(e: &clap::Error) -> u8 {
    match e.print() {
        Err(printing) if !e.use_stderr() => out::exit_status(Err(Failure::Output(printing))),
        _ => u8::try_from(e.exit_code()).unwrap_or(2),
    }
}
