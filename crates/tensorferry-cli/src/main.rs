//! The `tensorferry` command; everything it does is [`tensorferry_cli::run`].

/// With the `mimalloc` feature, mimalloc: dictionaries of many small tensors make and free
/// a name, a shape and a tensor per entry, and the allocator is much of that cost
/// (`--preset tiny-100k`: mmap load about 0.6 us per tensor with glibc, 0.27 with mimalloc).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(tensorferry_cli::run(std::env::args_os()))
}
