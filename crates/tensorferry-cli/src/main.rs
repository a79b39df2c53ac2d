//! The `tensorferry` command: what this machine offers, what a file holds, how fast
//! every path runs here.
//!
//! How it ends, for scripts (also in `--help`): status 0 when it did its work, and also
//! when the reader of its output stopped early (`tensorferry inspect f | head -1`): the
//! command then ends quietly, as ripgrep does, so a pipeline under `set -o pipefail`
//! does not fail because `head` had read enough. Status 1 for any other failure,
//! a full disk or an error of the library included, told in one line on stderr
//! (`tensorferry: <cause>`); status 2 for a command line it cannot parse. Never a panic's
//! backtrace, status 101 or an abort. Control characters in names, metadata and
//! messages are printed escaped (`\u{1b}`), never raw.

/// With the `mimalloc` feature, mimalloc: dictionaries of many small tensors make and free
/// a name, a shape and a tensor per entry, and the allocator is much of that cost
/// (`--preset tiny-100k`: mmap load about 0.6 us per tensor with glibc, 0.27 with mimalloc).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod escape;
mod info;
mod inspect;
mod out;

use std::io::{self, BufWriter};
use std::path::PathBuf;
use std::process::ExitCode;

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
    /// Names (nested paths), dtype, shape, bytes and metadata of a safetensors file.
    Inspect {
        /// The file.
        file: PathBuf,
        /// Print JSON for scripts instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Time every path available here on state-dict-like presets, against measured roofs.
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage(&e),
    };
    out::exit_status(out::catching_panics(|| run(cli.command)))
}

/// Runs `command` with its output into a buffered, locked stdout, flushed at the end
/// (also after a failure, so that what was printed before it is not lost).
fn run(command: Command) -> Result<(), Failure> {
    let mut out = Out::new(BufWriter::new(io::stdout().lock()));
    let result = match command {
        Command::Info => info::run(&mut out),
        Command::Inspect { file, json } => inspect::run(&mut out, &file, json),
        Command::Bench(args) => bench::run(&mut out, &args),
    };
    result.and(out.flush())
}

/// Help and version on stdout (status 0), a usage error on stderr (status 2), as clap
/// would; help or version that cannot be written is a failure like any other output's
/// ([`clap::Error::exit`] ignores it and says 0).
fn usage(e: &clap::Error) -> ExitCode {
    match e.print() {
        Err(printing) if !e.use_stderr() => out::exit_status(Err(Failure::Output(printing))),
        _ => ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2)),
    }
}
