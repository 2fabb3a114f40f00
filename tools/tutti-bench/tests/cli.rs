//! The binary as a user runs it: bad input is refused with one line and exit status 2 and leaves
//! no file behind; small real runs on the software controller and on io_uring succeed, verify,
//! and print JSON that parses with fio's field names.

use std::path::Path;
use std::process::{Command, Output};

fn bench(arguments: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tutti-bench")).args(arguments).output().expect("the built binary runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts exit status 2, exactly one line on stderr, containing every `needles`.
fn assert_refused(arguments: &[&str], needles: &[&str]) {
    let output = bench(arguments);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{arguments:?}: status {:?}, stderr: {text}", output.status);
    assert_eq!(text.trim_end().lines().count(), 1, "{arguments:?}: not one line: {text}");
    for needle in needles {
        assert!(text.contains(needle), "{arguments:?}: '{needle}' missing from: {text}");
    }
    assert!(output.stdout.is_empty(), "{arguments:?}: printed on stdout: {}", String::from_utf8_lossy(&output.stdout));
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|output| String::from_utf8_lossy(&output.stdout).trim() == "0").unwrap_or(false)
}

#[test]
fn bad_input_is_one_line_and_status_2() {
    // Goal: every kind of bad input the issue lists gets one line naming what is accepted.
    assert_refused(&["--frobnicate"], &["--frobnicate", "--help"]);
    assert_refused(&["--bs=4q", "--device", "emu:mem:16m"], &["4q", "accepted", "4k"]);
    assert_refused(&["--size=12zz", "--device", "emu:mem:16m"], &["12zz", "accepted"]);
    assert_refused(&["--rw=sideways", "--device", "emu:mem:16m"], &["sideways", "randread"]);
    assert_refused(&["--device", "nvme:/dev/x"], &["nvme:/dev/x", "emu:PATH", "uring:PATH"]);
    assert_refused(&["--device", "vfio:banana"], &["banana", "PCI address"]);
    assert_refused(&["--device", "/dev/nvme0n1"], &["no type prefix", "accepted"]);
    assert_refused(&["--workload=kv", "--model=gpt-5"], &["gpt-5", "llama3-8b", "qwen3-32b"]);
    assert_refused(&["--device", "emu:mem:16m", "--size", "1g"], &["larger than the device", "accepted"]);
    assert_refused(&["--device", "emu:mem:16m", "--bs", "1000"], &["512"]);
    assert_refused(&["--device", "emu:mem:16m", "--offset", "1000"], &["--offset"]);
    assert_refused(&["--device", "emu:mem:16m", "--executor", "cuda"], &["not available in this build", "cpu"]);
    assert_refused(&["--device", "emu:mem:16m", "--rw=randrw", "--verify"], &["randrw"]);
}

#[test]
fn bad_files_are_refused_and_nothing_is_left_behind() {
    let directory = tempfile::tempdir().unwrap();
    // A file that does not exist, without --size to create it.
    let missing = directory.path().join("missing.img");
    assert_refused(&["--device", &format!("emu:{}", missing.display())], &["does not exist", "--size"]);
    assert!(!missing.exists());
    // A file in a directory that does not exist.
    let nowhere = directory.path().join("no/such/dir/pool.img");
    assert_refused(&["--device", &format!("uring:{}", nowhere.display()), "--size", "1m"], &["cannot create"]);
    // A file that is not writable (root ignores modes: use a procfs file, which refuses O_DIRECT
    // and writes for everyone).
    let read_only = directory.path().join("read-only.img");
    std::fs::write(&read_only, vec![0u8; 1 << 20]).unwrap();
    let mut permissions = std::fs::metadata(&read_only).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o444);
    std::fs::set_permissions(&read_only, permissions).unwrap();
    let target = if is_root() { Path::new("/proc/version").to_path_buf() } else { read_only.clone() };
    assert_refused(&["--device", &format!("emu:{}", target.display()), "--rw=write", "--size", "4k"], &[&target.display().to_string()]);
    // A size larger than the device, on a file the run would create: refused before creating.
    let huge = directory.path().join("huge.img");
    assert_refused(&["--device", &format!("uring:{}", huge.display()), "--size", "900t"], &["free"]);
    assert!(!huge.exists(), "a refused run left {} behind", huge.display());
    let entries: Vec<_> = std::fs::read_dir(directory.path()).unwrap().map(|entry| entry.unwrap().file_name()).collect();
    assert_eq!(entries, vec![std::ffi::OsString::from("read-only.img")], "partial files left behind");
}

#[test]
fn emu_memory_write_verify_json_parses_with_fio_names() {
    // Goal: a real run through driver + software controller, verified, in fio-shaped JSON.
    let output =
        bench(&["--device", "emu:mem:16m", "--rw=randwrite", "--bs=8k", "--iodepth=8", "--size=2m", "--verify", "--output-format=json"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    let job = &json["jobs"][0];
    assert_eq!(job["write"]["total_ios"], 256, "{job}");
    assert!(job["write"]["iops"].as_f64().unwrap() > 0.0);
    assert!(job["write"]["bw_bytes"].as_u64().unwrap() > 0);
    let p99 = job["write"]["clat_ns"]["percentile"]["99.000000"].as_u64().unwrap();
    let max = job["write"]["lat_ns"]["max"].as_u64().unwrap();
    assert!(p99 > 0 && job["write"]["lat_ns"]["min"].as_u64().unwrap() <= max);
    assert!(job["usr_cpu"].is_number() && job["sys_cpu"].is_number());
    let phases = json["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2);
    assert_eq!(phases[1]["verify"], true);
    assert_eq!(phases[1]["aggregate"]["read"]["io_bytes"], 2 << 20);
    assert_eq!(json["global options"]["bs"], 8192);
}

#[test]
fn emu_file_is_created_sized_and_kept() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("pool.img");
    let output = bench(&["--device", &format!("emu:{}", path.display()), "--size=1m", "--rw=write", "--bs=64k", "--iodepth=4", "--verify"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("rw=write bs=64KiB iodepth=4"), "configuration missing: {text}");
    assert!(text.contains("no mismatch"), "{text}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
}

#[test]
fn uring_runs_with_verify_or_skips_without_io_uring() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("uring.img");
    let output = bench(&[
        "--device",
        &format!("uring:{}", path.display()),
        "--size=2m",
        "--rw=randread",
        "--bs=4k",
        "--iodepth=16",
        "--numjobs=2",
        "--verify",
    ]);
    let text = stderr(&output);
    if output.status.code() != Some(0) && (text.contains("io_uring_setup") || text.contains("O_DIRECT")) {
        eprintln!("skipped: io_uring with O_DIRECT is not available here: {text}");
        return;
    }
    assert_eq!(output.status.code(), Some(0), "{text}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("randread (verify: read back and compare): 2 job(s)"), "{stdout}");
    assert!(stdout.contains("no mismatch"), "{stdout}");
}

#[test]
fn striping_over_two_memory_devices_verifies() {
    let output =
        bench(&["--device", "emu:mem:8m", "--device", "emu:mem:8m", "--size=4m", "--rw=write", "--bs=16k", "--iodepth=4", "--verify"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("no mismatch"));
}

/// The main job as a fresh machine runs it (creates up to 1 GiB; ~15 s in release).
#[test]
#[ignore = "writes up to 1 GiB to the temp directory; run with --ignored"]
fn no_argument_default_run_succeeds_and_removes_its_file() {
    let output = bench(&[]);
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(text.contains("pool file") && text.contains("removed"), "{text}");
    let path = text.split_whitespace().find(|word| word.contains("tutti-bench-pool-")).unwrap().trim_end_matches([',', '.']);
    assert!(!Path::new(path).exists(), "{path} left behind");
}

/// A 10-block Llama-3.1-8B KV run (6 cached), verified, JSON out, on `devices`.
fn small_kv_run<'a>(devices: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--workload=kv"];
    for device in devices {
        args.extend(["--device", device]);
    }
    args.extend(["--model=llama3-8b", "--prompt-tokens=160", "--block-tokens=16", "--hit-rate=0.6", "--verify", "--output-format=json"]);
    args
}

#[test]
fn kv_store_retrieve_verify_reports_every_layer() {
    // Goal: the layer API path end to end: populate h blocks, retrieve and compare them, store
    // the rest; JSON has one entry per layer for every phase.
    let output = bench(&small_kv_run(&["emu:mem:128m"]));
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    let phases = json["phases"].as_array().unwrap();
    let blocks: Vec<u64> = phases.iter().map(|phase| phase["blocks"].as_u64().unwrap()).collect();
    assert_eq!(blocks, vec![6, 6, 4], "populate 6 of 10 blocks, retrieve them, store the other 4");
    for phase in phases {
        assert_eq!(phase["layers"].as_array().unwrap().len(), 32, "{phase}");
        assert!(phase["bw_bytes"].as_u64().unwrap() > 0);
    }
    assert_eq!(phases[1]["verified_bytes"], 6 * 32 * 2 * (32 << 10));
}

#[test]
fn kv_pool_striped_over_two_software_controllers() {
    // Goal: a KV pool over two controllers (one DMA space) stores, retrieves and verifies; the
    // report names both devices.
    let output = bench(&small_kv_run(&["emu:mem:64m", "emu:mem:64m"]));
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    assert_eq!(json["global options"]["device"], "emu:mem:64MiB,emu:mem:64MiB");
    let phases = json["phases"].as_array().unwrap();
    assert_eq!(phases[1]["verified_bytes"], 6 * 32 * 2 * (32 << 10));
}

#[test]
fn kv_bad_input_is_refused_without_leaving_files() {
    let directory = tempfile::tempdir().unwrap();
    let pool = directory.path().join("pool.img");
    assert_refused(
        &["--workload=kv", "--device", &format!("emu:{}", pool.display()), "--model=llama3-70b", "--prompt-tokens=1000000"],
        &["free"],
    );
    assert!(!pool.exists(), "a refused run left {} behind", pool.display());
    assert_refused(&["--workload=kv", "--device", "emu:mem:64m", "--prompt-tokens=100000"], &["accepted: up to"]);
    assert_refused(&["--workload=kv", "--device", "uring:/dev/null"], &["cannot hold a KV pool"]);
    assert_refused(&["--workload=kv", "--device", "emu:mem:64m", "--device", "vfio:0000:00:04.0"], &["one DMA space"]);
    assert_refused(&["--workload=kv", "--device", "emu:mem:64m", "--prompt-tokens=8"], &["less than one block"]);
    assert_refused(&["--workload=kv", "--hit-rate=1.5"], &["fraction"]);
}
