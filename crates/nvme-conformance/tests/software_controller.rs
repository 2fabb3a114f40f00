//! The conformance suite against the software controller, in several controller shapes: this is
//! what every `cargo test` proves about the driver. The same suite runs against QEMU's controller
//! through VFIO in tools/vm-test.sh.
use std::sync::Arc;
use std::time::Duration;

use nvme_conformance::{run_suite, EmuFaults, FaultInjector, Outcome, SuiteConfig};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

fn run(config: EmuConfig, suite: SuiteConfig) -> nvme_conformance::SuiteReport {
    let device = EmuDevice::start(config).expect("start the software controller");
    let faults: Arc<dyn FaultInjector> = Arc::new(EmuFaults::new(Arc::clone(&device)));
    let report = run_suite(device, Some(faults), &suite);
    print!("{report}");
    report
}

fn suite() -> SuiteConfig {
    SuiteConfig { timeout: Duration::from_secs(20), queue_depth_max: 512, integrity_mib: 8, ..SuiteConfig::default() }
}

fn assert_passed(report: &nvme_conformance::SuiteReport, must_pass: &[&str]) {
    assert_eq!(report.failed(), 0, "failed checks:\n{report}");
    for name in must_pass {
        let result = report.results.iter().find(|result| result.name == *name).unwrap_or_else(|| panic!("check {name} did not run"));
        assert_eq!(result.outcome, Outcome::Passed, "{name} must pass on this controller shape");
    }
}

/// Goal: the default shape (SGL, 4 KiB LBAs, volatile write cache) passes every check, including
/// the fault-injection ones.
#[test]
fn sgl_controller_with_4k_blocks_passes_everything() {
    let report = run(EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 }), suite());
    let all: Vec<&str> = report.results.iter().map(|result| result.name).collect();
    assert_passed(&report, &all);
}

/// Goal: a controller without SGL support drives the PRP path (SGL checks skip, PRP ones pass),
/// with 512-byte LBAs and a small MDTS so large transfers split many times.
#[test]
fn prp_only_controller_with_512_byte_blocks() {
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 64 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, None)])
        .with_sgl(false)
        .with_mdts(3);
    let report = run(config, suite());
    assert_passed(&report, &["read_write_sizes_prp", "scatter_read_prp", "mdts_split", "error_invalid_field", "data_integrity"]);
    let sgl = report.results.iter().find(|result| result.name == "read_write_sizes_sgl").expect("ran");
    assert!(matches!(sgl.outcome, Outcome::Skipped(_)), "SGL must be skipped without controller support");
}

/// Goal: several namespaces of different LBA sizes, a doorbell stride above 4 bytes and a small
/// MQES: every namespace round-trips data and queue depth stays within CAP.MQES.
#[test]
fn several_namespaces_stride_and_small_queues() {
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 96 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, Some(32 << 20)), NamespaceConfig::new(4096, None)])
        .with_doorbell_stride_log2(2)
        .with_max_queue_entries(64);
    let report = run(config, SuiteConfig { integrity_mib: 0, ..suite() });
    assert_passed(&report, &["bring_up_and_identify", "queue_pairs_at_full_depth", "read_write_sizes_sgl", "read_write_sizes_prp"]);
}

/// Goal: a controller that grants a single I/O queue pair (the suite asks for 4) and has a
/// 16 KiB MDTS passes the whole suite, and the report says how many queue pairs were used.
#[test]
fn controller_granting_one_queue_pair_and_small_mdts_passes_everything() {
    let config = EmuConfig::default().with_backing(Backing::Memory { bytes: 64 << 20 }).with_io_queue_pairs_max(1).with_mdts(2);
    let report = run(config, suite());
    let all: Vec<&str> = report.results.iter().map(|result| result.name).collect();
    assert_passed(&report, &all);
    let full_depth = report.results.iter().find(|result| result.name == "queue_pairs_at_full_depth").expect("ran");
    let note = full_depth.note.as_deref().unwrap_or_default();
    assert!(note.contains("1 I/O queue pair(s): the controller granted 1 of the 4 requested"), "{note}");
    let text = report.to_string();
    assert!(text.contains("granted 1 of the 4 requested") && text.contains("MDTS 16 KiB"), "{text}");
}

/// Goal: the suite also holds on a file-backed controller (the embedded default device).
#[test]
fn file_backed_controller() {
    let directory = std::env::temp_dir().join(format!("nvme-conformance-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("temp dir");
    let path = directory.join("namespace.img");
    let config = EmuConfig::default().with_backing(Backing::File { path: path.clone(), create_bytes: Some(64 << 20) });
    let report = run(config, SuiteConfig { filter: Some("read_write".into()), ..suite() });
    let _ = std::fs::remove_dir_all(&directory);
    assert_passed(&report, &["read_write_sizes_sgl", "read_write_sizes_prp"]);
}
