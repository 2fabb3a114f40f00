//! Fuzzing the driver through the fake: decoding an input into a script and a plan, and running it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{FakeDevice, FakeScript};
use crate::controller::{Controller, ControllerConfig};
use crate::spec::status::codes;
use crate::spec::{NvmeStatus, SubmissionEntry, COMPLETION_ENTRY_BYTES};
use crate::types::NamespaceId;

/// Header bytes of a fuzz input (see [`FakeScript::from_fuzz_input`]).
pub const FUZZ_HEADER_BYTES: usize = 32;
/// Header byte 28 with this value scripts a controller whose disable never completes.
pub const FUZZ_DISABLE_HANGS: u8 = 0xA5;

/// What [`run_fuzz_input`] does besides bring-up, from the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FuzzPlan {
    pub admin_queue_depth: u32,
    pub io_queue_depth: u32,
    /// Flush commands submitted on the I/O queue pair.
    pub commands: usize,
    /// Reset the controller after reaping and use the (stale) pair again.
    pub reset: bool,
}

impl FakeScript {
    /// Decodes a fuzz input: a [`FUZZ_HEADER_BYTES`]-byte header — CAP (8), VS (4), CSTS bits
    /// (4), Number of Queues dw0 (4), flags (1: bit 0 raw I/O phase, bit 1 reset afterwards),
    /// admin depth (1), I/O depth (1), commands (1), a failing admin opcode (1, 0xFF none) and
    /// its status field (2), an unanswered admin opcode (1, 0xFF none), a byte that makes every
    /// disable hang when it is [`FUZZ_DISABLE_HANGS`] (1; a hang costs the driver a CAP.TO wait,
    /// so random inputs should rarely pay it, and CAP.TO is then forced to 1, 500 ms), 3 spare —
    /// then sections, each a 2-byte little-endian length and that many bytes
    /// (cut short by the end of the input): Identify Controller, Active Namespace List, raw I/O
    /// completions (16 bytes each), then Identify Namespace data for NSID 1, 2, ...
    pub fn from_fuzz_input(data: &[u8]) -> Option<(FakeScript, FuzzPlan)> {
        let (header, mut rest) = data.split_first_chunk::<FUZZ_HEADER_BYTES>()?;
        let u16_at = |at: usize| u16::from_le_bytes([header[at], header[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]);
        let flags = header[20];
        let mut sections = Vec::new();
        while let Some((length, tail)) = rest.split_first_chunk::<2>() {
            let length = usize::from(u16::from_le_bytes(*length)).min(tail.len());
            sections.push(tail[..length].to_vec());
            rest = &tail[length..];
        }
        let mut sections = sections.into_iter();
        let mut script = FakeScript {
            capabilities: u64::from(u32_at(0)) | u64::from(u32_at(4)) << 32,
            version: u32_at(8),
            status_bits: u32_at(12),
            disable_completes: header[28] != FUZZ_DISABLE_HANGS,
            identify_controller: sections.next().unwrap_or_default(),
            namespace_list: sections.next().unwrap_or_default(),
            // Not in the input format (CNS 06h then completes with Invalid Field): its three
            // fields are read at fixed offsets of a page whose length Identify fixes.
            nvm_identify_controller: Vec::new(),
            identify_namespaces: Vec::new(),
            identify_namespace_failures: Vec::new(),
            log_pages: Vec::new(),
            number_of_queues_dw0: u32_at(16),
            admin_failures: Vec::new(),
            admin_unanswered: Vec::new(),
            identify_unanswered: Vec::new(),
            identify_failures: Vec::new(),
            io_completions: VecDeque::new(),
            io_phase_from_script: flags & 1 == 1,
            io_unanswered: false,
            enable_ready_after_status_reads: 0,
            enable_takes: Duration::ZERO,
            ready_timeouts: 0,
            starts_enabling: false,
            starts_enabled: false,
            starts_mastering: false,
            // Shutdowns complete at once: a fuzz run must not wait out RTD3E (up to 60 s).
            shutdown_takes: Duration::ZERO,
            shutdown_status_in_progress: 0b01,
        };
        let raw = sections.next().unwrap_or_default();
        script.io_completions = raw.chunks_exact(COMPLETION_ENTRY_BYTES).map(|chunk| chunk.try_into().unwrap_or([0; 16])).collect();
        script.identify_namespaces = sections.collect();
        if header[24] != 0xFF {
            let status = NvmeStatus::from_status_field(u16_at(25)).err().unwrap_or(NvmeStatus::generic(codes::INTERNAL_ERROR));
            script.admin_failures.push((header[24], status));
        }
        if header[27] != 0xFF {
            script.admin_unanswered.push(header[27]);
        }
        if !script.disable_completes {
            // The driver waits CAP.TO (up to 127 s) for a disable; with one that never
            // completes, the wait is the whole run. CAP.TO = 1 (500 ms) takes the same paths.
            script.capabilities = script.capabilities & !(0xFF << 24) | 1 << 24;
        }
        let plan = FuzzPlan {
            admin_queue_depth: u32::from(header[21]),
            io_queue_depth: u32::from(header[22]),
            commands: usize::from(header[23]),
            reset: flags & 2 == 2,
        };
        Some((script, plan))
    }

    /// Encodes a script and plan as [`FakeScript::from_fuzz_input`] reads them (for seeds), with
    /// trailing zeroes of each section left out. Admin failures and unanswered opcodes beyond
    /// the first are not representable.
    pub fn to_fuzz_input(&self, plan: &FuzzPlan) -> Vec<u8> {
        let mut data = vec![0u8; FUZZ_HEADER_BYTES];
        data[0..8].copy_from_slice(&self.capabilities.to_le_bytes());
        data[8..12].copy_from_slice(&self.version.to_le_bytes());
        data[12..16].copy_from_slice(&self.status_bits.to_le_bytes());
        data[16..20].copy_from_slice(&self.number_of_queues_dw0.to_le_bytes());
        data[20] = u8::from(self.io_phase_from_script) | u8::from(plan.reset) << 1;
        data[21] = plan.admin_queue_depth.min(255) as u8;
        data[22] = plan.io_queue_depth.min(255) as u8;
        data[23] = plan.commands.min(255) as u8;
        data[24] = self.admin_failures.first().map_or(0xFF, |(opcode, _)| *opcode);
        let status = self.admin_failures.first().map_or(0, |(_, status)| status.to_status_field());
        data[25..27].copy_from_slice(&status.to_le_bytes());
        data[27] = self.admin_unanswered.first().copied().unwrap_or(0xFF);
        data[28] = if self.disable_completes { 0 } else { FUZZ_DISABLE_HANGS };
        let raw: Vec<u8> = self.io_completions.iter().flatten().copied().collect();
        let mut sections = vec![&self.identify_controller, &self.namespace_list, &raw];
        sections.extend(self.identify_namespaces.iter());
        for section in sections {
            // Trailing zeroes are implied (Identify data is zero-padded to 4 KiB on its way to
            // the host), which keeps seeds small for the fuzzer's mutations.
            let used = section.iter().rposition(|&byte| byte != 0).map_or(0, |last| last + 1);
            let length = used.min(usize::from(u16::MAX));
            data.extend_from_slice(&(length as u16).to_le_bytes());
            data.extend_from_slice(&section[..length]);
        }
        data
    }
}

/// What [`run_fuzz_input`] got to, for tests that check a seed reaches deep paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FuzzOutcome {
    pub brought_up: bool,
    pub queue_created: bool,
    pub completions_reaped: usize,
    pub reset_done: bool,
}

/// Runs one fuzz input: brings a controller up on a [`FakeDevice`] scripted by the input,
/// creates an I/O queue pair, submits Flushes, reaps whatever the script posts (with a deadline
/// of a few milliseconds), optionally resets and tries the stale pair, then drops everything.
/// Every outcome is fine except a panic or a hang; `None` if the input is too short.
pub fn run_fuzz_input(data: &[u8]) -> Option<FuzzOutcome> {
    let (script, plan) = FakeScript::from_fuzz_input(data)?;
    let device = FakeDevice::new(script);
    let config = ControllerConfig {
        admin_queue_depth: plan.admin_queue_depth,
        io_queue_pairs_requested: 2,
        admin_timeout: Duration::from_millis(2),
        ..ControllerConfig::default()
    };
    let mut outcome = FuzzOutcome::default();
    let Ok(mut controller) = Controller::init(device, config) else { return Some(outcome) };
    outcome.brought_up = true;
    for namespace in controller.namespaces() {
        let _ = (namespace.size_bytes(), controller.namespace(namespace.id));
    }
    let _ = controller.namespace(NamespaceId(1));
    let Ok(mut queue) = controller.create_io_queue_pair(plan.io_queue_depth) else { return Some(outcome) };
    outcome.queue_created = true;
    for tag in 0..plan.commands {
        if queue.submit_raw(SubmissionEntry::flush(NamespaceId(1)), tag as u64).is_err() {
            break;
        }
    }
    let mut reaped = 0;
    if queue.ring_doorbell().is_ok() {
        // The fake posted its completions inside the doorbell write: the first reap sees them
        // all, however slow the machine. Later rounds (for scripted entries the driver skips)
        // end at a short deadline, and an error ends them.
        let deadline = Instant::now() + Duration::from_millis(2);
        loop {
            if queue.reap(usize::MAX, |_| reaped += 1).is_err() || queue.in_flight() == 0 || Instant::now() >= deadline {
                break;
            }
        }
    }
    outcome.completions_reaped = reaped;
    if plan.reset {
        outcome.reset_done = controller.reset(false).is_ok();
        let stale = queue.submit_raw(SubmissionEntry::flush(NamespaceId(1)), 0).and_then(|()| queue.ring_doorbell());
        assert!(stale.is_err(), "a pair from before a reset rang its doorbell");
    }
    drop(queue);
    drop(controller);
    Some(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake_device::identify_namespace_bytes;
    use crate::spec::{AdminOpcode, CompletionEntry};

    fn seed(script: &FakeScript, plan: FuzzPlan) -> Vec<u8> {
        script.to_fuzz_input(&plan)
    }

    fn seed_directory() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/driver_bring_up")
    }

    /// The committed seeds of the `driver_bring_up` fuzz target, by name: each reaches a
    /// different path of bring-up, I/O or teardown.
    fn seeds() -> Vec<(&'static str, Vec<u8>)> {
        let plan = FuzzPlan { admin_queue_depth: 8, io_queue_depth: 16, commands: 5, reset: true };
        let well_formed = FakeScript::default();
        let mut prp_two_namespaces = FakeScript::default();
        prp_two_namespaces.identify_controller[536..540].copy_from_slice(&0u32.to_le_bytes());
        prp_two_namespaces.identify_controller[516..520].copy_from_slice(&2u32.to_le_bytes());
        prp_two_namespaces.namespace_list[4..8].copy_from_slice(&2u32.to_le_bytes());
        prp_two_namespaces.identify_namespaces.push(identify_namespace_bytes(512, 4096, 8, true));
        let raw = |command_id: u16, sq_head: u16, sq_id: u16| {
            CompletionEntry { dw0: 0, dw1: 0, sq_head, sq_id, command_id, status_and_phase: 0 }.to_bytes()
        };
        let hostile_completions = FakeScript {
            io_completions: VecDeque::from([raw(0, 1, 1), raw(0x8001, 2, 1), raw(1, 9, 1), raw(2, 3, 7)]),
            ..FakeScript::default()
        };
        let version_1_0 = FakeScript { version: 0x0001_0000, ..FakeScript::default() };
        let failing_create = FakeScript {
            admin_failures: vec![(AdminOpcode::CreateIoSubmissionQueue as u8, NvmeStatus::generic(codes::INTERNAL_ERROR))],
            ..FakeScript::default()
        };
        let unanswered_delete = FakeScript { admin_unanswered: vec![AdminOpcode::DeleteIoSubmissionQueue as u8], ..FakeScript::default() };
        vec![
            ("well_formed", seed(&well_formed, plan)),
            ("prp_two_namespaces_one_with_metadata", seed(&prp_two_namespaces, plan)),
            ("hostile_completions", seed(&hostile_completions, FuzzPlan { commands: 4, ..plan })),
            ("version_1_0_without_namespace_list", seed(&version_1_0, plan)),
            ("create_sq_fails", seed(&failing_create, plan)),
            ("delete_sq_unanswered", seed(&unanswered_delete, FuzzPlan { reset: false, ..plan })),
            // No seed with a disable that hangs: each run would cost two CAP.TO waits (1 s), and
            // every mutation of it would too; the unit tests in `hardening_tests` cover that path.
        ]
    }

    #[test]
    #[ignore = "writes fuzz/seeds/driver_bring_up; run by hand after changing the seeds"]
    fn write_fuzz_seeds() {
        std::fs::create_dir_all(seed_directory()).expect("seed directory");
        for (name, data) in seeds() {
            std::fs::write(seed_directory().join(name), data).expect("write seed");
        }
    }

    #[test]
    fn committed_fuzz_seeds_are_current_and_reach_bring_up() {
        // Goal: the seeds in the repository are the ones this file describes, and each gets
        // through bring-up (else the fuzzer starts blind).
        for (name, data) in seeds() {
            let committed = std::fs::read(seed_directory().join(name)).unwrap_or_default();
            assert_eq!(committed, data, "seed {name} is stale: run `cargo test -p nvme-driver -- --ignored write_fuzz_seeds`");
            let outcome = run_fuzz_input(&data).expect("decodes");
            assert!(outcome.brought_up, "seed {name}: {outcome:?}");
        }
    }

    #[test]
    fn the_default_script_brings_up_and_serves_io() {
        // Goal: the fake is a controller the driver accepts (else fuzzing it proves nothing),
        // and its fuzz encoding round-trips.
        let plan = FuzzPlan { admin_queue_depth: 8, io_queue_depth: 16, commands: 5, reset: true };
        let script = FakeScript::default();
        let input = seed(&script, plan);
        let (decoded, decoded_plan) = FakeScript::from_fuzz_input(&input).expect("decodes");
        assert_eq!(decoded.to_fuzz_input(&decoded_plan), input, "encoding round-trips");
        assert_eq!(decoded_plan, plan);
        let outcome = run_fuzz_input(&input).expect("runs");
        assert_eq!(outcome, FuzzOutcome { brought_up: true, queue_created: true, completions_reaped: 5, reset_done: true });
    }
}
