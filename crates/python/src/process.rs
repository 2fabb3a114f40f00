//! Which process a session belongs to. A `Store` or `LookupClient` holds a socket to tuttid and
//! a queue pair (in tuttid's shared window, or a controller's in-process); a child forked from
//! the process that opened it inherits those as they are, shared with the parent: its calls
//! would interleave with the parent's on one stream, take the parent's completions, and end the
//! parent's requests. So a session answers only in the process that opened it: elsewhere every
//! call is refused, and its drop lets go of nothing (the parent still owns it all; what the
//! child inherited stays, unused, until the child exits).
//!
//! Except the child's copies of the descriptors that let the parent's session end: tuttid's
//! socket (tuttid ends a session when the connection reaches end of file, which a child's copy
//! holds off: the session and its memory would stay until the parent exits), the device locks
//! (a `flock` belongs to the open file: a child's copy keeps the pool locked once the parent is
//! gone), block-device claims and VFIO's container, group and device fds (their release runs
//! only when the last reference to the open file goes, and the parent holds its own: closing
//! the child's copy runs no driver teardown, unmap or queue deletion). The owner records them
//! (`keep_from_forked_children`) and every forked child closes its copies with `close(2)` at
//! the fork (`pthread_atfork`, so a Store the child never drops pins nothing either), and again
//! when it drops an inherited object (`close_inherited`). Memory and mappings stay leaked.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Once;

use crate::errors::{ErrorClass, Failure};
use crate::ffi::{at_fork_in_child, close_inherited_copy, fd_identity, FdIdentity};

/// The process that opened a session (`std::process::id()` then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwningProcess {
    pid: u32,
}

impl OwningProcess {
    /// The calling process.
    pub fn current() -> OwningProcess {
        OwningProcess { pid: std::process::id() }
    }

    /// Whether the calling process is the owner (not a child forked from it).
    pub fn is_current(&self) -> bool {
        std::process::id() == self.pid
    }

    /// Tests: a process other than the calling one (as a forked child sees its parent).
    #[cfg(test)]
    pub fn other_for_tests() -> OwningProcess {
        OwningProcess { pid: std::process::id().wrapping_add(1) }
    }

    /// InvalidState unless the calling process is the owner; `what` names the object
    /// ("the store", "the lookup client").
    pub fn check(&self, what: &str) -> Result<(), Failure> {
        let current = std::process::id();
        if current == self.pid {
            return Ok(());
        }
        Err(refusal(what, self.pid, current))
    }
}

fn refusal(what: &str, owner: u32, current: u32) -> Failure {
    Failure::new(
        ErrorClass::InvalidState,
        format!(
            "{what} was opened by process {owner} and inherited across fork: open or attach again in the child (process \
             {current}); the parent's session is the parent's alone"
        ),
    )
}

/// Descriptors recorded to close in forked children: a few per open store or client (a socket,
/// a lock and a file per device, VFIO's three), so 512 is room for over a hundred at once; past
/// that a child keeps its copy (said once per registration, loudly).
const FORK_SLOTS: usize = 512;
const SLOT_FREE: u8 = 0;
const SLOT_WRITING: u8 = 1;
const SLOT_READY: u8 = 2;

/// One recorded descriptor: lock-free, since a forked child reads them where a lock a parent
/// thread held at the fork would never be let go.
struct ForkSlot {
    state: AtomicU8,
    pid: AtomicU32,
    fd: AtomicI32,
    device: AtomicU64,
    inode: AtomicU64,
    anon_kind: AtomicU64,
}

impl ForkSlot {
    /// The identity recorded (read once the slot is seen ready).
    fn identity(&self) -> FdIdentity {
        FdIdentity {
            device: self.device.load(Ordering::Relaxed),
            inode: self.inode.load(Ordering::Relaxed),
            anon_kind: self.anon_kind.load(Ordering::Relaxed),
        }
    }

    /// Whether the slot is a ready record of this process's `fd`.
    fn records(&self, pid: u32, fd: RawFd) -> bool {
        self.state.load(Ordering::Acquire) == SLOT_READY && self.pid.load(Ordering::Relaxed) == pid && self.fd.load(Ordering::Relaxed) == fd
    }
}

#[allow(clippy::declare_interior_mutable_const)] // one fresh slot per array element
const EMPTY_SLOT: ForkSlot = ForkSlot {
    state: AtomicU8::new(SLOT_FREE),
    pid: AtomicU32::new(0),
    fd: AtomicI32::new(-1),
    device: AtomicU64::new(0),
    inode: AtomicU64::new(0),
    anon_kind: AtomicU64::new(0),
};
static FORK_COPIES: [ForkSlot; FORK_SLOTS] = [EMPTY_SLOT; FORK_SLOTS];
static AT_FORK: Once = Once::new();

extern "C" fn in_forked_child() {
    close_inherited();
}

/// Records `fds` (open in this process, owned by a session of it) to be closed in every child
/// forked from now on. A descriptor is recorded with the file it names (`fd_identity`): one
/// closed and its number reused names another file, which a child leaves alone; such stale
/// records of this process are dropped here.
pub fn keep_from_forked_children(fds: &[RawFd]) {
    AT_FORK.call_once(|| {
        if let Err(error) = at_fork_in_child(in_forked_child) {
            tracing::error!(%error, "tutti: pthread_atfork failed: forked children keep copies of tuttid's socket and the device locks until they drop what they inherited");
        }
    });
    let pid = std::process::id();
    for slot in &FORK_COPIES {
        if slot.state.load(Ordering::Acquire) == SLOT_READY && slot.pid.load(Ordering::Relaxed) == pid {
            let fd = slot.fd.load(Ordering::Relaxed);
            if fd_identity(fd) != Some(slot.identity()) {
                let _ = slot.state.compare_exchange(SLOT_READY, SLOT_FREE, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }
    for &fd in fds {
        let Some(identity) = fd_identity(fd) else { continue };
        let known = FORK_COPIES.iter().any(|slot| slot.records(pid, fd) && slot.identity() == identity);
        if known {
            continue;
        }
        let claimed = FORK_COPIES
            .iter()
            .find(|slot| slot.state.compare_exchange(SLOT_FREE, SLOT_WRITING, Ordering::AcqRel, Ordering::Relaxed).is_ok());
        let Some(slot) = claimed else {
            tracing::error!(fd, "tutti: no room to record a descriptor to close in forked children ({FORK_SLOTS} recorded): a child forked now keeps its copy until it exits");
            continue;
        };
        slot.pid.store(pid, Ordering::Relaxed);
        slot.fd.store(fd, Ordering::Relaxed);
        slot.device.store(identity.device, Ordering::Relaxed);
        slot.inode.store(identity.inode, Ordering::Relaxed);
        slot.anon_kind.store(identity.anon_kind, Ordering::Relaxed);
        slot.state.store(SLOT_READY, Ordering::Release);
    }
}

/// Forgets the records of `fds` (`keep_from_forked_children`), which the caller still holds
/// open: a store closing, before it closes them. A record left behind would outlive its file,
/// and an anon-inode file (a VFIO device fd) opened later under the same number has the same
/// identity: a child would close that one's copy for a store that is gone. A fork between this
/// and the close keeps its copies (the caller's close is moments away).
pub fn forget_from_forked_children(fds: &[RawFd]) {
    let pid = std::process::id();
    for slot in &FORK_COPIES {
        if fds.iter().any(|&fd| slot.records(pid, fd)) {
            let _ = slot.state.compare_exchange(SLOT_READY, SLOT_FREE, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}

/// Drops `owner`, which closes some of `sockets` (the connections to tuttid recorded for it),
/// then forgets the records of those it closed: each still names the socket it named before
/// and no longer names it. The others keep their records: found among the connections opened
/// since a snapshot (`daemon_connections_since`), they may be another thread's (recorded by it
/// too: one record), which a child forked later must still close. Forgetting after the close
/// is safe for sockets only, each a file of its own (a socket's inode is never another open
/// file's): a child forked in between finds the number closed or naming another file, and
/// leaves it alone (`close_inherited` checks the identity); a record of another file taken
/// under the number meanwhile is not this one.
pub fn close_and_forget<T>(owner: T, sockets: &[RawFd]) {
    let recorded: Vec<(RawFd, FdIdentity)> = sockets.iter().filter_map(|&fd| Some((fd, fd_identity(fd)?))).collect();
    drop(owner);
    let pid = std::process::id();
    for (fd, identity) in recorded {
        if fd_identity(fd) == Some(identity) {
            continue; // still open: not the owner's
        }
        for slot in &FORK_COPIES {
            if slot.records(pid, fd) && slot.identity() == identity {
                let _ = slot.state.compare_exchange(SLOT_READY, SLOT_FREE, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }
}

/// In a process forked from one that recorded descriptors: closes this process's copies of
/// them (those still naming the file recorded) and forgets them; the records of this process
/// itself stay. Async-signal-safe (atomics, getpid, fstat, readlink, close): it runs in
/// `pthread_atfork`'s child handler. Idempotent.
pub fn close_inherited() {
    let pid = std::process::id();
    for slot in &FORK_COPIES {
        let state = slot.state.load(Ordering::Acquire);
        if state == SLOT_FREE || slot.pid.load(Ordering::Relaxed) == pid {
            continue;
        }
        // A slot the parent was writing at the fork is forgotten: its descriptor was not yet
        // recorded (the child keeps that one copy).
        if state == SLOT_READY {
            let fd = slot.fd.load(Ordering::Relaxed);
            // Only while it still names the file recorded: whatever owns it here is
            // inherited and leaked (every call refused, its drop forgets it).
            close_inherited_copy(fd, slot.identity());
        }
        slot.state.store(SLOT_FREE, Ordering::Release);
    }
}

/// The descriptors open in this process at one moment, each with the file it named then
/// (`fd_identity`), to tell which ones an open or connect added since.
pub struct OpenFds(HashMap<RawFd, FdIdentity>);

impl OpenFds {
    /// The descriptors open now that were not open at `before` as the same file: a number
    /// closed and reused in between (another thread's close, or the open's own) names another
    /// file now, and counts as opened. (A file closed and opened again under its old number
    /// has the same identity: not told apart, and it is not a descriptor this call made new.)
    fn opened_since(&self, before: &OpenFds) -> Vec<RawFd> {
        self.0.iter().filter(|(fd, identity)| before.0.get(fd) != Some(identity)).map(|(&fd, _)| fd).collect()
    }
}

/// The descriptors open in this process now (`/proc/self/fd`), with the files they name.
pub fn open_fds() -> OpenFds {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else { return OpenFds(HashMap::new()) };
    let listed: Vec<RawFd> = entries.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok()).collect();
    // The listing's own descriptor is closed now: left in, the next file opened (a lock)
    // would take its number and never count as opened since.
    OpenFds(listed.into_iter().filter_map(|fd| fd_identity(fd).map(|identity| (fd, identity))).collect())
}

fn link_of(fd: RawFd) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()
}

/// The descriptors opened since `before` that are connections to tuttid's `socket`: Unix
/// stream sockets whose peer is bound at a path of the same name (tuttid binds the path it was
/// given, which may be spelled otherwise than the client's). Another thread's connection to the
/// same daemon may be among them: a forked child has no use for that copy either.
pub fn daemon_connections_since(before: &OpenFds, socket: &Path) -> Vec<RawFd> {
    let name = socket.file_name();
    let mut found: Vec<RawFd> = open_fds()
        .opened_since(before)
        .into_iter()
        .filter(|&fd| link_of(fd).is_some_and(|link| link.to_string_lossy().starts_with("socket:")))
        .filter(|&fd| {
            nix::sys::socket::getpeername::<nix::sys::socket::UnixAddr>(fd)
                .ok()
                .and_then(|peer| peer.path().map(|path| path.file_name() == name))
                .unwrap_or(false)
        })
        .collect();
    found.sort_unstable();
    found
}

/// The descriptors opened since `before` that hold devices of an in-process store: files under
/// `lock_dir` (the locks), the devices' own files or block devices (`paths`: their claims and
/// the software controller's backing), and VFIO's container, groups and devices.
pub fn device_fds_since(before: &OpenFds, lock_dir: &Path, paths: &[PathBuf]) -> Vec<RawFd> {
    let lock_dir = std::fs::canonicalize(lock_dir).unwrap_or_else(|_| lock_dir.to_path_buf());
    let paths: Vec<PathBuf> = paths.iter().map(|path| std::fs::canonicalize(path).unwrap_or_else(|_| path.clone())).collect();
    let mut found: Vec<RawFd> = open_fds()
        .opened_since(before)
        .into_iter()
        .filter(|&fd| {
            link_of(fd).is_some_and(|link| {
                link.starts_with(&lock_dir)
                    || paths.contains(&link)
                    || link.starts_with("/dev/vfio")
                    || link.to_string_lossy().starts_with("anon_inode:[vfio")
            })
        })
        .collect();
    found.sort_unstable();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_process_is_refused_with_what_to_do() {
        // Goal: the owner passes; any other process id is InvalidState saying to open or
        // attach again in the child, naming both processes.
        let owner = OwningProcess::current();
        assert!(owner.is_current());
        assert_eq!(owner.check("the store"), Ok(()));
        let parent = OwningProcess { pid: std::process::id().wrapping_add(1) };
        assert!(!parent.is_current());
        let failure = parent.check("the store").expect_err("another process");
        assert_eq!(failure.class, ErrorClass::InvalidState);
        assert!(failure.message.contains("inherited across fork: open or attach again in the child"), "{}", failure.message);
        assert!(failure.message.starts_with(&format!("the store was opened by process {}", parent.pid)), "{}", failure.message);
    }

    #[test]
    fn a_forked_child_closes_its_copies_of_what_was_recorded() {
        // Goal: a descriptor recorded by this process is closed in a forked child at the fork
        // (pthread_atfork), the parent's stays open, and one not recorded stays open in the child.
        let directory = std::env::temp_dir().join(format!("tutti-fork-copies-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let recorded = std::fs::File::create(directory.join("recorded")).unwrap();
        let unrecorded = std::fs::File::create(directory.join("unrecorded")).unwrap();
        use std::os::fd::AsRawFd;
        keep_from_forked_children(&[recorded.as_raw_fd()]);
        let status = fork_and_check(recorded.as_raw_fd(), unrecorded.as_raw_fd());
        assert_eq!(status, 0, "in the child: 1 = the recorded copy stayed open, 2 = one not recorded was closed");
        assert!(fd_identity(recorded.as_raw_fd()).is_some(), "the parent's descriptor is open");
        std::fs::remove_dir_all(&directory).unwrap();
    }

    #[test]
    fn a_descriptor_number_reused_for_a_device_since_the_snapshot_is_found() {
        // Goal: a number open at the snapshot (`open_fds`) that is closed and reused for a lock
        // file before the scan (`device_fds_since`) is found as opened since: the scan compares
        // the files named (device, inode), not the numbers alone. Before, the number was in the
        // snapshot and the lock's descriptor was missed (a forked child kept its copy).
        let directory = std::env::temp_dir().join(format!("tutti-fd-reuse-{}", std::process::id()));
        let lock_dir = directory.join("locks");
        std::fs::create_dir_all(&lock_dir).unwrap();
        let earlier = std::os::fd::OwnedFd::from(std::fs::File::create(directory.join("earlier")).unwrap());
        use std::os::fd::AsRawFd;
        let number = earlier.as_raw_fd();
        let before = open_fds();
        let lock = std::fs::File::create(lock_dir.join("device.lock")).unwrap();
        // The lock takes the earlier file's number (dup2 closes that file first), as an open
        // that reuses a number freed in between would.
        let mut reused = earlier;
        nix::unistd::dup2(&lock, &mut reused).unwrap();
        drop(lock);
        assert_eq!(device_fds_since(&before, &lock_dir, &[]), [number], "the reused number, now the lock's");
        drop(reused);
        std::fs::remove_dir_all(&directory).unwrap();
    }

    /// An eventfd (an anon-inode file, whose (device, inode) every eventfd, epoll, timerfd and
    /// VFIO device fd shares), owned.
    fn eventfd() -> std::os::fd::OwnedFd {
        nix::sys::eventfd::EventFd::new().expect("eventfd").into()
    }

    /// Puts a fresh epoll fd (another anon-inode file) at `number`'s place (dup2 closes the
    /// file there first), as an open that reuses a number freed in between would.
    fn reuse_for_an_epoll(number: &mut std::os::fd::OwnedFd) {
        let epoll = nix::sys::epoll::Epoll::new(nix::sys::epoll::EpollCreateFlags::empty()).expect("epoll");
        nix::unistd::dup2(&epoll.0, number).expect("dup2");
    }

    #[test]
    fn a_number_reused_by_another_anon_inode_file_since_the_snapshot_is_found() {
        // Goal: an eventfd's number open at the snapshot, reused for an epoll fd before the
        // scan, counts as opened since: both are anon-inode files with one (device, inode),
        // told apart by their /proc/self/fd link text (the VFIO device fd,
        // `anon_inode:[vfio-device]`, is one too). Before, the number was missed ([]).
        use std::os::fd::AsRawFd;
        let mut file = eventfd();
        let number = file.as_raw_fd();
        let before = open_fds();
        reuse_for_an_epoll(&mut file);
        assert!(open_fds().opened_since(&before).contains(&number), "the reused number, now an epoll fd's");
    }

    #[test]
    fn a_forked_child_keeps_an_anon_inode_file_that_took_a_recorded_number() {
        // Goal: a recorded eventfd whose number now names an epoll fd (the eventfd closed, the
        // number reused) is not closed in a forked child: the record names another file. The
        // records are compared with the link text as well as (device, inode), which all
        // anon-inode files share. Before, the child closed the epoll fd.
        use std::os::fd::AsRawFd;
        let mut file = eventfd();
        let number = file.as_raw_fd();
        keep_from_forked_children(&[number]);
        reuse_for_an_epoll(&mut file);
        let status = fork_and_check(-1, number);
        assert_eq!(status, 0, "in the child: 2 = the epoll fd at the recorded number was closed");
    }

    #[test]
    fn a_forgotten_descriptor_is_left_open_in_forked_children() {
        // Goal: a store's close forgets its records (`forget_from_forked_children`) while its
        // descriptors are still open: a child forked after that leaves the number alone, even
        // once it names another file of the same identity (a later store's VFIO device fd is
        // `anon_inode:[vfio-device]` too, whoever owns it).
        use std::os::fd::AsRawFd;
        let file = eventfd();
        let number = file.as_raw_fd();
        keep_from_forked_children(&[number]);
        forget_from_forked_children(&[number]);
        assert_eq!(fork_and_check(-1, number), 0, "in the child: 2 = the forgotten descriptor was closed");
    }

    /// Forks; the child reports (exit status) whether `closed` is closed and `open` open.
    fn fork_and_check(closed: RawFd, open: RawFd) -> i32 {
        crate::ffi::fork_for_tests(|| {
            if fd_identity(closed).is_some() {
                1
            } else if fd_identity(open).is_none() {
                2
            } else {
                0
            }
        })
    }
}
