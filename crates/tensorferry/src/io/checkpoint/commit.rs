//! Replacing a checkpoint as a whole. A checkpoint named `dir/stem.safetensors` is either
//! that one file, or shards named by the index `dir/stem.safetensors.index.json` (the
//! Hugging Face layout). A save replaces whichever was there with whichever it writes, so
//! that a process killed at any point, or a save that fails, leaves a folder that loads as
//! the old checkpoint or the new one, entirely, through tensorferry and through the
//! index's other readers (transformers, safetensors, vLLM):
//!
//! 1. every new file is written under a temporary name and synced, with no lock held;
//! 2. under an exclusive lock on the folder (`flock`; where the filesystem has none, no
//!    lock), the shards take names of their own for this save,
//!    `stem-00001-of-00008.<save id>.safetensors`, which no earlier checkpoint names, and
//!    the index naming them replaces the old one: the commit. A single file is committed
//!    by its rename;
//! 3. where the folder allows hard links, each shard also takes its usual name
//!    (`stem-00001-of-00008.safetensors`, replaced atomically) and a second index names
//!    those;
//! 4. what the previous checkpoint of that name held and the new one does not is
//!    removed: its single file or its index, the files its index named, and files of
//!    saves that died in step 2 or 3 (names of the save-id form). Nothing else in the
//!    folder is touched.
//!
//! A folder holding both `stem.safetensors` and its index loads as the single file, as
//! transformers does: a sharded save over a single file commits when it removes that
//! file, a single-file save over shards when its file appears. Saves into one folder from
//! several threads or processes take turns for steps 2-4, so each leaves one whole
//! checkpoint and the last to commit wins.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use super::index::{index_bytes, read_index, INDEX_SUFFIX, REPLACES_KEY};
use crate::error::{Error, Result};
use crate::io::fs::replace::{replace_with, sync_folder, Staged};
use crate::io::fs::temp_files;

/// A checkpoint's place: its folder and stem.
pub(crate) struct Place {
    /// The folder that holds it.
    pub(crate) dir: PathBuf,
    /// Its name without `.safetensors`.
    pub(crate) stem: String,
    /// The single file (the path as the user gave it).
    pub(crate) single: PathBuf,
}

impl Place {
    /// The place of a save to `path`: `dir/stem.safetensors` (or `dir/stem`); a path
    /// naming a folder (an existing one, or one ending in `/`) means
    /// `folder/model.safetensors`, and that folder is created as `save_pretrained` does.
    pub(crate) fn of(path: &Path) -> Result<Place> {
        let as_folder = path.is_dir() || path.as_os_str().to_string_lossy().ends_with('/');
        if as_folder {
            fs::create_dir_all(path).map_err(|e| Error::io("create the folder", path, e))?;
            return Place::of(&path.join("model.safetensors"));
        }
        let name =
            path.file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| Error::InvalidValue {
                    key: String::new(),
                    reason: format!("{path:?} does not end in a file name"),
                })?;
        let stem = stem_of(name);
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        match fs::metadata(&dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(Error::io("save into the folder", &dir, not_a_directory())),
            Err(e) => return Err(Error::io("save into the folder", &dir, e)),
        }
        Ok(Place {
            single: path.to_path_buf(),
            stem: stem.to_string(),
            dir,
        })
    }

    /// The index's path.
    pub(crate) fn index(&self) -> PathBuf {
        self.dir.join(format!("{}{INDEX_SUFFIX}", self.stem))
    }

    /// The usual name of shard `i` (from 1) of `n`.
    pub(crate) fn shard_name(&self, i: usize, n: usize) -> String {
        format!("{}-{i:05}-of-{n:05}.safetensors", self.stem)
    }

    /// Whether `name` has the form of [`saved_shard_name`] for this stem; its usual
    /// name if so.
    fn usual_name_of_saved(&self, name: &str) -> Option<String> {
        let rest = name.strip_prefix(&self.stem)?.strip_prefix('-')?;
        let rest = rest.strip_suffix(".safetensors")?;
        let (numbers, id) = rest.split_once('.')?;
        let (i, n) = numbers.split_once("-of-")?;
        let digits = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_digit());
        let hex = id.len() == ID_LEN && id.bytes().all(|b| b.is_ascii_hexdigit());
        (digits(i, 5) && digits(n, 5) && hex)
            .then(|| format!("{}-{i}-of-{n}.safetensors", self.stem))
    }
}

/// The checkpoint file `name` without `.safetensors`.
pub(crate) fn stem_of(name: &str) -> &str {
    name.strip_suffix(".safetensors").unwrap_or(name)
}

/// The name shard `i` (from 1) of `n` of the checkpoint `stem` takes in the save `id`:
/// one no earlier checkpoint names.
pub(crate) fn saved_shard_name(stem: &str, i: usize, n: usize, id: &str) -> String {
    format!("{stem}-{i:05}-of-{n:05}.{id}.safetensors")
}

/// `ENOTDIR`, with its number (Python's `NotADirectoryError` needs it).
fn not_a_directory() -> io::Error {
    #[cfg(unix)]
    return io::Error::from_raw_os_error(libc::ENOTDIR);
    #[cfg(not(unix))]
    return io::ErrorKind::NotADirectory.into();
}

/// Hex digits of a save id.
const ID_LEN: usize = 16;

/// An exclusive lock on a folder, held until dropped (closing the folder releases it);
/// none where the filesystem has no locks.
struct FolderLock {
    _held: Option<File>,
}

fn lock(dir: &Path) -> Result<FolderLock> {
    let folder = File::open(dir).map_err(|e| Error::io("open the folder", dir, e))?;
    match lock_exclusive(&folder) {
        Ok(()) => Ok(FolderLock {
            _held: Some(folder),
        }),
        // NFS without a lock manager, FUSE filesystems without locks: saves into one
        // folder from two processes at once may then mix (README says so).
        Err(e) if has_no_locks(&e) => Ok(FolderLock { _held: None }),
        Err(e) => Err(Error::io("lock the folder", dir, e)),
    }
}

/// `flock(LOCK_EX)`, retried when a signal interrupts the wait.
#[cfg(unix)]
fn lock_exclusive(file: &File) -> io::Result<()> {
    use std::os::unix::io::AsRawFd;
    loop {
        // SAFETY: `flock` takes a descriptor and a flag, and touches no memory of ours;
        // `file` is open for the whole call, so the descriptor is valid.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(not(unix))]
fn lock_exclusive(_: &File) -> io::Result<()> {
    Err(io::ErrorKind::Unsupported.into())
}

#[cfg(unix)]
fn has_no_locks(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS)
    )
}

#[cfg(not(unix))]
fn has_no_locks(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::Unsupported
}

/// Commits `staged` (written to replace `place.single`) as the checkpoint at `place`,
/// then removes the previous checkpoint's index and shards, if it was sharded.
pub(crate) fn commit_single(place: &Place, staged: Staged, fsync: bool) -> Result<()> {
    let _lock = lock(&place.dir)?;
    let previous = previous_files(place);
    staged.commit()?;
    if fsync {
        sync_folder(&place.dir)?;
    }
    // The index goes last: until then it names what is left to remove, for the next
    // save to finish if this process dies here (the single file loads first meanwhile).
    remove_unnamed(place, previous, &[], &place.single, fsync)?;
    match fs::remove_file(place.index()) {
        Ok(()) if fsync => sync_folder(&place.dir),
        _ => Ok(()),
    }
}

/// A shard written, waiting for its commit.
pub(crate) struct StagedShard {
    pub(crate) file: Staged,
    /// The tensor names it holds.
    pub(crate) names: Vec<String>,
}

/// Commits `shards` (in order), written by the save `id` ([`save_id`]), as the
/// checkpoint at `place`, with an index whose `metadata` is `metadata`; returns the files
/// of the checkpoint, the index last.
pub(crate) fn commit_sharded(
    place: &Place,
    id: &str,
    shards: Vec<StagedShard>,
    metadata: serde_json::Value,
    fsync: bool,
) -> Result<Vec<PathBuf>> {
    let n = shards.len();
    let _lock = lock(&place.dir)?;
    let previous = previous_files(place);
    let usual: Vec<String> = (1..=n).map(|i| place.shard_name(i, n)).collect();
    let mut metadata = metadata;
    let replaced: Vec<&String> = previous
        .iter()
        .filter(|f| !usual.contains(f) && f.ends_with(".safetensors"))
        .collect();
    if let Some(map) = metadata.as_object_mut() {
        map.insert(REPLACES_KEY.into(), serde_json::json!(replaced));
    }
    let mut saved = Vec::with_capacity(n);
    let mut names = Vec::with_capacity(n);
    for (i, shard) in shards.into_iter().enumerate() {
        let name = saved_shard_name(&place.stem, i + 1, n, id);
        shard.file.commit_as(&place.dir.join(&name))?;
        saved.push(name);
        names.push(shard.names);
    }
    let index = place.index();
    let write_index = |files: &[String]| -> Result<()> {
        replace_with(&index, &index_bytes(&metadata, files, &names), fsync)
    };
    if fsync {
        // The shards' names reach the disk before the index that names them.
        sync_folder(&place.dir)?;
    }
    write_index(&saved)?;
    // The new checkpoint is whole; it loads once no single file of that name stands
    // before it.
    match fs::remove_file(&place.single) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(Error::io(
                "remove the previous checkpoint",
                &place.single,
                e,
            ))
        }
    }
    let files = if link_all(place, &saved, &usual) {
        write_index(&usual)?;
        usual
    } else {
        saved
    };
    remove_unnamed(place, previous, &files, &index, fsync)?;
    let mut written: Vec<PathBuf> = files.iter().map(|f| place.dir.join(f)).collect();
    written.push(index);
    Ok(written)
}

/// Gives each saved shard its usual name too (hard links, each replacing the name
/// atomically); false where the folder does not allow it.
fn link_all(place: &Place, saved: &[String], usual: &[String]) -> bool {
    saved.iter().zip(usual).all(|(from, to)| {
        match temp_files::link_in(&place.dir, &place.dir.join(from)) {
            Ok(tmp) => fs::rename(&tmp, place.dir.join(to))
                .map_err(|_| {
                    let _ = fs::remove_file(&tmp);
                })
                .is_ok(),
            Err(_) => false,
        }
    })
}

/// The files of the checkpoint at `place` before this save: what its index names, what
/// it records as replaced ([`REPLACES_KEY`]: the save that wrote it may have died before
/// removing them), and the usual names of shards it names by a save's name (which a save
/// that died in step 3 may have linked).
fn previous_files(place: &Place) -> Vec<String> {
    let Ok(index) = read_index(&place.index()) else {
        return Vec::new();
    };
    let mut files: Vec<String> = index.files().map(str::to_string).collect();
    // What the save that wrote it replaced and may have died before removing.
    files.extend(index.replaces.iter().cloned());
    let usual: Vec<String> = files
        .iter()
        .filter_map(|f| place.usual_name_of_saved(f))
        .collect();
    files.extend(usual);
    files
}

/// Removes the `previous` files that the new checkpoint (`kept`) does not name; then, in
/// one pass over the folder, files of the save-id form for this stem that it does not
/// name (saves that died after their shards took those names) and the temporary files
/// of dead processes ([`temp_files::Stale`], judged against `ours`, a file just
/// written). Call with the folder locked.
fn remove_unnamed(
    place: &Place,
    previous: Vec<String>,
    kept: &[String],
    ours: &Path,
    fsync: bool,
) -> Result<()> {
    let kept: std::collections::HashSet<&str> = kept.iter().map(String::as_str).collect();
    let single = place.single.file_name().and_then(|n| n.to_str());
    let remove = |name: &str| {
        if !kept.contains(name) && Some(name) != single && name.ends_with(".safetensors") {
            let _ = fs::remove_file(place.dir.join(name));
        }
    };
    for name in &previous {
        remove(name);
    }
    let stale = temp_files::Stale::like(ours);
    for entry in fs::read_dir(&place.dir).into_iter().flatten().flatten() {
        if stale.as_ref().is_some_and(|s| s.remove(&entry)) {
            continue;
        }
        if let Some(name) = entry.file_name().to_str() {
            if place.usual_name_of_saved(name).is_some() {
                remove(name);
            }
        }
    }
    if fsync {
        sync_folder(&place.dir)?;
    }
    Ok(())
}

/// A fresh id for one save: sixteen hex digits from the clock, the process and a counter.
/// A sharded save records it in the index and in every shard ([`SAVE_ID_KEY`]), so that a
/// load finds a shard of another save (read while a save replaced it, or left by hand).
pub(crate) fn save_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_names_parse_back_to_their_usual_names_and_nothing_else_does() {
        let place = Place {
            dir: PathBuf::from("."),
            stem: "model".into(),
            single: PathBuf::from("model.safetensors"),
        };
        let id = save_id();
        assert_eq!(id.len(), ID_LEN);
        let saved = saved_shard_name(&place.stem, 2, 13, &id);
        assert_eq!(
            place.usual_name_of_saved(&saved).as_deref(),
            Some("model-00002-of-00013.safetensors")
        );
        for other in [
            "model-00002-of-00013.safetensors",
            "model-00002-of-00013.safetensors.bak",
            "model-2-of-13.0123456789abcdef.safetensors",
            "other-00002-of-00013.0123456789abcdef.safetensors",
            "model-00002-of-00013.0123456789abcdeg.safetensors",
            "model-00002-of-00013.0123.safetensors",
        ] {
            assert_eq!(place.usual_name_of_saved(other), None, "{other}");
        }
    }

    #[test]
    fn a_save_removes_what_a_dead_process_left_in_the_folder() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = dir.path().join(temp_files::temp_name(dead, 7));
        fs::write(&stale, b"half a file").unwrap();
        let live = dir
            .path()
            .join(temp_files::temp_name(std::process::id(), u64::MAX));
        fs::write(&live, b"being written").unwrap();
        let path = dir.path().join("x.safetensors");
        let place = Place::of(&path).unwrap();
        let staged = crate::io::fs::replace::stage(&path, false, |w| {
            std::io::Write::write_all(w, b"a checkpoint").map_err(|e| Error::io("write", &path, e))
        })
        .unwrap();
        commit_single(&place, staged, false).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"a checkpoint");
        assert!(live.exists(), "a live process's temporary file stays");
        if cfg!(target_os = "linux") {
            assert!(
                !stale.exists(),
                "a dead process's temporary file is removed"
            );
        }
    }
}
