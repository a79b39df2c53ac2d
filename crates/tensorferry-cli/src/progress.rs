//! Progress bars for long work (`bench`, and `convert` through the Python package), in
//! one style: on stderr, and drawn only when stderr is a terminal (indicatif's rule), so a
//! pipe, a log file or CI gets none of it and stdout stays the command's output alone.

use std::time::Duration;

pub use indicatif::ProgressBar;
use indicatif::ProgressStyle;

/// How often a bar redraws on its own, so that its spinner and elapsed time move while a
/// step that reports nothing (a file written in one call) runs.
const TICK: Duration = Duration::from_millis(100);

/// A bar of `len` steps, each named by the message: `⠋ [=====>    ] 3/10 consolidate`.
pub fn steps(len: u64) -> ProgressBar {
    styled(len, "{spinner} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
}

/// A bar of `total` bytes, with the rate and the time left:
/// `⠋ writing model.safetensors [=====>    ] 1.2 GiB/4.9 GiB 310 MiB/s 12s`.
pub fn bytes(total: u64) -> ProgressBar {
    styled(
        total,
        "{spinner} {msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {eta}",
    )
}

fn styled(len: u64, template: &str) -> ProgressBar {
    // The templates are constants of this file, checked by its tests.
    let style = ProgressStyle::with_template(template)
        .expect("a valid template")
        .progress_chars("=> ");
    let bar = ProgressBar::new(len).with_style(style);
    bar.enable_steady_tick(TICK);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_templates_are_valid() {
        steps(3).finish_and_clear();
        bytes(3).finish_and_clear();
    }

    #[test]
    fn bars_are_hidden_when_stderr_is_not_a_terminal() {
        // `cargo test` captures nothing of stderr, but under CI it is a pipe or a file.
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() {
            assert!(steps(3).is_hidden());
            assert!(bytes(3).is_hidden());
        }
    }
}
