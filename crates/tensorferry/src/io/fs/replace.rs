//! Replacing a file atomically: a temporary file in the target's folder is written,
//! synced and renamed over the target, so a failure at any point leaves the previous
//! file as it was and no temporary file behind. [`super::checkpoint`] decides when the
//! rename happens.
//!
//! What a user expects of the replaced file is kept: its permission bits (and its owner
//! and group, as far as the process may set them); a new file gets what `open` would give
//! it (0o666 less the umask). A symbolic link stays a link: the file it points to is the
//! one replaced, through a temporary file in that file's folder. Only a regular file is
//! replaced: a folder, a FIFO or a device node at the path is an error.

use std::fs::{self, File, Metadata};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use super::file_kind::require_regular;
use super::temp_files;
use crate::error::{Error, Result};

/// Links followed at most (as Linux's `MAXSYMLINKS`).
const MAX_LINKS: usize = 40;

/// A file written (and synced, when asked) under a temporary name beside its target, not
/// yet in place: [`Staged::commit`] renames it over the target; dropping it uncommitted
/// removes it.
pub(crate) struct Staged {
    tmp: PathBuf,
    target: PathBuf,
    shown: PathBuf,
}

/// Writes with `write` a temporary file that will replace the file `path` names (links
/// at its end followed) when committed. A file at `path` must be a regular file the
/// process may write, as `open(path, "wb")` requires: a read-only file is a
/// `PermissionError`, untouched. The temporary file gets that file's owner and mode.
pub(crate) fn stage(
    path: &Path,
    fsync: bool,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<()>,
) -> Result<Staged> {
    let target = resolve_links(path)?;
    let existing = match fs::metadata(&target) {
        Ok(meta) => {
            require_regular("save to", path, &meta)?;
            // Refused where `open(path, "wb")` would be (a read-only file for anyone but
            // root): a read-only checkpoint is a user's way of keeping it.
            fs::OpenOptions::new()
                .write(true)
                .open(&target)
                .map_err(|e| Error::io("save to", path, e))?;
            Some(meta)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io("save to", path, e)),
    };
    let folder = folder_of(&target);
    let (tmp, file) = temp_files::create_in(folder)
        .map_err(|e| Error::io("create a temporary file for", missing_folder_or(path), e))?;
    let staged = Staged {
        tmp,
        target,
        shown: path.to_path_buf(),
    };
    if let Some(meta) = &existing {
        keep_owner_and_mode(&file, meta)
            .map_err(|e| Error::io("keep the permissions of", path, e))?;
    }
    let mut out = BufWriter::with_capacity(1 << 20, file);
    write(&mut out)?;
    let file = out
        .into_inner()
        .map_err(|e| Error::io("write", path, e.into_error()))?;
    if fsync {
        file.sync_all().map_err(|e| Error::io("sync", path, e))?;
    }
    Ok(staged)
}

impl Staged {
    /// Renames the file over its target (the folder is not synced: see [`sync_folder`]).
    pub(crate) fn commit(self) -> Result<()> {
        let target = self.target.clone();
        self.commit_as(&target)
    }

    /// Renames the file to `other`, in the same folder, instead of its target.
    pub(crate) fn commit_as(mut self, other: &Path) -> Result<()> {
        let tmp = std::mem::take(&mut self.tmp);
        fs::rename(&tmp, other).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            Error::io("rename into", &self.shown, e)
        })
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Replaces the file `path` names with `bytes` ([`stage`], then [`Staged::commit`]); with
/// `fsync`, the file and then its folder are synced, so the new file survives a crash.
pub(crate) fn replace_with(path: &Path, bytes: &[u8], fsync: bool) -> Result<()> {
    let staged = stage(path, fsync, |out| {
        out.write_all(bytes)
            .map_err(|e| Error::io("write", path, e))
    })?;
    let folder = folder_of(&staged.target).to_path_buf();
    staged.commit()?;
    if fsync {
        sync_folder(&folder)?;
    }
    Ok(())
}

/// Flushes `folder`'s entries (renames, removals) to stable storage.
pub(crate) fn sync_folder(folder: &Path) -> Result<()> {
    File::open(folder)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("sync folder", folder, e))
}

/// `path`'s folder when that folder does not exist (the error then names what is
/// missing), else `path`.
fn missing_folder_or(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() && !p.exists() => p,
        _ => path,
    }
}

/// The file a save to `path` replaces: `path` with the symbolic links at its end followed
/// (a link to a link too, relative targets from the link's folder); `path` itself when it
/// is not a link or does not exist.
fn resolve_links(path: &Path) -> Result<PathBuf> {
    let mut current = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match fs::symlink_metadata(&current) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target =
                    fs::read_link(&current).map_err(|e| Error::io("read the link", &current, e))?;
                // An absolute target replaces the folder in `join`.
                current = match current.parent() {
                    Some(folder) => folder.join(target),
                    None => target,
                };
            }
            _ => return Ok(current),
        }
    }
    // A loop, or a chain too long: the system's own error says which.
    let e = fs::metadata(path).err().unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many levels of symbolic links",
        )
    });
    Err(Error::io("save to", path, e))
}

/// The folder a file lies in (`.` for a bare name).
pub(crate) fn folder_of(file: &Path) -> &Path {
    match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Gives `file` the permission bits of `old`, and its owner and group where allowed
/// (root may set both; others their own groups); what is not allowed stays as created.
#[cfg(unix)]
fn keep_owner_and_mode(file: &File, old: &Metadata) -> io::Result<()> {
    use std::os::unix::fs::{fchown, MetadataExt, PermissionsExt};
    let now = file.metadata()?;
    if (now.uid(), now.gid()) != (old.uid(), old.gid())
        && fchown(file, Some(old.uid()), Some(old.gid())).is_err()
    {
        let _ = fchown(file, None, Some(old.gid()));
    }
    // After the owner: a change of owner may clear mode bits.
    file.set_permissions(fs::Permissions::from_mode(old.mode() & 0o777))
}

#[cfg(not(unix))]
fn keep_owner_and_mode(file: &File, old: &Metadata) -> io::Result<()> {
    file.set_permissions(old.permissions())
}
