//! Scattered byte runs of one file read past the page cache: the part of a checkpoint one
//! rank of a process group reads (its tensors, its slices of others), with the `O_DIRECT`
//! [`Reader`] that whole-file loads use.
//!
//! `O_DIRECT` reads whole aligned blocks into aligned memory, while runs start and end
//! anywhere and go to buffers laid out by the caller. So the runs, in file order, are
//! gathered into spans (runs less than a block apart share one), each span is read in
//! aligned windows of at most [`WINDOW_BYTES`] into one reused bounce buffer, and each
//! window's bytes are copied to the runs that overlap it. Host memory beyond the
//! destinations stays one window; bytes read beyond those asked for stay under two blocks
//! per span.
//!
//! Runs read through the page cache straight into the caller's memory (a DCP reader's
//! tensors) go through the same [`Reader`], from a [`RunFile`].

use std::fs::File;
use std::path::Path;

use super::direct::{Reader, Window, DIRECT_ALIGN};
use super::file_kind::open_regular;
use crate::error::{Error, Result};
use crate::memory::AlignedBuffer;

/// The most bytes one window (and the bounce buffer) holds.
const WINDOW_BYTES: usize = 32 << 20;

/// One run: `len` bytes at file offset `at`, to go to byte `to` of destination `dest`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// First byte in the file.
    pub at: u64,
    /// Bytes in the run.
    pub len: usize,
    /// Index of the destination buffer.
    pub dest: usize,
    /// Where the run starts in its destination.
    pub to: usize,
}

/// What [`read_runs`] delivered.
pub struct RunsRead {
    /// One buffer per destination size asked for, holding its runs.
    pub buffers: Vec<AlignedBuffer>,
    /// Bytes read from the file (whole blocks: at least the runs' total).
    pub bytes_read: u64,
    /// Why the reads went through the page cache, if they did.
    pub fallback: Option<String>,
}

/// Reads `runs` of the file at `path` into fresh buffers of `sizes` bytes, with
/// `O_DIRECT` where the filesystem allows (else through the page cache, and
/// `RunsRead::fallback` says why). A run outside the file or its destination is an
/// error naming both.
///
/// ```no_run
/// use tensorferry::internal::io::{read_runs, Run};
/// let read = read_runs("model.safetensors".as_ref(), &[8], &[Run { at: 100, len: 8, dest: 0, to: 0 }])?;
/// assert_eq!(read.buffers[0].len(), 8);
/// # Ok::<(), tensorferry::Error>(())
/// ```
pub fn read_runs(path: &Path, sizes: &[usize], runs: &[Run]) -> Result<RunsRead> {
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let file_len = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    for r in runs {
        let fits_file =
            r.at.checked_add(r.len as u64)
                .is_some_and(|end| end <= file_len);
        let fits_dest = sizes
            .get(r.dest)
            .is_some_and(|&size| r.to.checked_add(r.len).is_some_and(|end| end <= size));
        if !fits_file || !fits_dest {
            return Err(Error::Format {
                at: format!("{}: byte {}", path.display(), r.at),
                reason: format!(
                    "a run of {} bytes to byte {} of destination {} does not fit the file's {} bytes \
                     or the destination",
                    r.len, r.to, r.dest, file_len
                ),
            });
        }
    }
    let mut buffers = sizes
        .iter()
        .map(|&n| AlignedBuffer::zeroed(n))
        .collect::<Result<Vec<_>>>()?;
    let mut order: Vec<Run> = runs.iter().copied().filter(|r| r.len > 0).collect();
    order.sort_unstable_by_key(|r| r.at);
    // Spans: runs that start less than a block after the span's end so far.
    let mut spans = Vec::new();
    let mut i = 0;
    while i < order.len() {
        let (lo, mut hi, mut j) = (order[i].at, order[i].at + order[i].len as u64, i + 1);
        while j < order.len() && order[j].at <= hi + DIRECT_ALIGN as u64 {
            hi = hi.max(order[j].at + order[j].len as u64);
            j += 1;
        }
        spans.push((Window::covering(lo, hi), i, j));
        i = j;
    }
    let widest = spans.iter().map(|(w, _, _)| w.len).max().unwrap_or(0);
    let mut bounce = AlignedBuffer::zeroed_page_aligned(widest.min(WINDOW_BYTES))?;
    let mut reader = Reader::new(file, path, file_len, true);
    let mut bytes_read = 0u64;
    for (span, i, j) in spans {
        let mut start = span.start;
        let end = span.start + span.len as u64;
        while start < end {
            let len = (end - start).min(WINDOW_BYTES as u64) as usize;
            let window = &mut bounce.as_mut_slice()[..len];
            reader.read_into(window, start)?;
            bytes_read += (start + len as u64).min(file_len) - start;
            for r in &order[i..j] {
                copy_overlap(window, start, r, &mut buffers[r.dest]);
            }
            start += len as u64;
        }
    }
    Ok(RunsRead {
        buffers,
        bytes_read,
        fallback: reader.fallback().map(String::from),
    })
}

/// A regular file open for reads of byte runs through the page cache, straight into the
/// caller's memory and several at once: the rank files of a DCP checkpoint, read by
/// `tensorferry.dcp` with the file kept open from its header to its last run.
pub struct RunFile {
    reader: Reader,
    meta: std::fs::Metadata,
}

impl RunFile {
    /// Opens the regular file at `path` (anything else is refused before a read could
    /// block, as every load refuses it).
    pub fn open(path: &Path) -> Result<RunFile> {
        let (file, len) = open_regular(path)?;
        let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
        Ok(RunFile {
            reader: Reader::new(file, path, len, false),
            meta,
        })
    }

    /// What the open file was when it was opened (its size, its inode, …): a caller that
    /// later finds another file at the path knows the file was replaced.
    pub fn metadata(&self) -> &std::fs::Metadata {
        &self.meta
    }

    /// The path the file was opened at (which errors name).
    pub fn path(&self) -> &Path {
        self.reader.path()
    }

    /// The file's size when it was opened.
    pub fn len(&self) -> u64 {
        self.meta.len()
    }

    /// True for an empty file.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills each `(at, buf)` of `targets` with the file's bytes from `at`, up to
    /// `threads` reads at once. A target past the file's end, or a file that turns out
    /// shorter than its size said (cut while it was read), is an [`Error::Format`] naming
    /// the file and the byte.
    pub fn read_into(&self, targets: &mut [(u64, &mut [u8])], threads: usize) -> Result<()> {
        self.reader
            .read_scattered(targets, threads)
            .map_err(|e| match e {
                Error::Io { path, source, .. }
                    if source.kind() == std::io::ErrorKind::UnexpectedEof =>
                {
                    Error::Format {
                        at: path.display().to_string(),
                        reason: source.to_string(),
                    }
                }
                other => other,
            })
    }
}

/// Copies the bytes of run `r` that the window (the file's bytes from `start`) holds to
/// their place in `dest`.
fn copy_overlap(window: &[u8], start: u64, r: &Run, dest: &mut AlignedBuffer) {
    let from = r.at.max(start);
    let to = (r.at + r.len as u64).min(start + window.len() as u64);
    if from >= to {
        return;
    }
    let n = (to - from) as usize;
    let src = (from - start) as usize;
    let dst = r.to + (from - r.at) as usize;
    dest.as_mut_slice()[dst..dst + n].copy_from_slice(&window[src..src + n]);
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::io::fs::test_files::{file_of, pattern};

    /// The run of `len` bytes from file byte `at` to byte `to` of buffer `dest`.
    fn run(at: u64, len: usize, dest: usize, to: usize) -> Run {
        Run { at, len, dest, to }
    }

    #[test]
    fn runs_land_where_asked_and_only_nearby_blocks_are_read() {
        let bytes = pattern(3 * WINDOW_BYTES + 10_000);
        let f = file_of(&bytes);
        let runs = [
            // Two runs a few bytes apart (one span), out of order, into one buffer.
            run(5000, 300, 0, 0),
            run(10, 4000, 0, 300),
            // A run across windows, into a second buffer at an offset.
            run(WINDOW_BYTES as u64 - 7, WINDOW_BYTES + 100, 1, 64),
            // The file's last bytes.
            run(bytes.len() as u64 - 5, 5, 0, 4300),
            run(0, 0, 0, 4305),
        ];
        let read = read_runs(f.path(), &[4305, 64 + WINDOW_BYTES + 100], &runs).unwrap();
        let (a, b) = (read.buffers[0].as_slice(), read.buffers[1].as_slice());
        assert_eq!(&a[..300], &bytes[5000..5300]);
        assert_eq!(&a[300..4300], &bytes[10..4010]);
        assert_eq!(&a[4300..], &bytes[bytes.len() - 5..]);
        let big = WINDOW_BYTES - 7;
        assert_eq!(&b[64..], &bytes[big..big + WINDOW_BYTES + 100]);
        assert!(b[..64].iter().all(|&x| x == 0));
        let asked: u64 = runs.iter().map(|r| r.len as u64).sum();
        assert!(read.bytes_read >= asked && read.bytes_read <= asked + 3 * 2 * DIRECT_ALIGN as u64);
    }

    #[test]
    fn a_run_file_fills_each_target_with_its_bytes_on_several_threads() {
        let bytes = pattern(2 * (4 << 20) + 5000);
        let f = file_of(&bytes);
        let file = RunFile::open(f.path()).unwrap();
        assert_eq!(file.len(), bytes.len() as u64);
        let (mut a, mut b, mut c) = (vec![0u8; 100], vec![0u8; (4 << 20) + 4000], vec![0u8; 0]);
        let mut targets = [(7u64, &mut a[..]), (1000, &mut b[..]), (3, &mut c[..])];
        file.read_into(&mut targets, 3).unwrap();
        assert_eq!(&a[..], &bytes[7..107]);
        assert_eq!(&b[..], &bytes[1000..1000 + b.len()]);
    }

    #[test]
    fn a_run_file_refuses_a_target_past_its_end_naming_it() {
        let f = file_of(&pattern(100));
        let file = RunFile::open(f.path()).unwrap();
        let mut buf = [0u8; 10];
        let err = file.read_into(&mut [(95, &mut buf[..])], 2).err().unwrap();
        let text = err.to_string();
        assert!(matches!(err, Error::Format { .. }), "{text}");
        assert!(
            text.contains(&f.path().display().to_string()) && text.contains("byte 95"),
            "{text}"
        );
    }

    #[test]
    fn a_run_file_cut_while_open_is_a_format_error_naming_it() {
        let f = file_of(&pattern(10_000));
        let file = RunFile::open(f.path()).unwrap();
        f.as_file().set_len(100).unwrap();
        let mut buf = [0u8; 1000];
        let err = file.read_into(&mut [(50, &mut buf[..])], 1).err().unwrap();
        let text = err.to_string();
        assert!(matches!(err, Error::Format { .. }), "{text}");
        assert!(text.contains(&f.path().display().to_string()), "{text}");
    }

    #[test]
    fn a_run_file_is_only_ever_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = RunFile::open(dir.path()).err().unwrap();
        assert!(matches!(err, Error::Io { .. }), "{err}");
    }

    #[test]
    fn a_run_past_the_files_end_is_refused_naming_the_file() {
        let f = file_of(&pattern(100));
        let err = read_runs(f.path(), &[10], &[run(95, 10, 0, 0)])
            .err()
            .unwrap();
        let text = err.to_string();
        assert!(
            text.contains(&f.path().display().to_string()) && text.contains("100 bytes"),
            "{text}"
        );
    }
}
