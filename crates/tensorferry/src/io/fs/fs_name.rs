//! The name of the filesystem a file lives on, for messages that explain what it refused
//! ("tmpfs refused O_DIRECT"). Only the common kinds are named; others are told by their
//! magic number, and platforms without `fstatfs` by a plain "the filesystem".

use std::fs::File;

/// The filesystem holding `file`, in words: "tmpfs", "ext4", "filesystem 0x1234abcd".
#[cfg(target_os = "linux")]
pub(crate) fn filesystem_name(file: &File) -> String {
    use std::os::fd::AsRawFd;
    // SAFETY: `statfs` is plain old data, so all-zero is a valid value to be overwritten.
    let mut info: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is open for the life of `file`; the out pointer is live.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut info) } != 0 {
        return "the filesystem".into();
    }
    // The type is a signed or unsigned word by architecture; the magic fits 32 bits.
    let magic = info.f_type as u32;
    match name_of_magic(magic) {
        Some(name) => name.into(),
        None => format!("filesystem {magic:#x}"),
    }
}

/// The filesystem holding `file`: unknown here.
#[cfg(not(target_os = "linux"))]
pub(crate) fn filesystem_name(_file: &File) -> String {
    "the filesystem".into()
}

/// Linux's magic number of a filesystem kind (`statfs.f_type`), named.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn name_of_magic(magic: u32) -> Option<&'static str> {
    Some(match magic {
        0x0102_1994 => "tmpfs",
        0x8584_58f6 => "ramfs",
        0xef53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683e => "btrfs",
        0x2fc1_2fc1 => "zfs",
        0x794c_7630 => "overlayfs",
        0x6573_5546 => "a FUSE filesystem",
        0x6969 => "nfs",
        0xff53_4d42 | 0xfe53_4d42 => "cifs",
        0x0102_1997 => "9p",
        0x0bd0_0bd0 => "lustre",
        0x4750_4653 => "gpfs",
        0x00c3_6400 => "cephfs",
        0x1983_0326 => "beegfs",
        0xf2f5_2010 => "f2fs",
        0x0000_4d44 => "vfat",
        0x5346_544e => "ntfs",
        0x2011_bab0 => "exfat",
        0x7371_7368 => "squashfs",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_filesystems_are_named_and_others_are_not_guessed() {
        assert_eq!(name_of_magic(0x0102_1994), Some("tmpfs"));
        assert_eq!(name_of_magic(0xef53), Some("ext4"));
        assert_eq!(name_of_magic(0x1234_5678), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn an_open_file_names_its_filesystem() {
        let file = File::open("/proc/self/status").unwrap();
        assert_eq!(filesystem_name(&file), "filesystem 0x9fa0"); // procfs: not in the table
    }
}
