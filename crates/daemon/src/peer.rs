//! Whether a client process is still running: the process at the other end of a connection,
//! named by its pid (`SO_PEERCRED`) and the start time the kernel gave it, so that a pid reused
//! by a later process is not mistaken for the client.
//!
//! tuttid needs this where a session ends while its client may still ring doorbells: on a
//! software controller with a shared register page a client writes its queues' doorbells
//! directly, and a queue id given to the next client while the old one still runs would let
//! the old one's doorbells reach the new one's queue (`crate::server`, docs/tuttid.md "Leases
//! and crashes"). Read from `/proc/<pid>/stat` (field 3, the state; field 22, the start time
//! in clock ticks since boot); no unsafe code.

use std::path::PathBuf;

/// A process as it was when the connection was accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerProcess {
    pid: u32,
    start_ticks: u64,
    proc_root: PathBuf,
}

impl PeerProcess {
    /// The running process `pid`, or `None` when it cannot be told apart from a later one: pid 0
    /// (the peer is in a pid namespace this daemon cannot see), no such process, or a `/proc`
    /// entry that does not parse.
    pub fn of(pid: u32) -> Option<PeerProcess> {
        Self::of_in(PathBuf::from("/proc"), pid)
    }

    fn of_in(proc_root: PathBuf, pid: u32) -> Option<PeerProcess> {
        if pid == 0 {
            return None;
        }
        let Stat::Read { start_ticks, .. } = read_stat(&proc_root.join(pid.to_string())) else { return None };
        Some(PeerProcess { pid, start_ticks, proc_root })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process has exited: its `/proc` entry is gone or names a later process
    /// (another start time), or every one of its threads is a zombie (exited, not yet reaped:
    /// it runs no code any more; a leader that ended alone with `pthread_exit` reads as a
    /// zombie while its other threads run). What cannot be read for another reason (out of
    /// descriptors, no permission) reads as still running: waiting longer is the safe error.
    pub fn has_exited(&self) -> bool {
        let process = self.proc_root.join(self.pid.to_string());
        match read_stat(&process) {
            Stat::Gone => true,
            Stat::Unknown => false,
            Stat::Read { start_ticks, .. } if start_ticks != self.start_ticks => true,
            Stat::Read { state, .. } if !exited(state) => false,
            Stat::Read { .. } => !any_thread_runs(&process),
        }
    }
}

/// What `/proc/<pid>/stat` (or a thread's) says.
enum Stat {
    Read {
        state: char,
        start_ticks: u64,
    },
    /// No such entry: the process (or thread) is gone.
    Gone,
    /// Not readable or not parsed.
    Unknown,
}

/// Zombie or dead: it runs no code.
fn exited(state: char) -> bool {
    matches!(state, 'Z' | 'X' | 'x')
}

/// The state and start time in `<entry>/stat`. The command name (field 2) is in parentheses
/// and may itself hold spaces and parentheses, so the fields are counted from its last `)`.
fn read_stat(entry: &std::path::Path) -> Stat {
    match std::fs::read_to_string(entry.join("stat")) {
        Ok(text) => parse_stat(&text).map_or(Stat::Unknown, |(state, start_ticks)| Stat::Read { state, start_ticks }),
        Err(error) if matches!(error.kind(), std::io::ErrorKind::NotFound) || error.raw_os_error() == Some(3) => Stat::Gone,
        Err(_) => Stat::Unknown,
    }
}

/// Whether a thread of the process in `/proc` entry `process` runs (is not a zombie). A task
/// list that cannot be read counts as running, unless the process is gone.
fn any_thread_runs(process: &std::path::Path) -> bool {
    let tasks = match std::fs::read_dir(process.join("task")) {
        Ok(tasks) => tasks,
        Err(error) => return !matches!(error.kind(), std::io::ErrorKind::NotFound),
    };
    tasks.flatten().any(|task| match read_stat(&task.path()) {
        Stat::Read { state, .. } => !exited(state),
        Stat::Gone => false,
        Stat::Unknown => true,
    })
}

fn parse_stat(text: &str) -> Option<(char, u64)> {
    let after_name = &text[text.rfind(')')? + 1..];
    let mut fields = after_name.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // Fields 4..=21 lie between the state (3) and the start time (22).
    let start_ticks = fields.nth(22 - 4)?.parse().ok()?;
    Some((state, start_ticks))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn the_fields_are_counted_from_the_last_parenthesis() {
        // Goal: a command name with spaces and parentheses does not shift the fields.
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615";
        assert_eq!(parse_stat(stat), Some(('S', 987_654)));
        assert_eq!(parse_stat("4242 (x) Z 1 2 3"), None, "too few fields");
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) R 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 notanumber 0"), None);
    }

    #[test]
    fn this_process_runs_and_an_exited_child_has_exited() {
        // Goal: the daemon's own process reads as running; a child reads as exited once it
        // ends, whether still a zombie (not yet waited for) or reaped; pid 0 is unknown.
        let me = PeerProcess::of(std::process::id()).expect("this process");
        assert!(!me.has_exited());
        let mut child = Command::new("sleep").arg("30").spawn().expect("sleep");
        let peer = PeerProcess::of(child.id()).expect("the child runs");
        assert!(!peer.has_exited());
        child.kill().unwrap();
        // Killed but not waited for: a zombie (bounded wait for the signal to land).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !peer.has_exited() {
            assert!(std::time::Instant::now() < deadline, "the killed child never read as exited");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(peer.has_exited(), "reaped");
        assert_eq!(PeerProcess::of(0), None);
    }

    #[test]
    fn a_reused_pid_is_another_process() {
        // Goal: a pid whose start time changed names a later process, so the client has exited.
        let root = tempfile::tempdir().unwrap();
        let stat = |state: char, ticks: u64| format!("77 (engine) {state} 1 77 77 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {ticks} 0 0");
        let write = |path: &str, text: String| {
            let path = root.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write("77/stat", stat('S', 500));
        let peer = PeerProcess::of_in(root.path().to_path_buf(), 77).expect("the fake process");
        assert!(!peer.has_exited());
        // The leader ended alone (pthread_exit): a zombie while another thread runs.
        write("77/stat", stat('Z', 500));
        write("77/task/77/stat", stat('Z', 500));
        write("77/task/78/stat", stat('S', 500));
        assert!(!peer.has_exited(), "a thread of it still runs");
        write("77/task/78/stat", stat('Z', 500));
        assert!(peer.has_exited(), "every thread a zombie");
        // A stat that does not parse is not an exit.
        write("77/stat", "garbage".into());
        assert!(!peer.has_exited(), "unreadable is not gone");
        write("77/stat", stat('S', 900));
        assert!(peer.has_exited(), "another start time: another process");
        std::fs::remove_dir_all(root.path().join("77")).unwrap();
        assert!(peer.has_exited(), "gone");
    }
}
