//! Which paths name something a safetensors file can be read from or saved over.
//!
//! Only regular files qualify. A FIFO or a terminal would block a read forever, a
//! character device such as `/dev/zero` never ends, and saving by rename over a device
//! node would replace the node itself; a folder is refused with the operating system's
//! own `EISDIR`, so callers (Python's `IsADirectoryError`) can tell it apart.

use std::fs::{self, File, Metadata};
use std::io;
use std::path::Path;

use crate::error::{Error, Result};

/// The error a read of a folder gives: `EISDIR` where the platform has it.
fn is_a_directory() -> io::Error {
    #[cfg(unix)]
    {
        io::Error::from_raw_os_error(libc::EISDIR)
    }
    #[cfg(not(unix))]
    {
        io::Error::new(io::ErrorKind::IsADirectory, "Is a directory")
    }
}

/// What a non-regular, non-folder file is, in words.
fn irregular_kind(meta: &Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let kind = meta.file_type();
        if kind.is_fifo() {
            return "a FIFO";
        }
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    #[cfg(not(unix))]
    let _ = meta;
    "an unknown kind of file"
}

/// Refuses anything but a regular file: a folder as [`Error::Io`] with `EISDIR`, other
/// kinds as [`Error::Io`] of kind `InvalidInput` whose message names the kind.
pub(crate) fn require_regular(op: &'static str, path: &Path, meta: &Metadata) -> Result<()> {
    let kind = meta.file_type();
    if kind.is_file() {
        return Ok(());
    }
    if kind.is_dir() {
        return Err(Error::io(op, path, is_a_directory()));
    }
    Err(Error::io(
        op,
        path,
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("is {}, not a regular file", irregular_kind(meta)),
        ),
    ))
}

/// Opens `path` for reading and returns the file and its length, refusing anything but a
/// regular file before any read could block.
///
/// The path is checked before it is opened, and opened without blocking (`O_NONBLOCK`:
/// opening a FIFO for reading would otherwise wait for a writer, also one swapped in after
/// the check), then the open file is checked again. Files of the kernel's pseudo
/// filesystems (`/proc`, `/sys`) look regular but are not files of bytes: refused too.
pub(crate) fn open_regular(path: &Path) -> Result<(File, u64)> {
    let before = fs::metadata(path).map_err(|e| Error::io("open", path, e))?;
    require_regular("open", path, &before)?;
    let file = open_without_blocking(path).map_err(|e| Error::io("open", path, e))?;
    let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
    require_regular("open", path, &meta)?;
    refuse_pseudo_files(path, &file)?;
    Ok((file, meta.len()))
}

#[cfg(unix)]
fn open_without_blocking(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    // Non-blocking only changes how a FIFO or device opens; reads of a regular file (the
    // only kind kept) are not affected by the flag.
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

#[cfg(not(unix))]
fn open_without_blocking(path: &Path) -> io::Result<File> {
    File::open(path)
}

/// Refuses files of procfs and sysfs, whose sizes say nothing of their contents.
#[cfg(target_os = "linux")]
fn refuse_pseudo_files(path: &Path, file: &File) -> Result<()> {
    use std::os::fd::AsRawFd;
    const PROC_SUPER_MAGIC: i64 = 0x9fa0;
    const SYSFS_MAGIC: i64 = 0x6265_6572;
    // SAFETY: `statfs` is plain old data, so all-zero is a valid value to be overwritten.
    let mut fs_info: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is open for the life of `file`; the out pointer is live.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs_info) } != 0 {
        return Ok(()); // no answer: the size checks that follow still hold
    }
    let kind = match fs_info.f_type as i64 {
        PROC_SUPER_MAGIC => "a file of /proc",
        SYSFS_MAGIC => "a file of /sys",
        _ => return Ok(()),
    };
    Err(Error::io(
        "open",
        path,
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("is {kind}, not a regular file"),
        ),
    ))
}

#[cfg(not(target_os = "linux"))]
fn refuse_pseudo_files(_path: &Path, _file: &File) -> Result<()> {
    Ok(())
}
