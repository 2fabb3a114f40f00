//! What a device holds, before a tool formats a pool over it. Formatting destroys what is
//! there, so `tutti pool format` and `tuttid --format` both refuse an `emu:` device holding
//! something other than a tutti pool unless told to overwrite it: a block device whose first
//! bytes are not a tutti superblock (a blank start proves nothing: data may lie further on), or
//! a non-empty regular file whose first MiB is neither a tutti superblock nor all zeroes (a file
//! made by `truncate` holds nothing). The refusal names what was found. A tutti pool is
//! reformatted without being told, and so is a device a format was interrupted on (its
//! superblock zeroed, slot headers behind it: `objstore::format::looks_like_unfinished_format`),
//! since formatting again is how such a device is recovered.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::claim::BlockDeviceClaims;
use crate::size::format_size;
use crate::spec::DeviceSpec;
use crate::DeviceError;

/// Bytes read from the start of a device to tell what it holds: file systems keep their
/// signatures within it (ext4 at 1 KiB, swap at 4 KiB, btrfs at 64 KiB, GPT at LBA 1).
const PROBE_BYTES: usize = 1 << 20;

/// Signatures at fixed offsets, named for the refusal; the first that matches is given (GPT
/// before the MBR, since a GPT disk carries a protective MBR).
const SIGNATURES: [(usize, &[u8], &str); 10] = [
    (512, b"EFI PART", "a GPT partition table"),
    (4096, b"EFI PART", "a GPT partition table"),
    (0, b"XFSB", "an XFS file system"),
    (0, b"LUKS\xba\xbe", "a LUKS encrypted volume"),
    (512, b"LABELONE", "an LVM physical volume"),
    (1080, &[0x53, 0xef], "an ext2/3/4 file system"),
    (4086, b"SWAPSPACE2", "a swap area"),
    (65536 + 64, b"_BHRfS_M", "a btrfs file system"),
    (3, b"NTFS    ", "an NTFS file system"),
    (510, &[0x55, 0xaa], "a DOS partition table or boot sector"),
];

/// What the first bytes of a device hold: `None` when it may be formatted without being told
/// to overwrite (a tutti pool, an interrupted format of one, or blank where blank is enough),
/// a description otherwise.
pub fn foreign_contents(head: &[u8], blank_is_enough: bool) -> Option<String> {
    if head.starts_with(&objstore::format::MAGIC) || objstore::format::looks_like_unfinished_format(head) {
        return None;
    }
    for (offset, signature, name) in SIGNATURES {
        if head.get(offset..offset + signature.len()) == Some(signature) {
            return Some(name.to_string());
        }
    }
    match head.iter().position(|&byte| byte != 0) {
        Some(first) => Some(format!("non-zero bytes (the first at byte {first})")),
        None if blank_is_enough => None,
        None => Some(format!(
            "no tutti superblock (its first {} are zero, but a block device may hold data further on)",
            format_size(head.len() as u64)
        )),
    }
}

/// Reads up to [`PROBE_BYTES`] from the start of `file` (less if it is shorter).
fn read_head(file: &File) -> std::io::Result<Vec<u8>> {
    let mut head = vec![0u8; PROBE_BYTES];
    let mut filled = 0;
    // Bounded: every pass reads at least one byte or ends the loop.
    while filled < head.len() {
        match file.read_at(&mut head[filled..], filled as u64) {
            Ok(0) => break,
            Ok(read) => filled += read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    head.truncate(filled);
    Ok(head)
}

/// Refuses ([`DeviceError::ForeignContents`]) the first `emu:` spec among `specs` that holds
/// something other than a tutti pool: block devices are read through their claimed descriptor
/// in `claims` (claim them first); regular files that exist and are not empty are opened to be
/// read. Missing files are left to whoever creates or opens them; `vfio:` and memory devices
/// are not read here (only a controller could: `tutti pool format` reads a `vfio:` SSD's first
/// MiB through its controller and applies [`foreign_contents`] to it, a blank start not being
/// enough).
pub fn refuse_foreign_contents(specs: &[DeviceSpec], claims: &BlockDeviceClaims) -> Result<(), DeviceError> {
    for spec in specs {
        let DeviceSpec::EmuFile(path) = spec else { continue };
        let opened;
        let (file, blank_is_enough) = match claims.file(spec) {
            Some(file) => (file, false),
            None => {
                opened = match File::open(path) {
                    Ok(file) => file,
                    // Missing: format creates it (or reports it); unreadable: opening reports it.
                    Err(_) => continue,
                };
                (&opened, true)
            }
        };
        let head = read_head(file)
            .map_err(|source| DeviceError::Io { context: format!("{spec}: reading its first bytes to see what it holds"), source })?;
        if head.is_empty() {
            continue;
        }
        if let Some(found) = foreign_contents(&head, blank_is_enough) {
            return Err(DeviceError::ForeignContents { spec: spec.to_string(), found });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_device_holds_is_named() {
        // Goal: the refusal says what is there; a tutti pool, and a blank file, are not foreign.
        let mut head = vec![0u8; 8192];
        assert_eq!(foreign_contents(&head, true), None);
        assert!(foreign_contents(&head, false).unwrap().contains("no tutti superblock"));
        head[1080..1082].copy_from_slice(&[0x53, 0xef]);
        assert_eq!(foreign_contents(&head, true).as_deref(), Some("an ext2/3/4 file system"));
        head[510..512].copy_from_slice(&[0x55, 0xaa]);
        head[512..520].copy_from_slice(b"EFI PART");
        assert_eq!(foreign_contents(&head, true).as_deref(), Some("a GPT partition table"));
        head[..8].copy_from_slice(&objstore::format::MAGIC);
        assert_eq!(foreign_contents(&head, false), None);
        // An interrupted format: the superblock region zeroed, slot 0's Empty entry behind it.
        let mut interrupted = vec![0u8; 1 << 20];
        objstore::format::encode_empty_entry(&mut interrupted[4096..4096 + 64], 0, 0x1234, 0);
        assert_eq!(foreign_contents(&interrupted, false), None);
        assert_eq!(foreign_contents(&[0, 0, 7], true).as_deref(), Some("non-zero bytes (the first at byte 2)"));
    }

    #[test]
    fn files_are_read_and_missing_or_empty_ones_left_alone() {
        // Goal: a regular file with foreign bytes is refused by name; a blank, empty or missing
        // file, a tutti pool and a memory device are not.
        let directory = tempfile::tempdir().unwrap();
        let file = |name: &str, bytes: &[u8]| {
            let path = directory.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            DeviceSpec::EmuFile(path)
        };
        let mut pool = vec![0u8; 4096];
        pool[..8].copy_from_slice(&objstore::format::MAGIC);
        let fine = [
            file("blank", &[0u8; 8192]),
            file("empty", &[]),
            file("pool", &pool),
            DeviceSpec::EmuFile(directory.path().join("missing")),
            DeviceSpec::EmuMemory(1 << 20),
        ];
        let claims = BlockDeviceClaims::default();
        refuse_foreign_contents(&fine, &claims).expect("nothing foreign");
        let foreign = file("notes", b"hello");
        let error = refuse_foreign_contents(&[fine[0].clone(), foreign.clone()], &claims).unwrap_err();
        assert!(matches!(&error, DeviceError::ForeignContents { spec, .. } if *spec == foreign.to_string()), "{error}");
        assert!(error.to_string().contains("non-zero bytes (the first at byte 0)"), "{error}");
        assert!(error.to_string().contains("--overwrite"), "{error}");
    }
}
