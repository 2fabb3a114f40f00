//! Fuzzes the driver's whole life against a device whose answers come from the input: CAP, VS,
//! CSTS bits, Identify Controller / Namespace / Active Namespace List data, Set Features dw0,
//! failed or unanswered admin commands and raw I/O completion entries (the scripted fake
//! controller, `nvme_driver::fake_device`). Bring-up, queue creation, submission, reaping, a
//! reset with a stale pair, and teardown must return errors, never panic or hang.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = nvme_driver::fake_device::run_fuzz_input(data);
});
