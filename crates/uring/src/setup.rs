//! How a ring is set up: the io_uring setup flags it asks for ([`SetupFlags`]), and the fallback
//! to fewer flags where the kernel refuses one (`EINVAL` from `io_uring_setup`, as a kernel older
//! than the flag answers), so that a ring is always had and always says which flags are in force.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use io_uring::IoUring;

use crate::error::UringError;

/// The most entries the kernel sets a ring up with (`IORING_MAX_ENTRIES`); it answers `EINVAL`
/// past it, which [`set_up`] would take for a refused flag, so a ring refuses more itself.
pub(crate) const ENTRIES_MAX: u32 = 32768;

/// `IORING_SETUP_DEFER_TASKRUN`'s own bit (the public [`SetupFlags::DEFERRED_TASK_RUN`] carries
/// the SINGLE_ISSUER it needs too).
const DEFER_TASKRUN_BIT: u8 = 1 << 3;

/// A set of io_uring setup flags beyond the plain ring. Combine with [`SetupFlags::union`];
/// [`SetupFlags::FIO`] is what fio's io_uring engine (3.33) asks for.
#[derive(Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct SetupFlags(u8);

impl SetupFlags {
    /// The plain ring.
    pub const NONE: Self = Self(0);
    /// `IORING_SETUP_CQSIZE` with a completion queue exactly as deep as the submission queue (the
    /// kernel's default is twice as deep): fio's choice. A ring never has more transfers in flight
    /// than its capacity; the cancel answers of [`crate::Ring::cancel_in_flight`] may go past it,
    /// and wait in the kernel (`IORING_FEAT_NODROP`) until an enter with GETEVENTS, which
    /// cancellation makes. Linux 5.5.
    pub const COMPLETION_QUEUE_SIZE: Self = Self(1 << 0);
    /// `IORING_SETUP_COOP_TASKRUN`: the kernel does not interrupt the ring's thread to post a
    /// completion; it posts them at that thread's next entry into the kernel. Linux 5.19.
    pub const COOPERATIVE_TASK_RUN: Self = Self(1 << 1);
    /// `IORING_SETUP_SINGLE_ISSUER`: one thread submits. The ring is set up disabled
    /// (`IORING_SETUP_R_DISABLED`) and enabled by the first thread that enters it, which it is
    /// bound to from then on: a call that enters the kernel from any other thread is refused with
    /// [`UringError::WrongThread`] (the kernel would answer `EEXIST`). Linux 6.0.
    pub const SINGLE_ISSUER: Self = Self(1 << 2);
    /// `IORING_SETUP_DEFER_TASKRUN`: completions are posted only when the ring's own thread
    /// enters the kernel with `IORING_ENTER_GETEVENTS`; the ring does so before every look at its
    /// completion queue (see the `sys` module). Includes [`SetupFlags::SINGLE_ISSUER`], which the
    /// kernel requires with it. Linux 6.1.
    pub const DEFERRED_TASK_RUN: Self = Self(DEFER_TASKRUN_BIT | Self::SINGLE_ISSUER.0);
    /// What fio 3.33's io_uring engine sets up (checked with `strace`): all four.
    pub const FIO: Self =
        Self(Self::COMPLETION_QUEUE_SIZE.0 | Self::COOPERATIVE_TASK_RUN.0 | Self::SINGLE_ISSUER.0 | Self::DEFERRED_TASK_RUN.0);

    /// The flags of both sets.
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// Whether every flag of `other` is in this set.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether completions wait for the ring's thread to enter with `IORING_ENTER_GETEVENTS`.
    pub(crate) const fn defers_task_run(self) -> bool {
        self.contains(Self::DEFERRED_TASK_RUN)
    }

    /// The kernel's names of the flags, in the order the kernel gained them.
    fn names(self) -> impl Iterator<Item = &'static str> {
        const NAMED: [(u8, &str); 4] = [
            (SetupFlags::COMPLETION_QUEUE_SIZE.0, "CQSIZE"),
            (SetupFlags::COOPERATIVE_TASK_RUN.0, "COOP_TASKRUN"),
            (SetupFlags::SINGLE_ISSUER.0, "SINGLE_ISSUER"),
            (DEFER_TASKRUN_BIT, "DEFER_TASKRUN"),
        ];
        NAMED.into_iter().filter(move |(bit, _)| self.0 & bit != 0).map(|(_, name)| name)
    }

    /// This set less one flag (and, dropping SINGLE_ISSUER, the DEFER_TASKRUN that needs it).
    const fn without(self, flag: Self) -> Self {
        let removed = if flag.0 & Self::SINGLE_ISSUER.0 != 0 { flag.0 | Self::DEFERRED_TASK_RUN.0 } else { flag.0 };
        Self(self.0 & !removed)
    }
}

/// `CQSIZE|COOP_TASKRUN|SINGLE_ISSUER|DEFER_TASKRUN`, or `none`.
impl std::fmt::Display for SetupFlags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_empty() {
            return f.write_str("none");
        }
        for (index, name) in self.names().enumerate() {
            if index > 0 {
                f.write_str("|")?;
            }
            f.write_str(name)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for SetupFlags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SetupFlags({self})")
    }
}

/// Which flag a refused setup gives up next: the newest first (DEFER_TASKRUN before the
/// SINGLE_ISSUER it needs), so an older kernel keeps every flag it knows.
const FALLBACK_ORDER: [SetupFlags; 4] = [
    SetupFlags(DEFER_TASKRUN_BIT), // DEFER_TASKRUN alone: SINGLE_ISSUER stays
    SetupFlags::SINGLE_ISSUER,
    SetupFlags::COOPERATIVE_TASK_RUN,
    SetupFlags::COMPLETION_QUEUE_SIZE,
];

/// Sets up a ring of `entries` with `requested`, through `setup` (the kernel, or a test's
/// stand-in); on `EINVAL` gives up one flag (see [`FALLBACK_ORDER`]) and tries again. Returns
/// the ring and the flags in force. Any other error, or `EINVAL` for the plain ring, is final.
pub(crate) fn set_up(
    entries: u32,
    requested: SetupFlags,
    mut setup: impl FnMut(u32, SetupFlags) -> io::Result<IoUring>,
) -> Result<(IoUring, SetupFlags), UringError> {
    let mut flags = requested;
    // Bounded: each refusal removes at least one flag; at most FALLBACK_ORDER.len() + 1 tries.
    loop {
        match setup(entries, flags) {
            Ok(ring) => {
                if flags != requested {
                    tracing::info!(%requested, in_force = %flags, "the kernel refused some io_uring setup flags: the ring runs with fewer");
                }
                return Ok((ring, flags));
            }
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                let Some(&refused) = FALLBACK_ORDER.iter().find(|&&flag| flags.0 & flag.0 != 0) else {
                    return Err(UringError::Unsupported { reason: "io_uring_setup refused the plain ring".into(), source: Some(error) });
                };
                flags = flags.without(refused);
            }
            Err(source) => {
                return Err(UringError::Unsupported { reason: format!("io_uring_setup with {flags} failed"), source: Some(source) })
            }
        }
    }
}

/// The kernel's `io_uring_setup` with `flags`; a single-issuer ring is set up disabled, to be
/// enabled (and so bound) by the first thread that enters it.
pub(crate) fn set_up_in_kernel(entries: u32, flags: SetupFlags) -> io::Result<IoUring> {
    let mut builder = IoUring::builder();
    if flags.contains(SetupFlags::COMPLETION_QUEUE_SIZE) {
        builder.setup_cqsize(entries);
    }
    if flags.contains(SetupFlags::COOPERATIVE_TASK_RUN) {
        builder.setup_coop_taskrun();
    }
    if flags.contains(SetupFlags::SINGLE_ISSUER) {
        builder.setup_single_issuer().setup_r_disabled();
    }
    if flags.defers_task_run() {
        builder.setup_defer_taskrun();
    }
    builder.build(entries)
}

/// A number naming the calling thread, unique for the life of the process (a `ThreadId`
/// costs a reference count change per look; this costs a thread-local read).
pub(crate) fn current_thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NUMBER: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|number| *number)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_combine_print_and_fall_back_newest_first() {
        // Goal: DEFER_TASKRUN always brings SINGLE_ISSUER; the fallback drops flags newest first
        // and never leaves DEFER_TASKRUN without SINGLE_ISSUER; the names are the kernel's.
        assert!(SetupFlags::DEFERRED_TASK_RUN.contains(SetupFlags::SINGLE_ISSUER));
        assert_eq!(SetupFlags::FIO.to_string(), "CQSIZE|COOP_TASKRUN|SINGLE_ISSUER|DEFER_TASKRUN");
        assert_eq!(SetupFlags::NONE.to_string(), "none");
        assert_eq!(SetupFlags::COOPERATIVE_TASK_RUN.union(SetupFlags::COMPLETION_QUEUE_SIZE).to_string(), "CQSIZE|COOP_TASKRUN");
        assert_eq!(SetupFlags::FIO.without(SetupFlags::SINGLE_ISSUER).to_string(), "CQSIZE|COOP_TASKRUN");
        let mut tried = Vec::new();
        let refused = set_up(8, SetupFlags::FIO, |_, flags| {
            tried.push(flags.to_string());
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        })
        .err()
        .expect("the plain ring refused too");
        assert!(matches!(refused, UringError::Unsupported { .. }), "{refused}");
        assert_eq!(
            tried,
            [
                "CQSIZE|COOP_TASKRUN|SINGLE_ISSUER|DEFER_TASKRUN",
                "CQSIZE|COOP_TASKRUN|SINGLE_ISSUER",
                "CQSIZE|COOP_TASKRUN",
                "CQSIZE",
                "none"
            ]
        );
        // Another errno is final: no retry with fewer flags.
        let mut tries = 0;
        let refused = set_up(8, SetupFlags::FIO, |_, _| {
            tries += 1;
            Err(io::Error::from_raw_os_error(libc::ENOMEM))
        })
        .err()
        .expect("ENOMEM is final");
        assert!(matches!(refused, UringError::Unsupported { .. }), "{refused}");
        assert_eq!(tries, 1);
    }

    #[test]
    fn more_entries_than_io_uring_allows_are_refused_before_setup() {
        // Goal: past IORING_MAX_ENTRIES (32768) the kernel answers EINVAL, which the flag
        // fallback would take for a refused flag and end in "io_uring unavailable"; the ring
        // refuses such a size itself, naming the limit, without calling io_uring_setup.
        let sizes = std::cell::RefCell::new(Vec::new());
        let setup = |entries, _| {
            sizes.borrow_mut().push(entries);
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        };
        for entries in [32769, 65536, u32::MAX] {
            let refused = crate::Ring::set_up_with(entries, SetupFlags::FIO, setup).expect_err("too many entries");
            assert!(matches!(refused, UringError::TooManyEntries { max: 32768, .. }), "{refused}");
            assert!(refused.to_string().contains("32768"), "{refused}");
        }
        assert!(sizes.borrow().is_empty(), "io_uring_setup was called: {sizes:?}");
        // The limit itself is asked of the kernel.
        let refused = crate::Ring::set_up_with(32768, SetupFlags::NONE, setup).expect_err("the stand-in refuses");
        assert!(matches!(refused, UringError::Unsupported { .. }), "{refused}");
        assert_eq!(*sizes.borrow(), [32768]);
    }

    #[test]
    fn a_ring_refused_its_flags_falls_back_and_works_with_those_in_force() {
        // Goal: where the kernel answers EINVAL to a flag (injected here, as a kernel older than
        // DEFER_TASKRUN or than all four answers), the ring is still had, says which flags are
        // in force, and moves data; with SINGLE_ISSUER gone it is no longer bound to a thread.
        use std::os::fd::AsRawFd;
        use std::time::{Duration, Instant};

        use crate::{AlignedBuffer, Direction, Ring, Transfer};
        if !crate::available() {
            eprintln!("io_uring with bounded waits is unavailable here: test skipped");
            return;
        }
        let refusing = |refused: SetupFlags| {
            move |entries, flags: SetupFlags| {
                if flags.0 & refused.0 != 0 {
                    return Err(io::Error::from_raw_os_error(libc::EINVAL));
                }
                set_up_in_kernel(entries, flags)
            }
        };
        let file = tempfile::tempfile().unwrap();
        let write = Transfer { fd: file.as_raw_fd(), direction: Direction::Write, offset_bytes: 0, len_bytes: 4096 };
        let cases = [
            (SetupFlags(DEFER_TASKRUN_BIT), "CQSIZE|COOP_TASKRUN|SINGLE_ISSUER"),
            (SetupFlags::SINGLE_ISSUER, "CQSIZE|COOP_TASKRUN"),
            (SetupFlags::FIO, "none"),
        ];
        for (refused, in_force) in cases {
            let mut ring = Ring::set_up_with(8, SetupFlags::FIO, refusing(refused)).unwrap();
            assert_eq!(ring.setup_flags().to_string(), in_force);
            ring.push(write, AlignedBuffer::with_capacity(4096).unwrap(), 1).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut done = 0;
            // Bounded by the deadline (a wait past it is an error).
            while done == 0 {
                ring.wait(deadline).unwrap();
                done += ring.reap(|completion| completion.check().unwrap()).unwrap();
            }
            // Another thread is refused only where SINGLE_ISSUER is in force.
            let elsewhere = std::thread::scope(|scope| scope.spawn(|| ring.submit()).join().unwrap());
            let single_issuer = ring.setup_flags().contains(SetupFlags::SINGLE_ISSUER);
            assert_eq!(matches!(elsewhere, Err(UringError::WrongThread { .. })), single_issuer, "{in_force}: {elsewhere:?}");
            assert_eq!(elsewhere.is_ok(), !single_issuer, "{in_force}: {elsewhere:?}");
        }
    }
}
