//! examples/vfio_probe.rs drives a real controller's admin queue by hand, outside `QueuePair`,
//! so it must place the same device fences the driver does (`nvme_driver::hw`, argued there).
//! What they order cannot be observed on x86 (TSO), and the example cannot count them (the
//! driver's fence counters exist only in its own unit tests), so this checks the source order
//! of the admin loop: a missing fence passes every x86 run and fails only on Arm hardware.

/// Byte offset of the first occurrence of `needle` in `text` at or after byte `from`.
fn position(text: &str, needle: &str, from: usize) -> usize {
    let found = text[from..].find(needle).unwrap_or_else(|| panic!("vfio_probe.rs has no `{needle}` after byte {from}"));
    from + found
}

#[test]
fn the_probes_admin_loop_places_the_drivers_device_fences() {
    let source = include_str!("../examples/vfio_probe.rs");
    let run = position(source, "fn run(&mut self, registers: &dyn RegisterIo", 0);
    // Submission: the entry is written, then fenced, then the SQ tail doorbell.
    let entry_written = position(source, "self.submission_queue.write(", run);
    let submission_fence = position(source, "hw::fence_before_submission_doorbell();", entry_written);
    let submission_doorbell = position(source, "reg::doorbell_offset(0, false", run);
    assert!(submission_fence < submission_doorbell, "the SQ doorbell is written before its fence");
    // Completion: the phase tag (dword 3, Acquire), then the load fence, then the body.
    let phase_load = position(source, "CompletionEntry::DWORD3_OFFSET, Ordering::Acquire", submission_doorbell);
    let body_read = position(source, "self.completion_queue.read(", phase_load);
    let phase_fence = source[phase_load..body_read].find("hw::fence_after_completion_phase();");
    assert!(phase_fence.is_some(), "the completion body is read on the phase tag's Acquire load alone");
    // Then the CQ head doorbell, after the fence that completes the body's loads.
    let completion_fence = position(source, "hw::fence_before_completion_doorbell();", body_read);
    let completion_doorbell = position(source, "reg::doorbell_offset(0, true", body_read);
    assert!(completion_fence < completion_doorbell, "the CQ doorbell is written before its fence");
}
