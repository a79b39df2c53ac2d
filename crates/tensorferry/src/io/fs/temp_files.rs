//! Temporary files of atomic saves: short names that say which process made them, and
//! the removal of those a killed process left behind.
//!
//! A name is `.tf-<pid>-<n>-<tag>.tmp`, at most 60 bytes whatever the target is called,
//! so any legal file name (up to 255 bytes) can be saved to. `<tag>` identifies the boot
//! of the machine and the PID namespace of the process (a hash of
//! `/proc/sys/kernel/random/boot_id` and `/proc/self/ns/pid`), so that a process id is
//! only ever judged where it means something: a folder shared by containers or machines
//! holds names whose tags differ, and those are never touched.
//!
//! A save removes, in the folder it writes to, the temporary files of its own tag whose
//! process no longer exists (`/proc/<pid>` absent), that are regular files of the same
//! owner. Nothing else is touched: not a live process's file, not another user's, not a
//! name of another form. Where `/proc` is not available, nothing is removed.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// The temporary name for process `pid`'s `n`-th save.
pub(crate) fn temp_name(pid: u32, n: u64) -> String {
    match session_tag() {
        Some(tag) => format!(".tf-{pid}-{n}-{tag:016x}.tmp"),
        None => format!(".tf-{pid}-{n}-unknown.tmp"),
    }
}

/// The process id and tag a temporary name was made with, for names of exactly the form
/// [`temp_name`] writes (digits without leading zeros, sixteen hex digits).
fn parse_temp_name(name: &str) -> Option<(u32, u64)> {
    let middle = name.strip_prefix(".tf-")?.strip_suffix(".tmp")?;
    let mut parts = middle.split('-');
    let (pid, n, tag) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || tag.len() != 16 {
        return None;
    }
    let parsed = (
        pid.parse::<u32>().ok()?,
        n.parse::<u64>().ok()?,
        u64::from_str_radix(tag, 16).ok()?,
    );
    // Only the canonical spelling: "+5", "05" or upper-case hex are someone else's names.
    let canonical = format!(".tf-{}-{}-{:016x}.tmp", parsed.0, parsed.1, parsed.2);
    (canonical == name).then_some((parsed.0, parsed.2))
}

/// Creates a new temporary file in `folder`, with the permissions `open` gives a new file
/// (0o666 less the umask), and returns its path.
pub(crate) fn create_in(folder: &Path) -> io::Result<(PathBuf, File)> {
    let pid = std::process::id();
    let mut last = None;
    // A name can be taken by a file an earlier process with the same id left behind.
    for _ in 0..64 {
        let path = folder.join(temp_name(pid, COUNTER.fetch_add(1, Ordering::Relaxed)));
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists)))
}

/// Makes a new hard link to `file` under a temporary name in `folder`, and returns its
/// path.
pub(crate) fn link_in(folder: &Path, file: &Path) -> io::Result<PathBuf> {
    let pid = std::process::id();
    let mut last = None;
    for _ in 0..64 {
        let path = folder.join(temp_name(pid, COUNTER.fetch_add(1, Ordering::Relaxed)));
        match fs::hard_link(file, &path) {
            Ok(()) => return Ok(path),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists)))
}

/// Tells the temporary files of dead processes (see the module's doc) in a folder's
/// listing, so that a save sweeps its folder once for everything it removes.
pub(crate) struct Stale {
    tag: u64,
    me: fs::Metadata,
}

impl Stale {
    /// The judge for files of the owner of `ours` (a file just written); `None` where
    /// `/proc` cannot tell which processes are alive.
    pub(crate) fn like(ours: &Path) -> Option<Stale> {
        Some(Stale {
            tag: session_tag()?,
            me: fs::symlink_metadata(ours).ok()?,
        })
    }

    /// Removes `entry` if it is a temporary file of a dead process; whether it was one.
    pub(crate) fn remove(&self, entry: &fs::DirEntry) -> bool {
        let name = entry.file_name();
        let Some((pid, their_tag)) = name.to_str().and_then(parse_temp_name) else {
            return false;
        };
        if their_tag != self.tag || pid == std::process::id() || process_may_exist(pid) {
            return false;
        }
        // `DirEntry::metadata` does not follow a link: only a regular file qualifies.
        let Ok(meta) = entry.metadata() else {
            return false;
        };
        meta.file_type().is_file()
            && same_owner(&meta, &self.me)
            && fs::remove_file(entry.path()).is_ok()
    }
}

#[cfg(unix)]
fn same_owner(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.uid() == b.uid()
}

#[cfg(not(unix))]
fn same_owner(_: &fs::Metadata, _: &fs::Metadata) -> bool {
    false
}

/// False only when the process is known not to exist: `/proc/<pid>` is absent. Any
/// other answer (the entry is there, or cannot be looked at) counts as alive.
fn process_may_exist(pid: u32) -> bool {
    match fs::symlink_metadata(format!("/proc/{pid}")) {
        Err(e) => e.kind() != io::ErrorKind::NotFound,
        Ok(_) => true,
    }
}

/// The boot-and-PID-namespace tag of this process, where `/proc` tells them.
fn session_tag() -> Option<u64> {
    static TAG: OnceLock<Option<u64>> = OnceLock::new();
    *TAG.get_or_init(|| {
        let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let namespace = fs::read_link("/proc/self/ns/pid").ok()?;
        // `/proc/<pid>` must be this namespace's view for the liveness check to hold.
        fs::symlink_metadata(format!("/proc/{}", std::process::id())).ok()?;
        let mut hash = Fnv1a::default();
        hash.write(boot.trim().as_bytes());
        hash.write(namespace.as_os_str().as_encoded_bytes());
        Some(hash.0)
    })
}

/// FNV-1a, 64 bits: a stable hash (the same in every process, unlike std's).
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Removes from `folder` the temporary files left by processes that no longer exist
    /// (see the module's doc for which); `ours`, just created, tells the owner to match.
    /// Best effort: any failure leaves the file where it is.
    fn remove_stale(folder: &Path, ours: &Path) {
        let Some(stale) = Stale::like(ours) else {
            return;
        };
        for entry in fs::read_dir(folder).into_iter().flatten().flatten() {
            stale.remove(&entry);
        }
    }

    /// The id of a process that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    fn touch(folder: &Path, name: &str) -> PathBuf {
        let p = folder.join(name);
        fs::write(&p, b"partial").unwrap();
        p
    }

    #[test]
    fn names_are_short_and_parse_back() {
        let name = temp_name(4_194_304, u64::MAX);
        assert!(name.len() <= 60, "{name}");
        if let Some(tag) = session_tag() {
            assert_eq!(parse_temp_name(&name), Some((4_194_304, tag)));
        }
        for other in [
            ".tf-1-2.tmp",
            ".tf-01-2-0123456789abcdef.tmp",
            ".tf-+1-2-0123456789abcdef.tmp",
            ".tf-1-2-0123456789ABCDEF.tmp",
            ".tf-1-2-0123456789abcdef-x.tmp",
            "tf-1-2-0123456789abcdef.tmp",
            ".tf-1-2-0123456789abcdef.tmp.bak",
        ] {
            assert_eq!(parse_temp_name(other), None, "{other}");
        }
    }

    #[test]
    fn files_of_dead_processes_are_removed_and_nothing_else() {
        if session_tag().is_none() {
            return; // No /proc: nothing is ever removed (checked below on Linux).
        }
        let dir = tempfile::tempdir().unwrap();
        let (ours, _file) = create_in(dir.path()).unwrap();
        let dead = touch(dir.path(), &temp_name(dead_pid(), 0));
        let live_self = touch(dir.path(), &temp_name(std::process::id(), 999_999));
        let mut sleeper = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let live_other = touch(dir.path(), &temp_name(sleeper.id(), 0));
        let other_tag = touch(
            dir.path(),
            &format!(
                ".tf-{}-0-{:016x}.tmp",
                dead_pid(),
                session_tag().unwrap() ^ 1
            ),
        );
        let unrelated = touch(dir.path(), "model.safetensors.tmp");
        let link_name = temp_name(dead_pid(), 1);
        #[cfg(unix)]
        std::os::unix::fs::symlink(&unrelated, dir.path().join(&link_name)).unwrap();
        let folder_name = dir.path().join(temp_name(dead_pid(), 2));
        fs::create_dir(&folder_name).unwrap();

        remove_stale(dir.path(), &ours);
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();

        assert!(!dead.exists(), "a dead process's file is removed");
        for kept in [
            &ours,
            &live_self,
            &live_other,
            &other_tag,
            &unrelated,
            &folder_name,
        ] {
            assert!(kept.exists(), "{} was removed", kept.display());
        }
        #[cfg(unix)]
        assert!(fs::symlink_metadata(dir.path().join(&link_name)).is_ok());
    }

    #[test]
    fn creation_skips_names_already_taken() {
        let dir = tempfile::tempdir().unwrap();
        let next = COUNTER.load(Ordering::Relaxed);
        for n in next..next + 8 {
            touch(dir.path(), &temp_name(std::process::id(), n));
        }
        let (path, _file) = create_in(dir.path()).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"");
    }
}
