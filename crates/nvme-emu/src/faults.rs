//! Fault injection: rules that fire on the Nth matching command.
//!
//! A [`FaultPlan`] is a list of [`FaultRule`]s, each counting the commands it matches (by queue
//! kind and optionally opcode) from the moment the plan is installed and firing once, on its
//! `nth` match. [`FaultPlan::from_seed`] builds a reproducible random plan.

use std::time::Duration;

use nvme_driver::spec::status::codes;
use nvme_driver::spec::{AdminOpcode, NvmeStatus, StatusCodeType};

/// Which submission queues a rule counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueFilter {
    Any,
    Admin,
    Io,
}

/// What happens to the command a rule fires on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Complete with this status without executing the command.
    Status(NvmeStatus),
    /// Execute, then post the completion this much later (other completions may overtake it).
    Delay(Duration),
    /// Execute and never post a completion.
    DropCompletion,
    /// Set CSTS.CFS and stop processing until the host resets the controller; the command gets
    /// no completion.
    ControllerFatal,
    /// Execute and post the completion with a command id that was never issued (cid ^ 0x8001).
    CorruptCommandId,
    /// Execute and post the completion naming another submission queue (SQID + 1): a
    /// controller whose view of the queue is not the host's.
    WrongSubmissionQueueId,
}

/// One fault: `action` on the `nth` (1-based) command matching `queue` and `opcode`, and with
/// `repeat`, again on every `nth` match after that (2·nth, 3·nth, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultRule {
    pub nth: u64,
    pub queue: QueueFilter,
    pub opcode: Option<u8>,
    pub action: FaultAction,
    pub repeat: bool,
}

impl FaultRule {
    /// `action` on the `nth` I/O command of any opcode.
    pub fn on_nth_io(nth: u64, action: FaultAction) -> Self {
        Self { nth, queue: QueueFilter::Io, opcode: None, action, repeat: false }
    }
    /// `action` on every `every`-th I/O command (e.g. every 10th completion delayed).
    pub fn every_nth_io(every: u64, action: FaultAction) -> Self {
        Self { repeat: true, ..Self::on_nth_io(every, action) }
    }
    /// `action` on the `nth` admin command with `opcode` (e.g. make Delete I/O SQ fail).
    pub fn on_nth_admin(nth: u64, opcode: AdminOpcode, action: FaultAction) -> Self {
        Self { nth, queue: QueueFilter::Admin, opcode: Some(opcode as u8), action, repeat: false }
    }
    /// Restricts the rule to one opcode.
    pub fn with_opcode(mut self, opcode: u8) -> Self {
        self.opcode = Some(opcode);
        self
    }
    /// Changes which queues the rule counts.
    pub fn with_queue(mut self, queue: QueueFilter) -> Self {
        self.queue = queue;
        self
    }
}

/// A set of fault rules, installed with [`crate::EmuDevice::set_faults`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    pub rules: Vec<FaultRule>,
}

/// SplitMix64: a tiny, well-mixed PRNG; plenty for reproducible fault placement.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    pub fn with_rule(mut self, rule: FaultRule) -> Self {
        self.rules.push(rule);
        self
    }

    /// `faults` I/O faults placed uniformly among the first `io_commands` I/O commands, with
    /// kinds drawn from: an error status (Internal Error, Write Fault, Unrecovered Read Error),
    /// a delay of up to 2 ms, a dropped completion, a corrupted command id. Controller fatal
    /// status is left out (it ends the run); add it with [`FaultPlan::with_rule`]. The same seed
    /// gives the same plan.
    pub fn from_seed(seed: u64, io_commands: u64, faults: usize) -> Self {
        let mut state = seed;
        let span = io_commands.max(1);
        let rules = (0..faults)
            .map(|_| {
                let nth = splitmix64(&mut state) % span + 1;
                let action = match splitmix64(&mut state) % 6 {
                    0 => FaultAction::Status(NvmeStatus::generic(codes::INTERNAL_ERROR)),
                    1 => FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::WRITE_FAULT)),
                    2 => FaultAction::Status(NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::UNRECOVERED_READ_ERROR)),
                    3 => FaultAction::Delay(Duration::from_micros(splitmix64(&mut state) % 2000)),
                    4 => FaultAction::DropCompletion,
                    _ => FaultAction::CorruptCommandId,
                };
                FaultRule::on_nth_io(nth, action)
            })
            .collect();
        Self { rules }
    }
}

/// The installed plan and each rule's match count.
#[derive(Default)]
pub(crate) struct FaultState {
    rules: Vec<(FaultRule, u64)>,
}

impl FaultState {
    pub(crate) fn install(&mut self, plan: FaultPlan) {
        self.rules = plan.rules.into_iter().map(|rule| (rule, 0)).collect();
    }

    /// Counts one command against every rule; returns the first action that fires.
    pub(crate) fn on_command(&mut self, admin: bool, opcode: u8) -> Option<FaultAction> {
        let mut fired = None;
        for (rule, count) in &mut self.rules {
            let queue_matches = match rule.queue {
                QueueFilter::Any => true,
                QueueFilter::Admin => admin,
                QueueFilter::Io => !admin,
            };
            if !queue_matches || rule.opcode.is_some_and(|wanted| wanted != opcode) {
                continue;
            }
            *count += 1;
            let due = if rule.repeat { rule.nth > 0 && *count % rule.nth == 0 } else { *count == rule.nth };
            if due && fired.is_none() {
                fired = Some(rule.action);
            }
        }
        fired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_fire_once_on_the_nth_match_and_seeds_reproduce() {
        // Goal: counting is per rule and per filter; a seed always yields the same plan.
        let mut state = FaultState::default();
        state.install(FaultPlan::none().with_rule(FaultRule::on_nth_io(2, FaultAction::DropCompletion).with_opcode(0x01)));
        assert_eq!(state.on_command(false, 0x01), None);
        assert_eq!(state.on_command(false, 0x02), None);
        assert_eq!(state.on_command(true, 0x01), None, "admin commands do not count for an I/O rule");
        assert_eq!(state.on_command(false, 0x01), Some(FaultAction::DropCompletion));
        assert_eq!(state.on_command(false, 0x01), None, "fires once");
        state.install(FaultPlan::none().with_rule(FaultRule::every_nth_io(3, FaultAction::DropCompletion)));
        let fired: Vec<bool> = (0..9).map(|_| state.on_command(false, 0x02).is_some()).collect();
        assert_eq!(fired, [false, false, true, false, false, true, false, false, true]);
        assert_eq!(FaultPlan::from_seed(7, 100, 5), FaultPlan::from_seed(7, 100, 5));
        assert_ne!(FaultPlan::from_seed(7, 100, 5), FaultPlan::from_seed(8, 100, 5));
        assert!(FaultPlan::from_seed(7, 100, 50).rules.iter().all(|rule| (1..=100).contains(&rule.nth)));
    }
}
