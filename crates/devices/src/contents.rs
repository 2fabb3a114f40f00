//! What a device holds, before a tool formats a pool over it. Formatting destroys what is
//! there, so `tutti pool format` and `tuttid --format` both refuse an `emu:` device holding
//! something other than a tutti pool unless told to overwrite it: a block device whose first
//! bytes are not a tutti superblock (a blank start proves nothing: data may lie further on), or
//! a non-empty regular file whose first MiB is neither a tutti superblock nor all zeroes (a file
//! made by `truncate` holds nothing). The refusal names what was found. A tutti pool is
//! reformatted without being told, and so is a device a format was interrupted on (its
//! superblock zeroed, slot headers behind it: `objstore::format::looks_like_unfinished_format`),
//! since formatting again is how such a device is recovered.
//!
//! A `vfio:` SSD can only be read through its controller: [`refuse_foreign_namespaces`] reads
//! each namespace's first MiB once the controllers are up, before anything is written, and
//! applies the same rule as for a block device (a blank start proves nothing). `tutti pool
//! format`, `tuttid --format` (and `Store.open(format=True)`, which opens the pool the same way)
//! and tutti-bench's kv workload all call it.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use nvme_driver::{DataSegment, Lba, NvmeError};
use objstore::PoolTarget;

use crate::claim::BlockDeviceClaims;
use crate::lock::{open_without_waiting, refuse_special_file};
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

/// Whether `file` is a character device (false if it cannot be examined).
fn is_char_device(file: &File) -> bool {
    use std::os::unix::fs::FileTypeExt;
    file.metadata().map(|metadata| metadata.file_type().is_char_device()).unwrap_or(false)
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
/// read (without waiting: a FIFO, a socket or a directory is refused,
/// [`DeviceError::NotAFileOrDevice`]). Missing files are left to
/// whoever creates or opens them; `vfio:` and memory devices are not read here (only a
/// controller can: [`refuse_foreign_namespaces`]).
pub fn refuse_foreign_contents(specs: &[DeviceSpec], claims: &BlockDeviceClaims) -> Result<(), DeviceError> {
    for spec in specs {
        let DeviceSpec::EmuFile(path) = spec else { continue };
        let opened;
        let (file, blank_is_enough) = match claims.file(spec) {
            Some(file) => (file, false),
            None => {
                opened = match open_without_waiting(path, OpenOptions::new().read(true)) {
                    Ok(file) => file,
                    // Missing: format creates it (or reports it); unreadable: opening reports it.
                    Err(_) => continue,
                };
                refuse_special_file(spec, path, &opened)?;
                (&opened, true)
            }
        };
        let head = match read_head(file) {
            Ok(head) => head,
            // A character device that cannot be read at an offset (an NVMe controller's
            // /dev/nvme0: EINVAL; a tty: ESPIPE, EAGAIN) holds no pool and takes none: its open
            // for I/O says so (unusable input), with or without overwrite, rather than this
            // look (whose read errors are device failures) deciding otherwise.
            Err(_) if claims.file(spec).is_none() && is_char_device(file) => continue,
            Err(source) => {
                return Err(DeviceError::Io { context: format!("{spec}: reading its first bytes to see what it holds"), source })
            }
        };
        if head.is_empty() {
            continue;
        }
        if let Some(found) = foreign_contents(&head, blank_is_enough) {
            return Err(DeviceError::ForeignContents { spec: spec.to_string(), found });
        }
    }
    Ok(())
}

/// Longest the read of a namespace's head may take: a controller that does not answer is a
/// device failure, not a wait without end.
const HEAD_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Refuses ([`DeviceError::ForeignContents`]) the first of `targets` whose namespace holds
/// something other than a tutti pool, reading its first bytes through its controller
/// ([`read_namespace_head`]). For `vfio:` SSDs, which only a controller can read: an SSD is a
/// whole disk, so, as for an `emu:` block device, a blank start proves nothing. The caller skips
/// the call when told to overwrite. A read that fails is [`DeviceError::NamespaceHead`].
pub fn refuse_foreign_namespaces<'a>(targets: impl IntoIterator<Item = (&'a DeviceSpec, &'a PoolTarget)>) -> Result<(), DeviceError> {
    for (spec, target) in targets {
        let head = read_namespace_head(spec, target)?;
        if let Some(found) = foreign_contents(&head, false) {
            return Err(DeviceError::ForeignContents { spec: spec.to_string(), found });
        }
    }
    Ok(())
}

/// The first min(`PROBE_BYTES`, namespace size) bytes of `target`'s namespace (`spec` names
/// it in errors), read through its controller on a queue pair of its own (deleted afterwards),
/// in commands of at most MDTS, each waited on for at most `HEAD_READ_TIMEOUT`.
pub fn read_namespace_head(spec: &DeviceSpec, target: &PoolTarget) -> Result<Vec<u8>, DeviceError> {
    let failed = |context: &str| {
        let context = context.to_string();
        move |source: NvmeError| DeviceError::NamespaceHead { spec: spec.to_string(), context, source }
    };
    let reading = "reading its first bytes to see what it holds";
    let namespace = target.controller.namespace(target.namespace).map_err(failed(reading))?;
    let lba_bytes = u64::from(namespace.block_size_bytes);
    // Whole LBAs: a namespace smaller than PROBE_BYTES is read to its end.
    let bytes = (PROBE_BYTES as u64).min(namespace.size_blocks.saturating_mul(lba_bytes)) / lba_bytes.max(1) * lba_bytes;
    if bytes == 0 {
        return Ok(Vec::new());
    }
    let region = target.controller.dma().allocate(bytes as usize).map_err(|error| failed(reading)(error.into()))?;
    let mut queue = target.controller.create_io_queue_pair(2.min(target.controller.max_queue_depth())).map_err(failed(reading))?;
    let piece_max = (queue.max_transfer_bytes().min(bytes) / lba_bytes).max(1) * lba_bytes;
    let mut read = Ok(());
    let mut done = 0u64;
    // Bounded: every pass reads at least one LBA, and each waits at most HEAD_READ_TIMEOUT.
    while done < bytes && read.is_ok() {
        let piece = (bytes - done).min(piece_max);
        read = region.subregion(done as usize, piece as usize).map_err(NvmeError::from).and_then(|window| {
            let segment = [DataSegment::new(window.iova(), piece as u32)];
            queue.read(target.namespace, Lba(done / lba_bytes), &segment, HEAD_READ_TIMEOUT)
        });
        done += piece;
    }
    let in_flight = queue.in_flight();
    if let Err(undeleted) = queue.delete() {
        if in_flight > 0 {
            // A command the controller may still complete could write into the buffer: it is
            // kept for good rather than handed back to the allocator.
            region.leak();
            return Err(failed("deleting the queue pair of a timed-out read of its first bytes")(undeleted.source));
        }
        // Nothing in flight: no command can reach the buffer; dropping the pair tries the
        // deletion once more (else it leaks only its own rings), and the data read stands.
    }
    read.map_err(failed(reading))?;
    let mut head = vec![0u8; bytes as usize];
    region.read(0, &mut head).map_err(|error| failed(reading)(error.into()))?;
    Ok(head)
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
    fn a_namespace_holding_a_file_system_is_refused_through_its_controller() {
        // Goal: what a vfio: SSD holds is read through its controller before a format (an
        // emu:-file-backed controller stands in for it here): an ext4 signature at byte 1080 is
        // refused, naming the device and what it holds, and reading writes nothing; a namespace
        // that starts with a tutti superblock is not refused.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("ssd.img");
        let mut bytes = vec![0u8; 8 << 20];
        bytes[1080..1082].copy_from_slice(&[0x53, 0xef]);
        std::fs::write(&path, &bytes).unwrap();
        let spec = DeviceSpec::EmuFile(path.clone());
        let targets = |spec: &DeviceSpec| -> Vec<PoolTarget> {
            crate::open_pool_devices(std::slice::from_ref(spec), 4096, None)
                .unwrap()
                .into_iter()
                .map(|device| PoolTarget { controller: device.controller, namespace: nvme_driver::NamespaceId(1) })
                .collect()
        };
        let opened = targets(&spec);
        let error = refuse_foreign_namespaces(std::iter::once(&spec).zip(&opened)).unwrap_err();
        assert!(matches!(&error, DeviceError::ForeignContents { spec: named, .. } if *named == spec.to_string()), "{error}");
        assert!(error.to_string().contains("an ext2/3/4 file system") && error.to_string().contains("--overwrite"), "{error}");
        assert_eq!(read_namespace_head(&spec, &opened[0]).unwrap().len(), PROBE_BYTES, "the first MiB is read");
        drop(opened);
        assert!(std::fs::read(&path).unwrap() == bytes, "reading what a device holds wrote to it");
        bytes[..8].copy_from_slice(&objstore::format::MAGIC);
        std::fs::write(&path, &bytes).unwrap();
        refuse_foreign_namespaces(std::iter::once(&spec).zip(&targets(&spec))).expect("a tutti pool is not foreign");
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
