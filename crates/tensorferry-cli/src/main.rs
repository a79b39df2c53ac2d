//! The `tensorferry` command: what this machine offers, what a file holds, how fast
//! every path runs here.

/// With the `mimalloc` feature, mimalloc: dictionaries of many small tensors make and free
/// a name, a shape and a tensor per entry, and the allocator is much of that cost
/// (`--preset tiny-100k`: mmap load about 0.6 us per tensor with glibc, 0.27 with mimalloc).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod info;
mod inspect;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Move whole dictionaries of tensors between GPU memory, host memory and files.
#[derive(Parser)]
#[command(name = "tensorferry", version, about)]
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
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info::run(),
        Command::Inspect { file, json } => inspect::run(&file, json),
        Command::Bench(args) => bench::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensorferry: {e}");
            ExitCode::FAILURE
        }
    }
}
