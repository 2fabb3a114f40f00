//! The segment manifest: which segments this node holds, kept in a file across restarts.
//!
//! The pool's headers record block keys, not prompts: after a restart the index knows which
//! blocks survived but not which runs of them form a segment (the chain runs forward over the
//! tokens, which no header keeps). So the daemon journals each segment it starts to hold (its
//! model space, position and block keys) and each it stops holding, and at start replays the
//! journal, keeps the segments whose blocks are all still in the recovered index, registers
//! them again, and rewrites the file with those, and a dropped record for each of the others
//! (those it lists but the pool lost, and those journalled as dropped: their registrations are
//! still to delete, below); the registrar's first join, those deletes made, rewrites it with
//! the held segments and, as dropped records, the deletes not yet made (segments found broken
//! after the first read of the queue that counted the stale ones, or during the join).
//!
//! Untrusted input (a file anyone could have changed, or a crash could have cut). What is not a
//! manifest at all is refused, and left as it is: a path that is not a regular file (a FIFO would
//! hang the start, a block device be read whole), a file that does not begin with `TSMF` (a slip
//! such as `--cluster-state` naming the pool's own image: the rewrite at start would replace it
//! with a 12-byte manifest), one over [`FILE_BYTES_MAX`], and a `PATH.new` that is not a manifest
//! a crash left (the rewrite would remove it). A `TSMF` header of another version or segment size
//! discards the file (this daemon's own, from another build or `--cluster-segment-blocks`);
//! records are read up to the first that is
//! truncated or fails its CRC (a torn tail after a crash: later records are not trusted either);
//! every segment is checked against the index before it is registered. Losing the tail loses
//! only registrations (a miss for other nodes), never serves a wrong byte. No fsync per record:
//! the journal is a hint the index confirms, so a lost write costs a registration, not data.
//!
//! The journal also records the etcd lease the node joined under (each join and rejoin): a
//! successor after a crash deletes the registrations of segments its pool lost, and of those
//! journalled as dropped since the file was written (a segment is journalled as dropped before
//! its unregister goes out, which a crash may have prevented: `Loaded::departed`), only while the
//! node id's member key is absent or still under that lease (`ClusterClient::forget`), never
//! those of a live process holding the id.
//!
//! Format (little-endian): header `TSMF`, version u16, segment blocks u16, CRC-32 of those 8
//! bytes; then records: tag u8 (1 held, 2 dropped, 3 lease), body length u16, body, CRC-32 of
//! tag, length and body. A held body: fingerprint[32], TP rank u32, TP world u32, segment index
//! u32, then the S block keys u64. A dropped body: fingerprint[32], rank u32, world u32, segment
//! key u64. A lease body: the etcd lease id i64 (the last one counts). Version 2 added the lease
//! record; a version 1 file (none) is read as before, and an older tuttid discards a version 2
//! file whole rather than stopping at a record it does not know.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};
use tutti_cluster::{ModelSpace, Segment, SegmentBlocks, SegmentKey, FINGERPRINT_BYTES};
use tutti_devices::lock::file_kind;

use super::held::HeldSegment;
use crate::DaemonError;

const MAGIC: &[u8; 4] = b"TSMF";
const VERSION: u16 = 2;
/// The version before the lease record, still read.
const VERSION_WITHOUT_LEASE: u16 = 1;
const HEADER_BYTES: usize = 12;
const TAG_HELD: u8 = 1;
const TAG_DROPPED: u8 = 2;
const TAG_LEASE: u8 = 3;
/// A manifest larger than this is refused, not read (a live one is ~8 bytes per pool block,
/// rewritten at every start and compacted when it doubles): a file that big was not written
/// by tuttid.
const FILE_BYTES_MAX: u64 = 8 << 30;
/// Bytes of a space in a record.
const SPACE_BYTES: usize = FINGERPRINT_BYTES + 8;

/// A segment as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestSegment {
    pub space: ModelSpace,
    pub index: u32,
    pub keys: Vec<u64>,
}

/// What reading the manifest found.
#[derive(Debug, Default)]
pub struct Loaded {
    /// The segments the journal says are held, in the order they were first recorded.
    pub segments: Vec<ManifestSegment>,
    /// The segments journalled as dropped (and not held again after), in the order dropped:
    /// since the file was written, or kept by its rewrite as still to delete
    /// ([`Manifest::rewrite_keeping`]). The previous process may have died before their
    /// unregister went out, so their registrations may live on under its lease, and the start
    /// deletes them with the stale ones. The index is the held record's (0 when the file holds
    /// none: a delete names the key alone).
    pub departed: Vec<(ModelSpace, Segment)>,
    /// Bytes after the last sound record (a torn tail, or damage), not trusted.
    pub dropped_bytes: u64,
    /// Why the whole file was discarded (a manifest of another version or segment size), if it was.
    pub discarded: Option<String>,
    /// The etcd lease the last lease record names (the previous process's, when it joined);
    /// 0 when none (etcd never grants lease 0).
    pub lease_id: i64,
    /// The file read, as [`load`] found it; `None` when the path was missing.
    /// [`still_as_loaded`] compares it before the start's rewrite.
    pub identity: Option<FileIdentity>,
}

/// Which file a path held and how far it had been written: device, inode, length and
/// modification time. Under the manifest's lock nothing of this daemon's writes the manifest
/// between [`load`] and the start's rewrite, so a change in between says the path is another
/// file's (the pool's own image, made or formatted there meanwhile): the rewrite would replace it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    device: u64,
    inode: u64,
    bytes: u64,
    modified: (i64, i64),
}

impl FileIdentity {
    fn of(metadata: &std::fs::Metadata) -> FileIdentity {
        FileIdentity {
            device: metadata.dev(),
            inode: metadata.ino(),
            bytes: metadata.len(),
            modified: (metadata.mtime(), metadata.mtime_nsec()),
        }
    }
}

/// Refuses ([`DaemonError::Config`], nothing changed) when the manifest's path no longer holds
/// what [`load`] read there: made since (missing then), another file, or written since. Called
/// just before the start's [`Manifest::rewrite_keeping`], which would otherwise rename a manifest over
/// whatever is there: a `--cluster-state` naming the pool's image, missing or empty at load,
/// then created or formatted by the pool's open, left the daemon on an unlinked inode.
pub fn still_as_loaded(path: &Path, loaded: &Loaded) -> Result<(), DaemonError> {
    let now = match std::fs::symlink_metadata(path) {
        Ok(metadata) => Some(FileIdentity::of(&metadata)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(DaemonError::Io { context: format!("looking at the segment manifest {} again", path.display()), source })
        }
    };
    if now == loaded.identity {
        return Ok(());
    }
    let was = if loaded.identity.is_some() { "replaced or written" } else { "created" };
    Err(DaemonError::Config(format!(
        "the segment manifest {} (--cluster-state) was {was} since this start read it, by something other than this daemon (the pool's \
         own image, created or formatted at that path?): left as it is; give the manifest a path of its own",
        path.display()
    )))
}

/// The open journal.
pub struct Manifest {
    path: PathBuf,
    segment_blocks: SegmentBlocks,
    file: BufWriter<File>,
    /// Records written since the file was last rewritten (compaction is due when they outgrow
    /// twice the held segments and the deletes still to make, plus 4,096).
    records: u64,
    /// Dropped records the file holds: those its last rewrite kept, and those appended since.
    dropped_records: u64,
    /// The lease last recorded (0: none), written again by every rewrite.
    lease_id: i64,
    /// Scratch for one record.
    record: Vec<u8>,
}

fn io_context(path: &Path, doing: &str) -> impl FnOnce(std::io::Error) -> std::io::Error {
    let text = format!("{doing} the segment manifest {}", path.display());
    move |error| std::io::Error::new(error.kind(), format!("{text}: {error}"))
}

fn header(version: u16, segment_blocks: SegmentBlocks) -> [u8; HEADER_BYTES] {
    let mut bytes = [0u8; HEADER_BYTES];
    bytes[..4].copy_from_slice(MAGIC);
    bytes[4..6].copy_from_slice(&version.to_le_bytes());
    bytes[6..8].copy_from_slice(&segment_blocks.get().to_le_bytes());
    let crc = crc32fast::hash(&bytes[..8]);
    bytes[8..].copy_from_slice(&crc.to_le_bytes());
    bytes
}

fn put_space(out: &mut Vec<u8>, space: &ModelSpace) {
    out.extend_from_slice(space.fingerprint());
    out.extend_from_slice(&space.tp_rank().to_le_bytes());
    out.extend_from_slice(&space.tp_world().to_le_bytes());
}

fn get_space(body: &[u8]) -> Option<ModelSpace> {
    let fingerprint: [u8; FINGERPRINT_BYTES] = body.get(..FINGERPRINT_BYTES)?.try_into().ok()?;
    let rank = u32::from_le_bytes(body.get(FINGERPRINT_BYTES..FINGERPRINT_BYTES + 4)?.try_into().ok()?);
    let world = u32::from_le_bytes(body.get(FINGERPRINT_BYTES + 4..SPACE_BYTES)?.try_into().ok()?);
    ModelSpace::new(fingerprint, rank, world).ok()
}

fn u64_at(body: &[u8], offset: usize) -> Option<u64> {
    Some(u64::from_le_bytes(body.get(offset..offset + 8)?.try_into().ok()?))
}

/// Frames one record: tag, length, body, CRC.
fn frame(out: &mut Vec<u8>, tag: u8, body: impl FnOnce(&mut Vec<u8>)) {
    out.clear();
    out.push(tag);
    out.extend_from_slice(&[0, 0]);
    body(out);
    let length = (out.len() - 3) as u16;
    out[1..3].copy_from_slice(&length.to_le_bytes());
    let crc = crc32fast::hash(out);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// One daemon per manifest: an exclusive `flock` on `<manifest>.lock`, held for the cluster
/// agent's life; the kernel drops it when the holder dies, even by SIGKILL. Two tuttids given
/// one `--cluster-state` (the same `--node-id "$(hostname -s)"` on one host) would otherwise
/// each read the other's segments as lost from its pool, and the second would delete the
/// first's registrations under the lease the first recorded (`ClusterClient::forget` allows
/// exactly that lease), then rename its own manifest over the first's. Not a lock on the
/// manifest itself: [`Manifest::rewrite_keeping`] renames a new file over it, and a lock belongs to
/// the file it was taken on, not to the path.
#[derive(Debug)]
pub struct ManifestLock {
    _lock: Flock<File>,
}

/// Takes the [`ManifestLock`] of the manifest at `path`, without waiting: held by another
/// process, refused as in use ([`DaemonError::DeviceInUse`], exit 2), naming the lock file and
/// its holder (pid and command line, as for a pool device).
///
/// The lock goes by the manifest's path, so a manifest another path reaches is refused as
/// [`DaemonError::Config`]: a symbolic link (a second daemon given the link would lock
/// `LINK.lock`, read the first's manifest through it and forget its registrations; its first
/// rewrite would also replace the link with a file) or a file with other hard links.
pub fn lock(path: &Path) -> Result<ManifestLock, DaemonError> {
    match std::fs::symlink_metadata(path) {
        Ok(metadata) if metadata.file_type().is_symlink() => {
            return Err(DaemonError::Config(format!(
                "the segment manifest {} (--cluster-state) is a symbolic link: give the manifest's own path (its lock goes by the path, so \
                 another daemon could reach one manifest under two names)",
                path.display()
            )))
        }
        Ok(metadata) if !metadata.file_type().is_file() => {
            return Err(not_a_manifest(path, &format!("is {}", file_kind(metadata.file_type()))))
        }
        Ok(metadata) if metadata.nlink() > 1 => {
            return Err(DaemonError::Config(format!(
                "the segment manifest {} (--cluster-state) has {} hard links: give a manifest of one name (its lock goes by the path, so \
                 another daemon could reach one manifest under two names)",
                path.display(),
                metadata.nlink()
            )))
        }
        // Missing: created by the first rewrite, under this lock. Unreadable: load says why.
        _ => {}
    }
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let file =
        OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&lock_path).map_err(|source| DaemonError::Io {
            context: format!("opening {} to lock the segment manifest", lock_path.display()),
            source,
        })?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(ManifestLock { _lock: lock }),
        Err((file, Errno::EWOULDBLOCK)) => Err(DaemonError::DeviceInUse {
            spec: format!("the segment manifest {} (--cluster-state)", path.display()),
            holder: tutti_devices::lock::holder_of(&file, Path::new("/proc")),
            lock: lock_path,
        }),
        Err((_, errno)) => Err(DaemonError::Io {
            context: format!("locking {}", lock_path.display()),
            source: std::io::Error::from_raw_os_error(errno as i32),
        }),
    }
}

/// The refusal of a `--cluster-state` path that holds something other than a manifest.
fn not_a_manifest(path: &Path, what: &str) -> DaemonError {
    DaemonError::Config(format!(
        "the segment manifest {} (--cluster-state) {what}: give the path of a segment manifest, or of a file not there yet (left as it is)",
        path.display()
    ))
}

/// Opens `path` to read without following a symbolic link, without waiting (a FIFO opens at
/// once) and without taking a terminal, and checks that what it opened is a regular file (the
/// path may have been swapped since it was looked at). `Ok(Err(kind))` names what it is instead.
fn open_regular(path: &Path) -> std::io::Result<Result<(File, std::fs::Metadata), &'static str>> {
    let flags = OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
    let file = OpenOptions::new().read(true).custom_flags(flags.bits()).open(path)?;
    let metadata = file.metadata()?;
    Ok(if metadata.file_type().is_file() { Ok((file, metadata)) } else { Err(file_kind(metadata.file_type())) })
}

/// `PATH.new`, where [`Manifest::rewrite_keeping`] writes the file it renames over `PATH`.
fn temporary_of(path: &Path) -> PathBuf {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".new");
    PathBuf::from(temporary)
}

/// Whether `temporary` is there to be removed before a rewrite: `Ok(false)` when missing,
/// `Ok(true)` when it is what a crash mid-rewrite leaves (a regular file, empty or beginning
/// with `TSMF`; no other process writes it while the manifest's lock is held), and an error
/// (kind `AlreadyExists`) for anything else, which is never removed: it is not ours.
fn stale_temporary(temporary: &Path) -> std::io::Result<bool> {
    let refuse = |what: &str| {
        std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{} {what}, not a segment manifest a crash left: remove it or give another --cluster-state", temporary.display()),
        )
    };
    match std::fs::symlink_metadata(temporary) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(error) => return Err(io_context(temporary, "looking at")(error)),
        Ok(metadata) if !metadata.file_type().is_file() => return Err(refuse(&format!("is {}", file_kind(metadata.file_type())))),
        Ok(_) => {}
    }
    let (file, metadata) = match open_regular(temporary).map_err(io_context(temporary, "opening"))? {
        Ok(opened) => opened,
        Err(kind) => return Err(refuse(&format!("is {kind}"))),
    };
    let mut head = Vec::with_capacity(MAGIC.len());
    file.take(MAGIC.len() as u64).read_to_end(&mut head).map_err(io_context(temporary, "reading"))?;
    if metadata.len() == 0 || head == MAGIC {
        Ok(true)
    } else {
        Err(refuse("holds something else"))
    }
}

/// Reads the journal at `path` (a missing file is an empty one). Refused as
/// [`DaemonError::Config`] (exit 2), everything left as it is: what is not a manifest (module
/// docs) — a path that is not a regular file, a file that does not begin with `TSMF`, one over
/// [`FILE_BYTES_MAX`] bytes, a `PATH.new` the rewrite could not remove. A manifest of another
/// version or segment size is read as empty, saying why (`Loaded::discarded`).
pub fn load(path: &Path, segment_blocks: SegmentBlocks) -> Result<Loaded, DaemonError> {
    let io = |doing: &str| {
        let context = format!("{doing} the segment manifest {}", path.display());
        move |source| DaemonError::Io { context, source }
    };
    // Checked here, before the pool is touched, though only the rewrite removes it.
    stale_temporary(&temporary_of(path)).map_err(|error| {
        if error.kind() == std::io::ErrorKind::AlreadyExists {
            DaemonError::Config(format!("the segment manifest's temporary file {error}"))
        } else {
            DaemonError::Io { context: "the segment manifest's temporary file".into(), source: error }
        }
    })?;
    // Looked at before it is opened: opening a device may do something (a tape rewinds).
    match std::fs::symlink_metadata(path) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Loaded::default()),
        Err(error) => return Err(io("looking at")(error)),
        Ok(metadata) if !metadata.file_type().is_file() => {
            return Err(not_a_manifest(path, &format!("is {}", file_kind(metadata.file_type()))))
        }
        Ok(_) => {}
    }
    let (file, metadata) = match open_regular(path) {
        Ok(Ok(opened)) => opened,
        Ok(Err(kind)) => return Err(not_a_manifest(path, &format!("is {kind}"))),
        // Gone since it was looked at: as missing.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Loaded::default()),
        Err(error) => return Err(io("opening")(error)),
    };
    let foreign = || not_a_manifest(path, "does not begin with a segment manifest's magic (TSMF)");
    let bytes = match read_bounded(file, metadata.len()).map_err(io("reading"))? {
        Ok(bytes) => bytes,
        Err(Refused::Foreign) => return Err(foreign()),
        Err(Refused::TooLarge(length)) => {
            return Err(not_a_manifest(path, &format!("is {length} bytes, over the {FILE_BYTES_MAX}-byte bound of a manifest")))
        }
    };
    let mut loaded = parse(&bytes, segment_blocks).map_err(|Foreign| foreign())?;
    loaded.identity = Some(FileIdentity::of(&metadata));
    Ok(loaded)
}

/// What [`read_bounded`] refused to read.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// Not empty and not beginning with `TSMF`.
    Foreign,
    /// Over [`FILE_BYTES_MAX`] bytes: the length it was found to have.
    TooLarge(u64),
}

/// The bytes of a journal whose metadata gave `length`, read from `reader`. The magic is read
/// and checked first: the slip the module docs name (the pool's image, GiBs) is refused after
/// 4 bytes, not read into memory whole first (under a memory limit that start was killed
/// rather than refused).
fn read_bounded(reader: impl Read, length: u64) -> std::io::Result<Result<Vec<u8>, Refused>> {
    if length > FILE_BYTES_MAX {
        return Ok(Err(Refused::TooLarge(length)));
    }
    // Bounded however long the file has grown since its length was read.
    let mut reader = reader.take(FILE_BYTES_MAX + 1);
    let mut bytes = Vec::with_capacity(MAGIC.len());
    (&mut reader).take(MAGIC.len() as u64).read_to_end(&mut bytes)?;
    // Fewer than 4 bytes is the end of the file: empty is an empty journal, anything else not one.
    if !bytes.is_empty() && bytes[..] != MAGIC[..] {
        return Ok(Err(Refused::Foreign));
    }
    bytes.reserve(length.saturating_sub(bytes.len() as u64) as usize);
    reader.read_to_end(&mut bytes)?;
    if bytes.len() as u64 > FILE_BYTES_MAX {
        return Ok(Err(Refused::TooLarge(bytes.len() as u64)));
    }
    Ok(Ok(bytes))
}

/// [`parse`]'s refusal: the bytes do not begin with the manifest's magic.
#[derive(Debug, PartialEq, Eq)]
struct Foreign;

/// The journal in `bytes`; [`Foreign`] when they are not empty and do not begin with `TSMF`.
fn parse(bytes: &[u8], segment_blocks: SegmentBlocks) -> Result<Loaded, Foreign> {
    let mut loaded = Loaded::default();
    if bytes.is_empty() {
        return Ok(loaded);
    }
    if !bytes.starts_with(MAGIC) {
        return Err(Foreign);
    }
    let known = |version: u16| bytes.len() >= HEADER_BYTES && bytes[..HEADER_BYTES] == header(version, segment_blocks);
    if !known(VERSION) && !known(VERSION_WITHOUT_LEASE) {
        let version = if bytes.len() >= 8 { u16::from_le_bytes([bytes[4], bytes[5]]) } else { 0 };
        loaded.discarded = Some(if version == VERSION || version == VERSION_WITHOUT_LEASE {
            format!("written for segments of {} blocks, not {}", u16::from_le_bytes([bytes[6], bytes[7]]), segment_blocks.get())
        } else {
            "not a segment manifest of this version".into()
        });
        return Ok(loaded);
    }
    let per_segment = usize::from(segment_blocks.get());
    let held_bytes = SPACE_BYTES + 4 + 8 * per_segment;
    // (space, segment key) -> position in `loaded.segments` (None once dropped).
    let mut positions: HashMap<(ModelSpace, SegmentKey), usize> = HashMap::new();
    let mut slots: Vec<Option<ManifestSegment>> = Vec::new();
    // The same for `loaded.departed` (None once held again).
    let mut departed_positions: HashMap<(ModelSpace, SegmentKey), usize> = HashMap::new();
    let mut departed: Vec<Option<(ModelSpace, Segment)>> = Vec::new();
    let mut at = HEADER_BYTES;
    while at < bytes.len() {
        let Some(record) = read_record(&bytes[at..]) else { break };
        let (tag, body, record_bytes) = record;
        if tag == TAG_LEASE {
            let Some(lease_id) = u64_at(body, 0).filter(|_| body.len() == 8) else { break };
            loaded.lease_id = lease_id as i64;
            at += record_bytes;
            continue;
        }
        let entry = match tag {
            TAG_HELD if body.len() == held_bytes => {
                let keys: Option<Vec<u64>> =
                    (0..per_segment).map(|i| u64_at(body, SPACE_BYTES + 4 + 8 * i).filter(|&key| key != 0)).collect();
                let index = u32::from_le_bytes([body[SPACE_BYTES], body[SPACE_BYTES + 1], body[SPACE_BYTES + 2], body[SPACE_BYTES + 3]]);
                match (get_space(body), keys) {
                    (Some(space), Some(keys)) => Some((true, space, index, keys)),
                    _ => None,
                }
            }
            TAG_DROPPED if body.len() == SPACE_BYTES + 8 => match (get_space(body), u64_at(body, SPACE_BYTES)) {
                (Some(space), Some(key)) if key != 0 => Some((false, space, 0, vec![key])),
                _ => None,
            },
            _ => None,
        };
        // A record that frames and checks but does not decode is damage too: stop here.
        let Some((held, space, index, keys)) = entry else { break };
        let Some(&last) = keys.last() else { break };
        let Ok(key) = SegmentKey::new(last) else { break };
        if held {
            if let Some(position) = departed_positions.remove(&(space, key)) {
                departed[position] = None;
            }
            if let std::collections::hash_map::Entry::Vacant(vacant) = positions.entry((space, key)) {
                vacant.insert(slots.len());
                slots.push(Some(ManifestSegment { space, index, keys }));
            }
        } else {
            let index = positions.remove(&(space, key)).and_then(|position| slots[position].take()).map_or(0, |segment| segment.index);
            if let std::collections::hash_map::Entry::Vacant(vacant) = departed_positions.entry((space, key)) {
                vacant.insert(departed.len());
                departed.push(Some((space, Segment { index, key })));
            }
        }
        at += record_bytes;
    }
    loaded.dropped_bytes = (bytes.len() - at) as u64;
    loaded.segments = slots.into_iter().flatten().collect();
    loaded.departed = departed.into_iter().flatten().collect();
    Ok(loaded)
}

/// One record at the start of `bytes`: (tag, body, bytes it takes), or None when truncated or
/// its CRC does not match.
fn read_record(bytes: &[u8]) -> Option<(u8, &[u8], usize)> {
    let length = usize::from(u16::from_le_bytes([*bytes.get(1)?, *bytes.get(2)?]));
    let end = 3 + length;
    let crc = u32::from_le_bytes(bytes.get(end..end + 4)?.try_into().ok()?);
    if crc32fast::hash(&bytes[..end]) != crc {
        return None;
    }
    Some((bytes[0], &bytes[3..end], end + 4))
}

impl Manifest {
    /// [`Manifest::rewrite_keeping`] with no deletes to keep (tests).
    #[cfg(test)]
    pub fn rewrite<'a>(
        path: &Path,
        segment_blocks: SegmentBlocks,
        lease_id: i64,
        segments: impl Iterator<Item = &'a HeldSegment>,
    ) -> std::io::Result<Manifest> {
        Manifest::rewrite_keeping(path, segment_blocks, lease_id, segments, std::iter::empty())
    }

    /// Rewrites the file with exactly `segments`, a dropped record for each of `departed`, and
    /// the lease `lease_id` (0: none; a start keeps the previous process's until this one
    /// joins) — a new file, then renamed over the old one, so a crash leaves one or the other
    /// whole — and opens it for appending. `departed`: segments not held whose registrations
    /// are still to delete (queued, or stale before the first join), which a successor after a
    /// crash must still find (`Loaded::departed`); none may be among `segments` (it would read
    /// as dropped).
    pub fn rewrite_keeping<'a, 'b>(
        path: &Path,
        segment_blocks: SegmentBlocks,
        lease_id: i64,
        segments: impl Iterator<Item = &'a HeldSegment>,
        departed: impl Iterator<Item = &'b (ModelSpace, Segment)>,
    ) -> std::io::Result<Manifest> {
        let temporary = temporary_of(path);
        let mut record = Vec::new();
        let mut records = 0;
        let mut dropped_records = 0;
        {
            // A crash mid-rewrite leaves it; anything else there is refused, never removed.
            if stale_temporary(&temporary)? {
                std::fs::remove_file(&temporary).map_err(io_context(&temporary, "removing the stale"))?;
            }
            // A new file: never one someone put there since (nor a link followed).
            let file = OpenOptions::new().write(true).create_new(true).open(&temporary).map_err(io_context(&temporary, "creating"))?;
            let mut writer = BufWriter::new(file);
            writer.write_all(&header(VERSION, segment_blocks)).map_err(io_context(&temporary, "writing"))?;
            if lease_id != 0 {
                lease_record(&mut record, lease_id);
                writer.write_all(&record).map_err(io_context(&temporary, "writing"))?;
                records += 1;
            }
            for held in segments {
                held_record(&mut record, &held.space, held.segment.index, &held.keys);
                writer.write_all(&record).map_err(io_context(&temporary, "writing"))?;
                records += 1;
            }
            for (space, segment) in departed {
                dropped_record(&mut record, space, segment.key);
                writer.write_all(&record).map_err(io_context(&temporary, "writing"))?;
                records += 1;
                dropped_records += 1;
            }
            let file = writer.into_inner().map_err(|error| io_context(&temporary, "writing")(error.into_error()))?;
            file.sync_all().map_err(io_context(&temporary, "syncing"))?;
        }
        std::fs::rename(&temporary, path).map_err(io_context(path, "replacing"))?;
        if let Some(directory) = path.parent().filter(|parent| !parent.as_os_str().is_empty()) {
            // The rename is durable once the directory is; a failure leaves the old file, whose
            // segments the index checks again at the next start.
            if let Err(error) = File::open(directory).and_then(|directory| directory.sync_all()) {
                tracing::warn!(%error, "syncing the segment manifest's directory");
            }
        }
        let file = OpenOptions::new().append(true).open(path).map_err(io_context(path, "opening"))?;
        Ok(Manifest { path: path.to_owned(), segment_blocks, file: BufWriter::new(file), records, dropped_records, lease_id, record })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn segment_blocks(&self) -> SegmentBlocks {
        self.segment_blocks
    }

    /// Records written since the last rewrite.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Dropped records the file holds (kept by its last rewrite, or appended since): with none,
    /// a rewrite would write what the file already says (its held segments and lease).
    pub fn dropped_records(&self) -> u64 {
        self.dropped_records
    }

    /// The lease last recorded (0: none).
    pub fn lease_id(&self) -> i64 {
        self.lease_id
    }

    /// Appends "this node joined under lease `lease_id`" and hands it to the kernel at once: a
    /// crash after the join must leave it for the successor (see the module docs).
    pub fn lease(&mut self, lease_id: i64) -> std::io::Result<()> {
        lease_record(&mut self.record, lease_id);
        self.records += 1;
        self.lease_id = lease_id;
        self.file.write_all(&self.record).map_err(io_context(&self.path, "appending to"))?;
        self.flush()
    }

    /// Appends "this node holds segment `index` of `space`, made of `keys`" (buffered until
    /// [`Manifest::flush`]).
    pub fn held(&mut self, space: &ModelSpace, index: u32, keys: &[u64]) -> std::io::Result<()> {
        held_record(&mut self.record, space, index, keys);
        self.records += 1;
        self.file.write_all(&self.record).map_err(io_context(&self.path, "appending to"))
    }

    /// Appends "this node no longer holds the segment `key` of `space`".
    pub fn dropped(&mut self, space: &ModelSpace, key: SegmentKey) -> std::io::Result<()> {
        dropped_record(&mut self.record, space, key);
        self.records += 1;
        self.dropped_records += 1;
        self.file.write_all(&self.record).map_err(io_context(&self.path, "appending to"))
    }

    /// Hands the buffered records to the kernel (no fsync: see the module docs).
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush().map_err(io_context(&self.path, "writing"))
    }
}

fn lease_record(out: &mut Vec<u8>, lease_id: i64) {
    frame(out, TAG_LEASE, |out| out.extend_from_slice(&lease_id.to_le_bytes()));
}

fn dropped_record(out: &mut Vec<u8>, space: &ModelSpace, key: SegmentKey) {
    frame(out, TAG_DROPPED, |out| {
        put_space(out, space);
        out.extend_from_slice(&key.get().to_le_bytes());
    });
}

fn held_record(out: &mut Vec<u8>, space: &ModelSpace, index: u32, keys: &[u64]) {
    frame(out, TAG_HELD, |out| {
        put_space(out, space);
        out.extend_from_slice(&index.to_le_bytes());
        for key in keys {
            out.extend_from_slice(&key.to_le_bytes());
        }
    });
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::super::held::HeldSegments;
    use super::*;

    fn space(byte: u8) -> ModelSpace {
        ModelSpace::new([byte; FINGERPRINT_BYTES], 1, 2).unwrap()
    }

    #[test]
    fn a_manifest_reached_under_another_name_is_refused_before_it_is_locked() {
        // Goal: the lock goes by the path, so a symbolic link to a live daemon's manifest, or a
        // hard link to it, would be locked as another file: both are refused as configuration
        // errors naming the manifest; the file's own path (or a missing one) is locked.
        let directory = tempfile::tempdir().unwrap();
        let manifest = directory.path().join("segments");
        std::fs::write(&manifest, b"").unwrap();
        let _held = lock(&manifest).expect("the manifest's own path is locked");
        let symlink = directory.path().join("other-name");
        std::os::unix::fs::symlink(&manifest, &symlink).unwrap();
        let error = lock(&symlink).unwrap_err();
        assert!(matches!(&error, DaemonError::Config(message) if message.contains("symbolic link")), "{error}");
        let hard_link = directory.path().join("third-name");
        std::fs::hard_link(&manifest, &hard_link).unwrap();
        let error = lock(&hard_link).unwrap_err();
        assert!(matches!(&error, DaemonError::Config(message) if message.contains("2 hard links")), "{error}");
        lock(&directory.path().join("missing")).expect("a manifest not written yet is locked");
    }

    fn keys(first: u64) -> Vec<u64> {
        (first..first + 16).collect()
    }

    fn blocks() -> SegmentBlocks {
        SegmentBlocks::new(16).unwrap()
    }

    #[test]
    fn the_journal_replays_held_and_dropped_segments_and_compacts() {
        // Goal: appended records replay to the segments still held, in order; a rewrite keeps
        // exactly those, and appending goes on after it.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("manifest");
        assert!(load(&path, blocks()).unwrap().segments.is_empty(), "a missing file is empty");
        let mut manifest = Manifest::rewrite(&path, blocks(), 0, std::iter::empty()).unwrap();
        manifest.held(&space(1), 0, &keys(1)).unwrap();
        manifest.held(&space(1), 1, &keys(17)).unwrap();
        manifest.held(&space(2), 0, &keys(1)).unwrap();
        manifest.dropped(&space(1), SegmentKey::new(16).unwrap()).unwrap();
        manifest.flush().unwrap();
        let loaded = load(&path, blocks()).unwrap();
        assert_eq!((loaded.dropped_bytes, loaded.discarded.as_deref()), (0, None));
        let expected = vec![
            ManifestSegment { space: space(1), index: 1, keys: keys(17) },
            ManifestSegment { space: space(2), index: 0, keys: keys(1) },
        ];
        assert_eq!(loaded.segments, expected);

        let mut held = HeldSegments::default();
        for segment in &loaded.segments {
            held.insert(segment.space, segment.index, &segment.keys);
        }
        let mut manifest = Manifest::rewrite(&path, blocks(), 0, held.iter()).unwrap();
        assert_eq!(manifest.records(), 2);
        manifest.held(&space(3), 2, &keys(40)).unwrap();
        manifest.flush().unwrap();
        let loaded = load(&path, blocks()).unwrap();
        assert_eq!(loaded.segments.len(), 3);
        assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, HEADER_BYTES + 3 * (3 + SPACE_BYTES + 4 + 128 + 4));
    }

    #[test]
    fn the_lease_last_joined_under_is_kept_across_rewrites() {
        // Goal: the lease a node joined under is read back (the last record counts), kept by a
        // rewrite (a start that rewrites before joining must leave the previous process's lease
        // for the next), and a version 1 file, which has none, is still read.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("manifest");
        let mut manifest = Manifest::rewrite(&path, blocks(), 0, std::iter::empty()).unwrap();
        assert_eq!(load(&path, blocks()).unwrap().lease_id, 0);
        manifest.lease(0x1111).unwrap();
        manifest.held(&space(1), 0, &keys(1)).unwrap();
        manifest.lease(0x2222).unwrap();
        manifest.flush().unwrap();
        let loaded = load(&path, blocks()).unwrap();
        assert_eq!((loaded.lease_id, loaded.segments.len(), loaded.dropped_bytes), (0x2222, 1, 0));
        let mut held = HeldSegments::default();
        held.insert(space(1), 0, &keys(1));
        let manifest = Manifest::rewrite(&path, blocks(), loaded.lease_id, held.iter()).unwrap();
        assert_eq!(manifest.lease_id(), 0x2222);
        drop(manifest);
        let loaded = load(&path, blocks()).unwrap();
        assert_eq!((loaded.lease_id, loaded.segments.len()), (0x2222, 1));

        let mut version_1 = header(VERSION_WITHOUT_LEASE, blocks()).to_vec();
        let mut record = Vec::new();
        held_record(&mut record, &space(1), 0, &keys(1));
        version_1.extend_from_slice(&record);
        let loaded = parse(&version_1, blocks()).unwrap();
        assert_eq!((loaded.lease_id, loaded.segments.len(), loaded.discarded), (0, 1, None));
    }

    #[test]
    fn a_torn_or_damaged_journal_is_trusted_only_up_to_its_last_sound_record() {
        // Goal: every truncation and every flipped byte of a two-record journal yields a prefix
        // of its records (never a record that was not written, never a panic); a header of
        // another segment size discards the file; bytes without the magic are refused.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("manifest");
        let mut manifest = Manifest::rewrite(&path, blocks(), 0, std::iter::empty()).unwrap();
        manifest.held(&space(1), 0, &keys(1)).unwrap();
        manifest.held(&space(1), 1, &keys(17)).unwrap();
        manifest.flush().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let whole = parse(&bytes, blocks()).unwrap().segments;
        assert_eq!(whole.len(), 2);
        for length in HEADER_BYTES..bytes.len() {
            let loaded = parse(&bytes[..length], blocks()).unwrap();
            assert!(whole.starts_with(&loaded.segments), "truncated to {length}");
            assert_eq!(loaded.dropped_bytes as usize + HEADER_BYTES + loaded.segments.len() * (bytes.len() - HEADER_BYTES) / 2, length);
        }
        for position in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[position] ^= 0x40;
            let Ok(loaded) = parse(&damaged, blocks()) else {
                assert!(position < MAGIC.len(), "byte {position} flipped: refused as not a manifest");
                continue;
            };
            assert!(whole.starts_with(&loaded.segments), "byte {position} flipped: {:?}", loaded.segments);
            assert!(loaded.segments.len() < 2, "byte {position} flipped went unnoticed");
        }
        let other = parse(&bytes, SegmentBlocks::new(32).unwrap()).unwrap();
        assert!(other.segments.is_empty() && other.discarded.as_deref().unwrap().contains("16 blocks, not 32"), "{other:?}");
        assert_eq!(parse(b"something else entirely", blocks()).unwrap_err(), Foreign);
    }

    #[test]
    fn what_is_not_a_manifest_is_refused_and_left_as_it_is() {
        // Goal: a `--cluster-state` naming something other than a manifest (a slip: the pool's
        // own image) is refused as a configuration error and the file is left byte for byte;
        // before, it was discarded and the start's rewrite renamed a 12-byte manifest over it.
        // A FIFO is refused without hanging (the open would wait for a writer), and a stale
        // `PATH.new` is removed by a rewrite only when it is a manifest a crash left.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("pool.img");
        std::fs::write(&path, b"something else entirely").unwrap();
        let error = load(&path, blocks()).unwrap_err();
        assert!(matches!(&error, DaemonError::Config(message) if message.contains("TSMF")), "{error}");
        assert_eq!(std::fs::read(&path).unwrap(), b"something else entirely");

        let fifo = directory.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let error = lock(&fifo).unwrap_err();
        assert!(matches!(&error, DaemonError::Config(message) if message.contains("is a FIFO")), "{error}");
        let error = load(&fifo, blocks()).unwrap_err();
        assert!(matches!(&error, DaemonError::Config(message) if message.contains("is a FIFO")), "{error}");
        let error = load(directory.path(), blocks()).unwrap_err();
        assert!(matches!(&error, DaemonError::Config(message) if message.contains("is a directory")), "{error}");

        // A manifest whose PATH.new is someone else's: refused at load and by a rewrite, kept.
        let manifest = directory.path().join("segments");
        let temporary = temporary_of(&manifest);
        std::fs::write(&temporary, b"not ours").unwrap();
        let error = load(&manifest, blocks()).unwrap_err();
        assert!(matches!(&error, DaemonError::Config(message) if message.contains("segments.new")), "{error}");
        assert!(Manifest::rewrite(&manifest, blocks(), 0, std::iter::empty()).is_err());
        assert_eq!(std::fs::read(&temporary).unwrap(), b"not ours");
        // One a crash left (a manifest, or empty): replaced by the rewrite.
        std::fs::write(&temporary, header(VERSION, blocks())).unwrap();
        assert!(load(&manifest, blocks()).unwrap().segments.is_empty());
        Manifest::rewrite(&manifest, blocks(), 0, std::iter::empty()).unwrap();
        assert!(!temporary.exists());
        assert_eq!(std::fs::read(&manifest).unwrap(), header(VERSION, blocks()));
    }

    /// A reader of `remaining` bytes of `byte` that counts what was taken from it.
    struct Counted {
        byte: u8,
        remaining: u64,
        read: std::rc::Rc<std::cell::Cell<u64>>,
    }

    impl Read for Counted {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(usize::try_from(self.remaining).unwrap_or(usize::MAX));
            buf[..n].fill(self.byte);
            self.remaining -= n as u64;
            self.read.set(self.read.get() + n as u64);
            Ok(n)
        }
    }

    #[test]
    fn what_does_not_begin_with_the_magic_is_refused_after_its_first_bytes() {
        // Goal: the slip the module docs name (`--cluster-state` at the pool's image, GiBs) is
        // refused having read the magic's 4 bytes, not the whole file into memory first (a
        // start under a memory limit was killed instead of refused). A manifest is read whole.
        let read = std::rc::Rc::new(std::cell::Cell::new(0));
        let image = Counted { byte: 0, remaining: 64 << 20, read: read.clone() };
        assert_eq!(read_bounded(image, 64 << 20).unwrap(), Err(Refused::Foreign));
        assert!(read.get() <= MAGIC.len() as u64, "read {} bytes of a file that is not a manifest", read.get());

        let mut manifest = header(VERSION, blocks()).to_vec();
        manifest.extend_from_slice(&[7; 100]);
        let length = manifest.len() as u64;
        assert_eq!(read_bounded(&manifest[..], length).unwrap(), Ok(manifest.clone()));
        assert_eq!(read_bounded(&b""[..], 0).unwrap(), Ok(Vec::new()), "an empty file is an empty manifest");
        assert_eq!(read_bounded(&b"TS"[..], 2).unwrap(), Err(Refused::Foreign), "shorter than the magic");
        assert_eq!(read_bounded(&b""[..], FILE_BYTES_MAX + 1).unwrap(), Err(Refused::TooLarge(FILE_BYTES_MAX + 1)));
    }

    #[test]
    fn a_path_changed_since_its_load_is_refused_before_the_rewrite() {
        // Goal: what the start read at the manifest's path must still be there, untouched,
        // when it comes to rewrite it: a file created where none was, one written since
        // (the pool's image, created or formatted at a --cluster-state naming it) or another
        // file renamed there is refused (Config) and left; an unchanged path, missing or
        // a manifest, passes.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("manifest");
        let loaded = load(&path, blocks()).unwrap();
        still_as_loaded(&path, &loaded).expect("missing then and now");
        std::fs::write(&path, b"").unwrap();
        assert!(matches!(still_as_loaded(&path, &loaded), Err(DaemonError::Config(_))), "created since");
        let loaded = load(&path, blocks()).unwrap();
        still_as_loaded(&path, &loaded).expect("empty then and now");
        std::fs::write(&path, b"TUTTIKV\0 a pool").unwrap();
        match still_as_loaded(&path, &loaded) {
            Err(DaemonError::Config(message)) => assert!(message.contains("--cluster-state"), "{message}"),
            other => panic!("written since: {other:?}"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"TUTTIKV\0 a pool", "left as it is");
        drop(Manifest::rewrite(&path, blocks(), 0, std::iter::empty()).unwrap());
        let loaded = load(&path, blocks()).unwrap();
        still_as_loaded(&path, &loaded).expect("a manifest unchanged");
        let other = directory.path().join("other");
        std::fs::copy(&path, &other).unwrap();
        std::fs::rename(&other, &path).unwrap();
        assert!(matches!(still_as_loaded(&path, &loaded), Err(DaemonError::Config(_))), "another file renamed there");
    }
}
