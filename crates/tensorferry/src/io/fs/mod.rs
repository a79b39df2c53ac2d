//! The filesystem under the files: only regular files read or replaced ([`file_kind`]),
//! atomic replacement that keeps permissions and symlinks ([`replace`]) through temporary
//! files that are cleaned up ([`temp_files`]), reads past the page cache ([`direct`],
//! [`direct_runs`], with the filesystem named by [`fs_name`]) and gathered writes
//! ([`gather_write`]).

pub(crate) mod direct;
pub(crate) mod direct_runs;
pub(crate) mod file_kind;
pub(crate) mod fs_name;
pub(crate) mod gather_write;
pub(crate) mod replace;
pub(crate) mod temp_files;

/// Files the tests of this folder read.
#[cfg(test)]
pub(crate) mod test_files {
    use std::io::Write;

    /// A temporary file holding `bytes`.
    pub(crate) fn file_of(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f.flush().unwrap();
        f
    }

    /// `len` bytes that differ from byte to byte and from block to block.
    pub(crate) fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
    }
}
