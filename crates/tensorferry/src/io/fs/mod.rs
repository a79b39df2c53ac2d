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
