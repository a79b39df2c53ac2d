//! Reading a file with `O_DIRECT`: straight from the drive into our memory, past the
//! page cache, with several positioned reads in flight.
//!
//! A file read once (a checkpoint larger than the free page cache, say) gains nothing from
//! the page cache and pays for it twice: a copy out of the cache, and the evictions that
//! make room. `O_DIRECT` skips both, but asks that the buffer address, the file offset and
//! the length be multiples of the device's logical block size; [`DIRECT_ALIGN`] (4096, the
//! largest common one) serves every device. A cold NVMe drive also needs a queue of
//! requests to reach its speed, hence up to [`READ_THREADS`] reads at once.
//!
//! Where the filesystem refuses `O_DIRECT` (`EINVAL` when it is turned on, or on a read),
//! or where `TENSORFERRY_DIRECT_IO=0` turns it off, the same reads go through the page
//! cache instead, and the reason is kept for the caller to report.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::fs_name::filesystem_name;
use crate::error::{Error, Result};

/// What `O_DIRECT` needs aligned (buffer address, file offset, length): the largest
/// logical block size of common devices, so it serves all of them.
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// Bytes one positioned read asks for.
const READ_BYTES: usize = 4 << 20;

/// Positioned reads in flight at once.
const READ_THREADS: usize = 8;

/// The environment variable that turns `O_DIRECT` off when set to `0`.
pub(crate) const DIRECT_ENV: &str = "TENSORFERRY_DIRECT_IO";

/// A range of a file widened to [`DIRECT_ALIGN`] at both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    /// First byte read (aligned).
    pub start: u64,
    /// Bytes read (aligned).
    pub len: usize,
    /// Where the range asked for begins inside the window.
    pub skip: usize,
}

impl Window {
    /// The aligned window covering the bytes `[from, to)` of a file.
    pub(crate) fn covering(from: u64, to: u64) -> Window {
        let align = DIRECT_ALIGN as u64;
        let start = from / align * align;
        let end = to.max(from).div_ceil(align) * align;
        Window {
            start,
            len: (end - start) as usize,
            skip: (from - start) as usize,
        }
    }
}

/// A file read with positioned reads, several at once: with `O_DIRECT` when asked for
/// and the filesystem allows it, else through the page cache (and the reason why).
pub(crate) struct Reader {
    file: File,
    path: PathBuf,
    file_len: u64,
    direct: bool,
    fallback: Option<String>,
    /// Tests only: direct reads fail with `EINVAL`, as on a filesystem that accepts the
    /// flag but refuses the reads.
    #[cfg(test)]
    refuse_direct_reads: bool,
}

impl Reader {
    /// Reads `file` (`file_len` bytes at `path`) directly when `direct` and the
    /// filesystem allows it. A refusal is not an error: the reads go through the page
    /// cache and [`Reader::fallback`] says why.
    pub(crate) fn new(file: File, path: &Path, file_len: u64, direct: bool) -> Reader {
        let mut reader = Reader {
            file,
            path: path.to_path_buf(),
            file_len,
            direct: false,
            fallback: None,
            #[cfg(test)]
            refuse_direct_reads: false,
        };
        if !direct {
            return reader;
        }
        if std::env::var_os(DIRECT_ENV).is_some_and(|v| v == "0") {
            reader.fallback = Some(format!(
                "{DIRECT_ENV}=0 turned O_DIRECT off: read through the page cache"
            ));
            return reader;
        }
        match set_direct(&reader.file, true) {
            Ok(()) => reader.direct = true,
            Err(e) => reader.fallback = Some(refusal(&reader.file, "O_DIRECT", &e)),
        }
        reader
    }

    /// The path the file was opened at (which errors name).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Why the reads went through the page cache although `O_DIRECT` was asked for.
    pub(crate) fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// True while reads bypass the page cache.
    #[cfg(test)]
    pub(crate) fn is_direct(&self) -> bool {
        self.direct
    }

    /// Reads the file from byte `at` into `buf`: every byte before the file's end must
    /// arrive (a file that ends sooner than its size said is an [`Error::Io`] of kind
    /// `UnexpectedEof`); bytes of `buf` past the end keep what they held. While reading
    /// directly, `buf`'s address and length and `at` must be multiples of
    /// [`DIRECT_ALIGN`].
    pub(crate) fn read_into(&mut self, buf: &mut [u8], at: u64) -> Result<()> {
        // SAFETY: `buf` is valid for writes of its length, and borrowed exclusively for
        // the call.
        unsafe { self.read_raw(buf.as_mut_ptr(), buf.len(), at) }
    }

    /// As [`Reader::read_into`], into the `len` bytes at `dst`, which need not be
    /// initialised: only the bytes the reads deliver are written.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes, and nothing else may read or write
    /// them during the call.
    pub(crate) unsafe fn read_raw(&mut self, dst: *mut u8, len: usize, at: u64) -> Result<()> {
        if self.direct {
            debug_assert!(
                (dst as usize | len | at as usize) % DIRECT_ALIGN == 0,
                "direct reads must be aligned"
            );
            // SAFETY: forwarded contract.
            match unsafe { self.read_parallel(dst, len, at) } {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(EINVAL) => {
                    // Turned off for this read and every later one; the file is the same.
                    set_direct(&self.file, false).map_err(|e| Error::io("read", &self.path, e))?;
                    self.direct = false;
                    self.fallback = Some(refusal(&self.file, "an O_DIRECT read", &e));
                }
                Err(e) => return Err(Error::io("read", &self.path, e)),
            }
        }
        // SAFETY: forwarded contract.
        unsafe { self.read_parallel(dst, len, at) }.map_err(|e| Error::io("read", &self.path, e))
    }

    /// Reads `[at, at + len)` of the file into `dst` in pieces of [`READ_BYTES`], up to
    /// [`READ_THREADS`] at once; the first error stops the rest.
    ///
    /// # Safety
    /// As [`Reader::read_raw`].
    unsafe fn read_parallel(&self, dst: *mut u8, len: usize, at: u64) -> io::Result<()> {
        let mut pieces = Vec::with_capacity(len.div_ceil(READ_BYTES));
        cut_pieces(Address(dst), len, at, &mut pieces);
        // SAFETY: forwarded contract; the pieces are disjoint parts of `dst`'s bytes.
        unsafe { self.read_pieces(&pieces, READ_THREADS) }
    }

    /// Reads each `(at, buf)` of `targets` (the file's bytes from `at`, `buf.len()` of
    /// them, into `buf`) through the page cache, in pieces of at most [`READ_BYTES`], up
    /// to `threads` at once; the first error stops the rest. Every target must lie inside
    /// the file as its size said: else an [`Error::Format`] naming the file and the byte.
    pub(crate) fn read_scattered(
        &self,
        targets: &mut [(u64, &mut [u8])],
        threads: usize,
    ) -> Result<()> {
        debug_assert!(!self.direct, "scattered reads go through the page cache");
        let mut pieces = Vec::new();
        for (at, buf) in targets.iter_mut() {
            if at
                .checked_add(buf.len() as u64)
                .is_none_or(|end| end > self.file_len)
            {
                return Err(Error::Format {
                    at: format!("{}: byte {at}", self.path.display()),
                    reason: format!(
                        "the file ends at byte {}, before the {} bytes asked for from there",
                        self.file_len,
                        buf.len()
                    ),
                });
            }
            cut_pieces(Address(buf.as_mut_ptr()), buf.len(), *at, &mut pieces);
        }
        // SAFETY: each target is a distinct `&mut [u8]`, borrowed exclusively for the call,
        // and the pieces are disjoint parts of them.
        unsafe { self.read_pieces(&pieces, threads.max(1)) }
            .map_err(|e| Error::io("read", &self.path, e))
    }

    /// Reads every piece, up to `threads` at once (one at a time where positioned reads
    /// share a cursor); the first error stops the rest.
    ///
    /// # Safety
    /// Each piece's `dst` must be valid for writes of its `len` bytes, the pieces must not
    /// overlap, and nothing else may read or write them during the call.
    unsafe fn read_pieces(&self, pieces: &[Piece], threads: usize) -> io::Result<()> {
        let threads = if cfg!(unix) {
            pieces.len().min(threads)
        } else {
            1 // positioned reads move a shared cursor there: one at a time
        };
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let failure: Mutex<Option<io::Error>> = Mutex::new(None);
        let work = || {
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = pieces.get(i) else { break };
                // SAFETY: the pieces are disjoint, each handed to one thread only (by
                // `next`); the caller's contract covers the rest.
                let read = unsafe { self.read_piece(p.dst.0, p.len, p.at) };
                if let Err(e) = read {
                    stop.store(true, Ordering::Relaxed);
                    failure
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                }
            }
        };
        if threads <= 1 {
            work();
        } else {
            std::thread::scope(|scope| {
                for _ in 1..threads {
                    scope.spawn(work);
                }
                work();
            });
        }
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Reads one piece: repeats short reads until every byte before the file's end (as
    /// its size said) has arrived.
    ///
    /// # Safety
    /// As [`Reader::read_raw`].
    unsafe fn read_piece(&self, dst: *mut u8, len: usize, at: u64) -> io::Result<()> {
        let wanted = self.file_len.saturating_sub(at).min(len as u64) as usize;
        let mut done = 0;
        while done < wanted {
            #[cfg(test)]
            if self.direct && self.refuse_direct_reads {
                return Err(io::Error::from_raw_os_error(EINVAL));
            }
            // SAFETY: `done < wanted <= len`: the rest of the piece is inside `dst`'s bytes.
            let read = unsafe {
                read_at(
                    &self.file,
                    dst.wrapping_add(done),
                    len - done,
                    at + done as u64,
                )
            };
            match read {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "the file ended at byte {}, before the {} bytes its size promised",
                            at + done as u64,
                            self.file_len
                        ),
                    ))
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// An address that crosses to the reading threads.
#[derive(Clone, Copy)]
struct Address(*mut u8);

// SAFETY: only an address; `read_parallel` hands each thread its own disjoint part of it.
unsafe impl Send for Address {}
// SAFETY: see `Send`.
unsafe impl Sync for Address {}

impl Address {
    fn at(self, offset: usize) -> Address {
        Address(self.0.wrapping_add(offset))
    }
}

/// One positioned read of the many a call makes: `len` bytes of the file from `at`, to `dst`.
struct Piece {
    dst: Address,
    len: usize,
    at: u64,
}

/// Appends the pieces of at most [`READ_BYTES`] that read `len` bytes from `at` to `dst`.
fn cut_pieces(dst: Address, len: usize, at: u64, pieces: &mut Vec<Piece>) {
    for offset in (0..len).step_by(READ_BYTES) {
        pieces.push(Piece {
            dst: dst.at(offset),
            len: READ_BYTES.min(len - offset),
            at: at + offset as u64,
        });
    }
}

/// `EINVAL`: the same number on Linux, macOS and the BSDs.
const EINVAL: i32 = 22;

/// Why `what` was not done directly, in words: "tmpfs refused O_DIRECT (EINVAL): read
/// through the page cache".
fn refusal(file: &File, what: &str, e: &io::Error) -> String {
    let why = match e.raw_os_error() {
        Some(EINVAL) => "EINVAL".to_string(),
        _ => e.to_string(),
    };
    if e.kind() == io::ErrorKind::Unsupported {
        return format!("{what} is not available on this platform: read through the page cache");
    }
    format!(
        "{} refused {what} ({why}): read through the page cache",
        filesystem_name(file)
    )
}

/// Turns `O_DIRECT` on or off for every read of `file`.
#[cfg(target_os = "linux")]
fn set_direct(file: &File, on: bool) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: `F_GETFL` on a descriptor open for the life of `file`; no pointers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = if on {
        flags | libc::O_DIRECT
    } else {
        flags & !libc::O_DIRECT
    };
    // SAFETY: as above; `F_SETFL` only changes the file's status flags.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Turns `O_DIRECT` on or off: only Linux has it.
#[cfg(not(target_os = "linux"))]
fn set_direct(_file: &File, on: bool) -> io::Result<()> {
    if on {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    } else {
        Ok(())
    }
}

/// One positioned read of up to `len` bytes at `at` into `dst`.
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes that nothing else accesses meanwhile.
#[cfg(unix)]
unsafe fn read_at(file: &File, dst: *mut u8, len: usize, at: u64) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let offset = libc::off_t::try_from(at)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset past off_t"))?;
    // SAFETY: the caller's contract: `dst` is writable for `len` bytes, and the kernel
    // writes at most `len`; the descriptor is open for the life of `file`.
    let n = unsafe { libc::pread(file.as_raw_fd(), dst.cast(), len, offset) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// One read of up to `len` bytes at `at` into `dst` (through the file's cursor: callers
/// read one piece at a time here).
///
/// # Safety
/// As the Unix version.
#[cfg(not(unix))]
unsafe fn read_at(file: &File, dst: *mut u8, len: usize, at: u64) -> io::Result<usize> {
    use std::io::{Read, Seek, SeekFrom};
    // SAFETY: the caller's contract; the bytes are zeroed first, so the slice made of
    // them is initialised.
    let buf = unsafe {
        std::ptr::write_bytes(dst, 0, len);
        std::slice::from_raw_parts_mut(dst, len)
    };
    let mut file = file;
    file.seek(SeekFrom::Start(at))?;
    file.read(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::AlignedBuffer;

    use crate::io::fs::test_files::pattern;

    /// A temporary file of `bytes`, and the file opened for reading.
    fn file_of(bytes: &[u8]) -> (tempfile::NamedTempFile, File) {
        let f = crate::io::fs::test_files::file_of(bytes);
        let file = File::open(f.path()).unwrap();
        (f, file)
    }

    #[test]
    fn windows_widen_to_whole_blocks_and_know_where_the_range_begins() {
        let w = Window::covering(4100, 10_000);
        assert_eq!((w.start, w.len, w.skip), (4096, 8192, 4));
        assert_eq!(Window::covering(8192, 8192).len, 0);
        assert_eq!(Window::covering(0, 1).len, 4096);
    }

    #[test]
    fn a_read_delivers_every_byte_up_to_the_files_end_in_many_pieces() {
        let bytes = pattern(3 * READ_BYTES + 12_345);
        let (tmp, file) = file_of(&bytes);
        let mut reader = Reader::new(file, tmp.path(), bytes.len() as u64, true);
        let w = Window::covering(100, bytes.len() as u64);
        let mut buf = AlignedBuffer::zeroed_page_aligned(w.len).unwrap();
        reader.read_into(buf.as_mut_slice(), w.start).unwrap();
        assert_eq!(
            &buf.as_slice()[w.skip..w.skip + bytes.len() - 100],
            &bytes[100..]
        );
        assert!(buf.as_slice()[bytes.len()..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_read_refused_midway_goes_through_the_page_cache_and_says_why() {
        let bytes = pattern(10_000);
        let (tmp, file) = file_of(&bytes);
        let mut reader = Reader::new(file, tmp.path(), bytes.len() as u64, true);
        if !reader.is_direct() {
            eprintln!("skipped: {}", reader.fallback().unwrap_or("no O_DIRECT"));
            return;
        }
        reader.refuse_direct_reads = true;
        let mut buf = AlignedBuffer::zeroed_page_aligned(12_288).unwrap();
        reader.read_into(buf.as_mut_slice(), 0).unwrap();
        assert_eq!(&buf.as_slice()[..bytes.len()], &bytes[..]);
        assert!(!reader.is_direct());
        let why = reader.fallback().unwrap();
        assert!(
            why.contains("refused an O_DIRECT read (EINVAL): read through the page cache"),
            "{why}"
        );
    }

    #[test]
    fn a_file_shorter_than_its_size_said_is_an_unexpected_eof() {
        let bytes = pattern(5000);
        let (tmp, file) = file_of(&bytes);
        let mut reader = Reader::new(file, tmp.path(), 9000, false);
        let mut buf = vec![0u8; 8192];
        let err = reader.read_into(&mut buf, 0).unwrap_err();
        match err {
            Error::Io { source, .. } => {
                assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof);
                assert!(
                    source.to_string().contains("ended at byte 5000"),
                    "{source}"
                );
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn refusals_name_the_filesystem_and_the_error() {
        let (_tmp, file) = file_of(b"x");
        let why = refusal(&file, "O_DIRECT", &io::Error::from_raw_os_error(EINVAL));
        assert!(
            why.ends_with("refused O_DIRECT (EINVAL): read through the page cache"),
            "{why}"
        );
    }
}
