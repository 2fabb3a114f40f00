//! Which process a session belongs to. A `Store` or `LookupClient` holds a socket to tuttid and
//! a queue pair (in tuttid's shared window, or a controller's in-process); a child forked from
//! the process that opened it inherits those as they are, shared with the parent: its calls
//! would interleave with the parent's on one stream, take the parent's completions, and end the
//! parent's requests. So a session answers only in the process that opened it: elsewhere every
//! call is refused, and its drop lets go of nothing (the parent still owns it all; what the
//! child inherited stays, unused, until the child exits).

use crate::errors::{ErrorClass, Failure};

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
}
