//! Where the command's output goes, and how it ends.
//!
//! `println!` panics when standard output cannot be written: a reader that stopped early
//! (`| head`) or a full disk became a backtrace and status 101. Every command writes
//! through [`Out`] instead, whose write errors come back as [`Failure::Output`], and
//! [`exit_status`] turns each way of ending into its status and at most one line on
//! stderr.

use std::any::Any;
use std::cell::RefCell;
use std::fmt;
use std::io::{self, Write};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Mutex;

use crate::escape::controls_escaped;

/// Why a command stopped before its end.
#[derive(Debug)]
pub enum Failure {
    /// The library refused or failed.
    Library(tensorferry::Error),
    /// Standard output could not be written (a closed pipe, a full disk, …).
    Output(io::Error),
    /// The command cannot be done here, and the message says where it can.
    Refused(String),
    /// A bug: the command panicked, with the panic's message and place.
    Internal(String),
}

impl From<tensorferry::Error> for Failure {
    fn from(e: tensorferry::Error) -> Self {
        Failure::Library(e)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Library(e) => write!(f, "{e}"),
            Failure::Output(e) => write!(f, "cannot write the output: {e}"),
            Failure::Refused(why) => write!(f, "{why}"),
            Failure::Internal(what) => write!(f, "internal error (please report): {what}"),
        }
    }
}

/// Standard output, or any other writer in tests: what `write!` and `writeln!` write to
/// in the commands, each write's error a [`Failure::Output`] to pass on with `?`.
pub struct Out<W: Write> {
    inner: W,
}

impl<W: Write> Out<W> {
    /// Output into `inner` (a buffered, locked stdout in the command).
    pub fn new(inner: W) -> Self {
        Out { inner }
    }

    /// What `write!` and `writeln!` call.
    pub fn write_fmt(&mut self, args: fmt::Arguments<'_>) -> Result<(), Failure> {
        self.inner.write_fmt(args).map_err(Failure::Output)
    }

    /// Writes out whatever is buffered.
    pub fn flush(&mut self) -> Result<(), Failure> {
        self.inner.flush().map_err(Failure::Output)
    }
}

/// The first panic of the process, with its place.
static FIRST_PANIC: Mutex<Option<String>> = Mutex::new(None);

thread_local! {
    /// This thread's last panic, with its place.
    static THIS_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Runs `command`, a panic in it a [`Failure::Internal`] rather than a backtrace and
/// status 101. Panics print nothing while it runs: those of the library's worker threads
/// come back as the library's errors, the command's own as the one line of
/// [`exit_status`], which names the first panic of the process too when that is another
/// (a thread's, re-raised). The hook in place before is put back after: in a Python
/// process, PyO3's panics print as before once the command is done.
pub fn catching_panics(command: impl FnOnce() -> Result<(), Failure>) -> Result<(), Failure> {
    let previous = panic::take_hook();
    panic::set_hook(Box::new(|info| {
        let place = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let what = format!("{}{place}", panic_message(info.payload()));
        if let Ok(mut first) = FIRST_PANIC.lock() {
            first.get_or_insert_with(|| what.clone());
        }
        THIS_PANIC.with(|this| *this.borrow_mut() = Some(what));
    }));
    let outcome = panic::catch_unwind(AssertUnwindSafe(command));
    panic::set_hook(previous);
    match outcome {
        Ok(result) => result,
        Err(payload) => {
            let this = THIS_PANIC
                .with(|this| this.borrow_mut().take())
                .unwrap_or_else(|| panic_message(&*payload));
            let first = FIRST_PANIC.lock().ok().and_then(|mut first| first.take());
            Err(Failure::Internal(match first {
                Some(first) if first != this => format!("{this} (first: {first})"),
                _ => this,
            }))
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Status 0, when the reader of the output stopped early (`| head`): the command had
/// nothing left to say to anyone, so it ends quietly, as ripgrep does. Status 1 for
/// any other failure, told in one line on stderr.
pub fn exit_status(result: Result<(), Failure>) -> u8 {
    match result {
        Ok(()) => 0,
        Err(Failure::Output(e)) if e.kind() == io::ErrorKind::BrokenPipe => 0,
        Err(failure) => {
            say(&failure);
            1
        }
    }
}

/// One line on stderr, `tensorferry: <what>`, control characters escaped (a newline in a
/// message included). Nothing is left to tell of a failure to write it, so that failure is
/// ignored (`eprintln!` would panic).
pub fn say(what: &dyn fmt::Display) {
    let line = what.to_string();
    let _ = writeln!(
        io::stderr().lock(),
        "tensorferry: {}",
        controls_escaped(&line)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that fails every write with `kind`.
    struct Refusing(io::ErrorKind);

    impl Write for Refusing {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(self.0.into())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_failed_write_is_an_output_failure_of_its_kind() {
        let mut out = Out::new(Refusing(io::ErrorKind::StorageFull));
        match writeln!(out, "x {}", 1) {
            Err(Failure::Output(e)) => assert_eq!(e.kind(), io::ErrorKind::StorageFull),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_panic_becomes_an_internal_failure_naming_it_and_its_place() {
        let result = catching_panics(|| panic!("boom {}", 7));
        match result {
            Err(Failure::Internal(what)) => {
                assert!(what.starts_with("boom 7 at "), "{what}");
                assert!(what.contains("out.rs:"), "{what}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_closed_pipe_ends_with_success_and_other_failures_do_not() {
        let pipe = Failure::Output(io::ErrorKind::BrokenPipe.into());
        assert_eq!(exit_status(Err(pipe)), 0);
        let full = Failure::Output(io::ErrorKind::StorageFull.into());
        assert_eq!(exit_status(Err(full)), 1);
    }
}
