//! The binary as a user runs it: bad input is refused with one line and exit status 2 and leaves
//! no file behind; small real runs on the software controller and on io_uring succeed, verify,
//! and print JSON that parses with fio's field names; a kept pool is reopened and checked with
//! the deterministic pattern; a closed standard output ends the run quietly with status 141.

use std::path::Path;
use std::process::{Command, Output, Stdio};

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
fn a_zero_block_size_is_refused_naming_bs() {
    // Goal: --bs 0 used to panic (a division by zero sizing the stripe); it is bad input.
    assert_refused(&["--device", "emu:mem:16m", "--bs", "0", "--size", "64k"], &["--bs", "accepted"]);
    assert_refused(&["--device", "emu:mem:16m", "--bs=0"], &["--bs"]);
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
    // One file as two devices of a stripe (also through `./` and across emu: and uring:):
    // refused, naming both, before either is opened or created.
    let shared = directory.path().join("shared.img");
    let spec = format!("emu:{}", shared.display());
    let dotted = format!("uring:{}/./shared.img", directory.path().display());
    assert_refused(&["--device", &spec, "--device", &spec, "--size", "1m"], &["name the same file"]);
    assert_refused(&["--device", &spec, "--device", &dotted, "--size", "1m"], &[&spec, &dotted, "name the same file"]);
    assert!(!shared.exists(), "a refused run created {}", shared.display());
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
fn shadow_doorbells_verify_and_are_named_and_refused_outside_raw() {
    // Goal: --shadow-doorbells runs the raw workload through the shadow doorbell path of the
    // software controller with every byte verified, says so in the device line, and is refused
    // where it does nothing.
    let output =
        bench(&["--device", "emu:mem:16m", "--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=4m", "--verify", "--shadow-doorbells"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains(", shadow doorbells"), "{stdout}");
    assert_refused(&["--workload=kv", "--device", "emu:mem:128m", "--shadow-doorbells"], &["--shadow-doorbells", "--workload=raw"]);
}

#[test]
fn cpus_allowed_pins_the_jobs_and_refuses_bad_lists() {
    // Goal: a verified run with every job confined to CPU 0 succeeds and JSON records the
    // list; lists that are not lists, and the option outside the raw workload, exit 2.
    let output = bench(&[
        "--device",
        "emu:mem:16m",
        "--rw=randwrite",
        "--size=2m",
        "--numjobs=2",
        "--verify",
        "--cpus_allowed=0",
        "--output-format=json",
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    assert_eq!(json["global options"]["cpus_allowed"], "0");
    assert_refused(&["--device", "emu:mem:16m", "--cpus_allowed=2-1"], &["backwards"]);
    assert_refused(&["--device", "emu:mem:16m", "--cpus_allowed=any"], &["not a CPU list", "accepted"]);
    assert_refused(&["--workload=kv", "--device", "emu:mem:128m", "--cpus_allowed=0"], &["--cpus_allowed", "--workload=raw"]);
}

#[test]
fn number_ios_runs_exactly_that_many_ios_past_the_region_and_refuses_verify() {
    // Goal: a fixed amount of work (fio's number_ios): each job stops after N I/Os, even when
    // that wraps around a region smaller than N blocks, at every depth; --verify (one pass) refuses it.
    for (depth, ios) in [("1", 1000u64), ("32", 1003)] {
        let output = bench(&[
            "--device",
            "emu:null:1g",
            "--rw=randread",
            "--bs=4k",
            "--size=1m",
            &format!("--iodepth={depth}"),
            &format!("--number_ios={ios}"),
            "--output-format=json",
        ]);
        assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
        let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
        assert_eq!(json["jobs"][0]["read"]["total_ios"], ios, "iodepth {depth}: {}", json["jobs"][0]);
        assert_eq!(json["jobs"][0]["read"]["io_bytes"], ios * 4096);
        assert_eq!(json["global options"]["number_ios"], ios);
    }
    assert_refused(&["--device", "emu:mem:16m", "--rw=write", "--number_ios=10", "--verify"], &["--number_ios"]);
    assert_refused(&["--device", "emu:mem:16m", "--number_ios=0"], &["number_ios"]);
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

/// A uring test that finds no io_uring (or no O_DIRECT where its file lies) says so and skips;
/// with `TUTTI_REQUIRE_URING=1` (tools/test.sh's rust stage) it fails instead, as
/// `tutti_uring::available` does for the ring crate's tests, so that a machine without io_uring
/// cannot make these tests pass as skipped.
fn skip_uring(reason: &str) {
    if std::env::var_os("TUTTI_REQUIRE_URING").is_some_and(|value| value == "1") {
        panic!("TUTTI_REQUIRE_URING=1, but {reason}");
    }
    eprintln!("skipped: {reason}");
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
        skip_uring(&format!("io_uring with O_DIRECT is not available here: {text}"));
        return;
    }
    assert_eq!(output.status.code(), Some(0), "{text}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("randread (verify: read back and compare): 2 job(s)"), "{stdout}");
    assert!(stdout.contains("no mismatch"), "{stdout}");
    // The ring is set up as fio's where the kernel allows, and the device line says with what.
    assert!(stdout.contains(", ring setup "), "{stdout}");
    let output =
        bench(&["--device", &format!("uring:{}", path.display()), "--size=2m", "--rw=randread", "--bs=4k", "--output-format=json"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    let flags = json["global options"]["devices"][0]["io_uring_setup"].as_str().expect("the ring's setup flags in the JSON").to_string();
    assert!(
        flags == "none" || flags.split('|').all(|flag| ["CQSIZE", "COOP_TASKRUN", "SINGLE_ISSUER", "DEFER_TASKRUN"].contains(&flag)),
        "{flags}"
    );
    assert!(stdout.contains(&format!("ring setup {flags}")), "{stdout}");
}

#[test]
fn striping_over_two_memory_devices_verifies() {
    let output =
        bench(&["--device", "emu:mem:8m", "--device", "emu:mem:8m", "--size=4m", "--rw=write", "--bs=16k", "--iodepth=4", "--verify"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("no mismatch"));
}

#[test]
fn striping_over_new_files_holds_a_size_that_is_not_a_whole_bs_per_device() {
    // Goal: files the run creates for a stripe hold --size even when the per-device share is
    // not a whole number of --bs (each share rounds up to whole --bs): 3 MiB of 1 MiB blocks
    // over two new files, verified, and 1 MiB over two, which used to leave no room at all.
    for size in ["3m", "1m"] {
        let directory = tempfile::tempdir().unwrap();
        let a = format!("emu:{}", directory.path().join("a.img").display());
        let b = format!("emu:{}", directory.path().join("b.img").display());
        let output = bench(&["--device", &a, "--device", &b, "--size", size, "--bs", "1m", "--rw", "write", "--verify"]);
        assert_eq!(output.status.code(), Some(0), "--size {size}: {}", stderr(&output));
        assert!(String::from_utf8_lossy(&output.stdout).contains("no mismatch"), "--size {size}");
    }
}

#[test]
fn a_raw_read_on_a_temporary_pool_reads_laid_out_blocks() {
    // Goal: with no --device, a run that only reads lays its temporary pool file out with data
    // first, as it does for a file it creates, so that reads hit allocated blocks, not a
    // sparse file's holes (which read faster than any device).
    use std::os::unix::fs::MetadataExt;
    let directory = tempfile::tempdir().unwrap();
    let directory_arg = directory.path().display().to_string();
    let output = bench(&["--rw", "read", "--size", "16m", "--keep", "--directory", &directory_arg]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let files: Vec<_> = std::fs::read_dir(directory.path()).unwrap().map(|entry| entry.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let allocated_bytes = std::fs::metadata(&files[0]).unwrap().blocks() * 512;
    assert!(allocated_bytes >= 16 << 20, "{} has {allocated_bytes} bytes allocated of 16 MiB", files[0].display());
}

#[test]
fn a_size_that_is_not_whole_blocks_runs_on_a_temporary_pool_as_on_a_new_file() {
    // Goal: --size 10m --bs 4m covers the 8 MiB of whole blocks on a file --device creates
    // (sized to whole --bs blocks); without --device the temporary pool was sized to 10 MiB,
    // held 8 MiB of whole blocks, and the run was refused as "larger than the device" after the
    // pool had been laid out.
    let directory = tempfile::tempdir().unwrap();
    let directory_arg = directory.path().display().to_string();
    let new_file = format!("emu:{}/new.img", directory_arg);
    let sizes = ["--size", "10m", "--bs", "4m", "--output-format=json"];
    for place in [&["--directory", &directory_arg][..], &["--device", &new_file][..]] {
        let output = bench(&[place, &sizes[..]].concat());
        assert_eq!(output.status.code(), Some(0), "{place:?}: {}", stderr(&output));
        let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
        assert_eq!(json["global options"]["size"], 8 << 20, "{place:?}");
    }
}

#[test]
fn a_size_and_offset_past_2_pow_64_are_refused() {
    // Goal: --offset + --size that overflow a u64 are refused with one line (a panic in a
    // debug build, a wrapped region in a release build before).
    assert_refused(&["--device", "emu:null:1g", "--offset", "4k", "--size", "18446744073709551615"], &["larger than the device"]);
    let directory = tempfile::tempdir().unwrap();
    let directory_arg = directory.path().display().to_string();
    assert_refused(&["--rw", "read", "--size", "18446744073709551615", "--directory", &directory_arg], &["does not fit"]);
    let file = format!("emu:{}", directory.path().join("new.img").display());
    assert_refused(&["--device", &file, "--rw", "write", "--bs", "1m", "--size", "18446744073709551615"], &["larger than"]);
    assert_eq!(std::fs::read_dir(directory.path()).unwrap().count(), 0, "a refused run left a file behind");
}

#[test]
fn verify_with_more_jobs_than_blocks_is_refused_before_running() {
    // Goal: --verify gives each job a slice of its own; more jobs than blocks is bad usage
    // (exit 2 at planning), not a job that fails at run time (exit 1).
    assert_refused(&["--device", "emu:mem:16m", "--verify", "--size", "12k", "--bs", "4k", "--numjobs", "4"], &["--numjobs=4", "accepted"]);
}

#[test]
fn verify_with_jobs_that_do_not_divide_the_blocks_checks_every_block() {
    // Goal: 10 blocks over 3 jobs used to give each job 3 and leave the last block unwritten and
    // unchecked (36 KiB of 40); every block of --size is written once and read back once.
    let output = bench(&["--device", "emu:mem:16m", "--verify", "--size", "40k", "--bs", "4k", "--numjobs", "3", "--output-format=json"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    let phases = json["phases"].as_array().unwrap();
    assert_eq!(phases[0]["aggregate"]["write"]["io_bytes"], 40960, "{}", phases[0]["aggregate"]);
    assert_eq!(phases[1]["aggregate"]["read"]["io_bytes"], 40960, "{}", phases[1]["aggregate"]);
}

#[test]
fn a_runtime_under_a_millisecond_is_reported_as_given() {
    // Goal: --runtime 100us was reported as runtime=0ms and "runtime_ms": 0; the configuration
    // keeps it to the microsecond (runtime_ms a number with a fraction, runtime_us exact).
    let arguments = ["--device", "emu:null:16m", "--rw=read", "--runtime", "100us", "--size", "1m"];
    let output = bench(&[&arguments[..], &["--output-format=json"]].concat());
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    assert_eq!(json["global options"]["runtime_us"], 100, "{}", json["global options"]);
    assert_eq!(json["global options"]["runtime_ms"].as_f64(), Some(0.1), "{}", json["global options"]);
    let output = bench(&arguments);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("runtime=100us "), "{text}");
    let output = bench(&["--device", "emu:null:16m", "--rw=read", "--runtime", "2s", "--size", "1m"]);
    assert!(String::from_utf8_lossy(&output.stdout).contains("runtime=2000ms "), "{}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn one_job_aggregate_figures_are_the_jobs() {
    // Goal: the aggregate spans the jobs' I/O, as each job's figures do: with one job its IOPS
    // equal the job's (within 1%), though queue set-up (16 MiB of DMA buffers here) and
    // teardown take longer than the I/O itself.
    let output = bench(&["--device", "emu:null:1g", "--rw=read", "--bs=1m", "--iodepth=16", "--number_ios=64", "--output-format=json"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    let job = json["jobs"][0]["read"]["iops"].as_f64().unwrap();
    let aggregate = json["phases"][0]["aggregate"]["read"]["iops"].as_f64().unwrap();
    assert!((aggregate - job).abs() <= job * 0.01, "aggregate {aggregate} IOPS, the one job {job}");
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
fn kv_slots_of_one_four_and_sixteen_blocks_move_the_same_bytes() {
    // Goal (issue 16 item 4): pools formatted with 1, 4 and 16 blocks per slot (a layer of a
    // slot's run of blocks is one command) store and retrieve the same blocks, every byte
    // verified; JSON says which K; a kept pool keeps its own K, so the flag is refused with it.
    for k in ["1", "4", "16"] {
        let mut arguments = small_kv_run(&["emu:mem:128m"]);
        let flag = format!("--blocks-per-slot={k}");
        arguments.push(&flag);
        let output = bench(&arguments);
        assert_eq!(output.status.code(), Some(0), "{flag}: {}", stderr(&output));
        let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
        assert_eq!(json["global options"]["blocks_per_slot"].to_string(), k);
        let phases = json["phases"].as_array().unwrap();
        let blocks: Vec<u64> = phases.iter().map(|phase| phase["blocks"].as_u64().unwrap()).collect();
        assert_eq!(blocks, vec![6, 6, 4], "{flag}");
        assert_eq!(phases[1]["verified_bytes"], 6 * 32 * 2 * (32 << 10), "{flag}");
    }
    assert_refused(&["--device", "emu:/nonexistent/pool.img", "--keep-pool", "--blocks-per-slot=4"], &["--blocks-per-slot"]);
    // A kept pool is never formatted, so --overwrite would be ignored without a word: refused.
    assert_refused(&["--device", "emu:/nonexistent/pool.img", "--keep-pool", "--overwrite"], &["--overwrite"]);
    assert_refused(&["--device", "emu:/nonexistent/pool.img", "--retrieve-only", "--overwrite"], &["--overwrite"]);
}

#[test]
fn kv_layers_in_flight_one_and_two_move_the_same_bytes() {
    // Goal (issue 16 item 4): the KV loop with the next layer issued ahead (the default, 2) and
    // one layer at a time (1) both verify every byte and time every layer; JSON says which.
    for (flag, expected) in [(None, 2), (Some("--layers-in-flight=1"), 1)] {
        let mut arguments = small_kv_run(&["emu:mem:128m"]);
        arguments.extend(flag);
        let output = bench(&arguments);
        assert_eq!(output.status.code(), Some(0), "{flag:?}: {}", stderr(&output));
        let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
        assert_eq!(json["global options"]["layers_in_flight"], expected);
        let phases = json["phases"].as_array().unwrap();
        assert_eq!(phases[1]["verified_bytes"], 6 * 32 * 2 * (32 << 10));
        for phase in phases {
            let layers = phase["layers"].as_array().unwrap();
            assert_eq!(layers.len(), 32, "{phase}");
            let summed: u64 = layers.iter().map(|layer| layer["lat_ns"].as_u64().unwrap()).sum();
            assert!(summed > 0 && summed <= phase["wall_ns"].as_u64().unwrap(), "layer times overlap: {phase}");
        }
    }
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
    // 305 GiB of pool and as much engine memory: refused for the engine memory first, or (on a
    // machine that can spare that much) for the pool file not fitting the free space.
    let arguments = ["--workload=kv", "--device", &format!("emu:{}", pool.display()), "--model=llama3-70b", "--prompt-tokens=1000000"];
    assert_refused(&arguments, &[]);
    let text = stderr(&bench(&arguments));
    assert!(text.contains("of host memory asked") || text.contains("free"), "{text}");
    assert!(!pool.exists(), "a refused run left {} behind", pool.display());
    assert_refused(&["--workload=kv", "--device", "emu:mem:64m", "--prompt-tokens=100000"], &["accepted: up to"]);
    assert_refused(&["--workload=kv", "--device", "uring:/dev/null"], &["cannot hold a KV pool"]);
    assert_refused(&["--workload=kv", "--device", "emu:mem:64m", "--device", "vfio:0000:00:04.0"], &["one DMA space"]);
    assert_refused(&["--workload=kv", "--device", "emu:mem:64m", "--prompt-tokens=8"], &["less than one block"]);
    assert_refused(&["--workload=kv", "--hit-rate=1.5"], &["fraction"]);
    // --verify compares what was stored and retrieved: with no cached block (a hit rate of 0,
    // or one rounding to 0 of 10 blocks) it would compare nothing yet report verify=true.
    assert_refused(
        &["--workload=kv", "--device", "emu:mem:64m", "--prompt-tokens=160", "--hit-rate=0", "--verify"],
        &["--verify", "no block"],
    );
    assert_refused(
        &["--workload=kv", "--device", "emu:mem:64m", "--prompt-tokens=160", "--hit-rate=0.04", "--verify"],
        &["--verify", "no block"],
    );
    assert_refused(&["--workload=kv", "--layers-in-flight=0"], &["layers-in-flight"]);
    assert_refused(&["--workload=kv", "--layers-in-flight=5"], &["layers-in-flight"]);
}

#[test]
fn memory_devices_larger_than_the_machine_are_refused_with_status_2() {
    // Goal (issue 17 items 6 and 9): emu:mem:1T used to abort (exit 134, a backtrace); now one
    // line naming the size, what is available and the fix, for the raw and the kv workload.
    assert_refused(&["--device=emu:mem:1T"], &["emu:mem:1TiB", "1TiB of memory asked", "MemAvailable", "use emu:PATH"]);
    assert_refused(&["--workload=kv", "--device", "emu:mem:1T"], &["1TiB of memory asked", "use emu:PATH"]);
    // A no-storage device has a size but allocates no store: 1 TiB of it runs.
    let output = bench(&["--device", "emu:null:1T", "--rw=read", "--size=16m"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}

#[test]
fn host_memory_beyond_the_machine_is_refused_with_status_2() {
    // Goal: buffers the run would allocate up front (64 jobs × 4096 slots × 64 MiB = 16 TiB of
    // I/O buffers; 64 Ki blocks of a 4 GiB-per-block model's KV, 256 TiB) are refused in one line before
    // anything is allocated, as memory devices are, instead of failing or aborting mid-setup.
    assert_refused(
        &["--device", "emu:null:1g", "--iodepth", "4096", "--bs", "64m", "--numjobs", "64"],
        &["I/O buffers", "16.00TiB of host memory asked", "MemAvailable", "--iodepth"],
    );
    let model = ["--layers=1024", "--kv-heads=1024", "--head-dim=1024", "--tokens-per-block=1"];
    assert_refused(
        &[&["--workload=kv", "--prompt-tokens=65536"], &model[..]].concat(),
        &["engine KV memory", "of host memory asked", "--prompt-tokens"],
    );
}

/// Runs `arguments` with standard output a pipe whose read end is closed before the program
/// starts (so its first write fails, always), returning the exit status and standard error.
fn run_with_stdout_closed(arguments: &[&str]) -> (Option<i32>, String) {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let output = Command::new(env!("CARGO_BIN_EXE_tutti-bench"))
        .args(arguments)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("the built binary runs");
    (output.status.code(), stderr(&output))
}

#[test]
fn a_closed_standard_output_ends_the_run_quietly_with_141() {
    // Goal (issue 17 item 9): `tutti-bench ... | head -c1` used to panic (exit 101, "failed
    // printing to stdout: Broken pipe"); now it stops like a Unix tool: status 141, no panic, and
    // the files it created are removed.
    let directory = tempfile::tempdir().unwrap();
    let pool = directory.path().join("pool.img");
    let pool_device = format!("emu:{}", pool.display());
    for arguments in [
        vec!["--device", "emu:mem:16m", "--size=1m"],
        vec!["--device", "emu:mem:16m", "--size=1m", "--output-format=json"],
        small_kv_run(&[&pool_device]),
    ] {
        let (status, text) = run_with_stdout_closed(&arguments);
        assert_eq!(status, Some(141), "{arguments:?}: {text}");
        assert!(!text.contains("panicked"), "{arguments:?}: {text}");
    }
    // Through a real pipe into head, as a user types it.
    let shell = format!("set -o pipefail; '{}' --device emu:mem:16m --size=1m | head -c1 >/dev/null", env!("CARGO_BIN_EXE_tutti-bench"));
    let output = Command::new("bash").args(["-c", &shell]).output().unwrap();
    assert!(matches!(output.status.code(), Some(0 | 141)), "{}", stderr(&output));
    assert!(!stderr(&output).contains("panicked"), "{}", stderr(&output));
}

#[test]
fn an_output_flag_alone_runs_the_default_kv_workload() {
    // Goal (issue 17 item 9): `--output-format json` alone used to run a raw 4 KiB read at QD 1;
    // it must run the same KV store + retrieve as the bare command, with only JSON on stdout.
    // (Writes the default pool, up to 1 GiB, in the temp directory; about 15 s in a debug build.)
    let output = bench(&["--output-format", "json"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("only JSON on stdout");
    assert_eq!(json["workload"], "kv", "{json}");
    assert_eq!(json["global options"]["model"], "llama3-8b");
    assert_eq!(json["global options"]["verify"], true);
    let phases = json["phases"].as_array().unwrap();
    assert!(phases.len() == 2 && phases[1]["verified_bytes"].as_u64().unwrap() > 0, "{json}");
    assert!(json["global options"]["mapping_table"]["bytes"].as_u64().unwrap() > 0);
    assert!(stderr(&output).contains("removed"), "{}", stderr(&output));
}

/// The byte offset of the first byte of slot 0's first object in a one-device pool file.
fn first_slot_data_offset(pool: &Path) -> u64 {
    let bytes = std::fs::read(pool).unwrap();
    let superblock = objstore::format::Superblock::decode(&bytes, 0, 4096, bytes.len() as u64 / 4096).expect("a pool");
    superblock.block_lba(0, 0) * 4096
}

#[test]
fn a_prompt_the_pool_cannot_hold_is_refused_before_the_pool_is_formatted() {
    // Goal: a kv run whose prompt needs more slots than formatting its devices would give is
    // refused (exit 2) before the format, not after it destroyed the pool kept there: the
    // earlier run's blocks are still found by --retrieve-only. Tiny geometry: 4 KiB objects.
    let directory = tempfile::tempdir().unwrap();
    let pool = directory.path().join("p.img");
    let device = format!("emu:{}", pool.display());
    let geometry = ["--layers=2", "--kv-heads=1", "--head-dim=128", "--tokens-per-block=16"];
    let run = |extra: &[&str]| bench(&[&["--workload=kv", "--device", &device][..], &geometry[..], extra].concat());
    let stored = run(&["--prompt-tokens=160", "--hit-rate=1", "--verify"]);
    assert_eq!(stored.status.code(), Some(0), "{}", stderr(&stored));
    let larger = run(&["--prompt-tokens=200000"]);
    assert_eq!(larger.status.code(), Some(2), "{}", stderr(&larger));
    assert!(stderr(&larger).contains("accepted: up to"), "{}", stderr(&larger));
    let checked = run(&["--prompt-tokens=160", "--retrieve-only"]);
    assert_eq!(checked.status.code(), Some(0), "the refused run formatted the pool: {}", stderr(&checked));
}

#[test]
fn a_kept_pool_is_reopened_and_checked_with_the_deterministic_pattern() {
    // Goal (issue 17 item 9): store once; a second run with --keep-pool finds the blocks instead
    // of reformatting; --retrieve-only checks every byte against the pattern of the seed and
    // exits non-zero once one stored byte is corrupted; payload CRCs are on in bench pools.
    let directory = tempfile::tempdir().unwrap();
    let pool = directory.path().join("pool.img");
    let device = format!("emu:{}", pool.display());
    let stored = bench(&small_kv_run(&[&device]));
    assert_eq!(stored.status.code(), Some(0), "{}", stderr(&stored));
    let json: serde_json::Value = serde_json::from_slice(&stored.stdout).unwrap();
    assert_eq!(json["global options"]["payload_crc"], true);
    assert_eq!(json["global options"]["pool_mode"], "format");

    // Kept: all 10 blocks are there from the first run, so the populate phase writes none.
    let kept = bench(&["--device", &device, "--prompt-tokens=160", "--hit-rate=0.6", "--keep-pool", "--verify", "--output-format=json"]);
    assert_eq!(kept.status.code(), Some(0), "{}", stderr(&kept));
    let json: serde_json::Value = serde_json::from_slice(&kept.stdout).unwrap();
    // Two slots of 16 blocks (the default): the 6-block prefix's and the 4-block rest's.
    assert_eq!(json["global options"]["pool_valid_slots_at_open"], 2, "{}", json["global options"]);
    let blocks: Vec<u64> = json["phases"].as_array().unwrap().iter().map(|phase| phase["blocks"].as_u64().unwrap()).collect();
    assert_eq!(blocks, vec![0, 6, 0], "populate finds the 6 blocks, retrieve moves them, no new block is written");

    // Retrieve-only: every byte of the 10 blocks compared.
    let checked = bench(&["--device", &device, "--prompt-tokens=160", "--retrieve-only", "--output-format=json"]);
    assert_eq!(checked.status.code(), Some(0), "{}", stderr(&checked));
    let json: serde_json::Value = serde_json::from_slice(&checked.stdout).unwrap();
    let phases = json["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 1, "no store phase");
    assert_eq!(phases[0]["verified_bytes"], 10 * 32 * 2 * (32 << 10));
    // Another seed means other tokens: nothing is found, and the run says why.
    let other_seed = bench(&["--device", &device, "--prompt-tokens=160", "--retrieve-only", "--seed=2"]);
    assert_eq!(other_seed.status.code(), Some(1));
    assert!(stderr(&other_seed).contains("holds 0 of the prompt's 10 blocks"), "{}", stderr(&other_seed));
    // Another geometry is refused before anything is read.
    assert_refused(&["--device", &device, "--prompt-tokens=160", "--retrieve-only", "--layers=16"], &["formatted for 32 layers"]);

    // One flipped byte in a stored object: the check fails.
    let offset = first_slot_data_offset(&pool) + 1000;
    let mut bytes = std::fs::read(&pool).unwrap();
    bytes[offset as usize] ^= 0x40;
    std::fs::write(&pool, &bytes).unwrap();
    let corrupted = bench(&["--device", &device, "--prompt-tokens=160", "--retrieve-only"]);
    assert_eq!(corrupted.status.code(), Some(1), "{}", stderr(&corrupted));
    assert!(!stderr(&corrupted).contains("panicked"), "{}", stderr(&corrupted));
}

#[test]
fn a_kept_pool_runs_with_the_max_transfer_of_its_own_blocks_per_slot() {
    // Goal: a layer of a slot's run of K blocks is one command, and the software controller's
    // MDTS is raised to hold it (2 × 32 KiB × 32 = 2 MiB for llama3-8b at K = 32, the driver's
    // most per command). A run on a kept pool cannot give --blocks-per-slot, and sized the
    // MDTS for the default 16 (1 MiB): the pool's slot-layer commands were cut in two. The K is
    // read from the pool itself.
    let directory = tempfile::tempdir().unwrap();
    let device = format!("emu:{}", directory.path().join("pool.img").display());
    let description = |output: &Output| {
        assert_eq!(output.status.code(), Some(0), "{}", stderr(output));
        let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(json["global options"]["blocks_per_slot"], 32, "{}", json["global options"]);
        json["global options"]["device_description"].as_str().unwrap().to_string()
    };
    let common = ["--workload=kv", "--device", &device, "--prompt-tokens=160", "--output-format=json"];
    let formatted = description(&bench(&[&common[..], &["--blocks-per-slot=32"]].concat()));
    assert!(formatted.contains("max transfer 2MiB"), "{formatted}");
    for mode in ["--retrieve-only", "--keep-pool"] {
        let kept = description(&bench(&[&common[..], &[mode]].concat()));
        assert!(kept.contains("max transfer 2MiB"), "{mode}: {kept}");
    }
}

#[test]
fn keep_pool_refuses_what_holds_no_pool() {
    let directory = tempfile::tempdir().unwrap();
    let missing = format!("emu:{}", directory.path().join("absent.img").display());
    assert_refused(&["--device", &missing, "--retrieve-only"], &["does not exist", "--retrieve-only"]);
    assert_refused(&["--device", "emu:mem:64m", "--keep-pool"], &["starts empty"]);
    assert_refused(&["--keep-pool"], &["--device"]);
    assert_refused(&["--retrieve-only", "--hit-rate=0.5", "--device", &missing], &["--hit-rate"]);
}

#[test]
fn a_pool_formatted_with_other_lbas_is_unusable_input_naming_the_lba_size() {
    // Goal: tutti-bench runs an emu: device with 4096-byte LBAs and has no --emu-lba-bytes; a
    // sound pool formatted with 512-byte LBAs (`tutti pool format --emu-lba-bytes 512`) is not
    // damage but a pool this tool cannot read: status 2 naming both LBA sizes, as `tutti pool`
    // and tuttid say, not "damaged or never formatted" with status 1.
    let directory = tempfile::tempdir().unwrap();
    let pool = directory.path().join("pool.img");
    let device = format!("emu:{}", pool.display());
    {
        let spec = tutti_devices::DeviceSpec::parse(&device, &tutti_devices::DeviceKind::ALL).unwrap();
        let opened = tutti_devices::open_pool_devices(&[spec], 512, Some(64 << 20)).expect("a 512-byte-LBA emu: file");
        let targets: Vec<objstore::PoolTarget> = opened
            .iter()
            .map(|device| objstore::PoolTarget {
                controller: std::sync::Arc::clone(&device.controller),
                namespace: nvme_driver::NamespaceId(1),
            })
            .collect();
        let params = objstore::FormatParams { payload_crc: true, ..objstore::FormatParams::new(objstore::ModelGeometry::llama3_8b(16)) };
        objstore::format_pool(&targets, &params).expect("format a pool of 512-byte LBAs");
    }
    let output = bench(&["--device", &device, "--prompt-tokens=160", "--retrieve-only"]);
    let text = stderr(&output);
    assert!(!text.contains("damaged") && !text.contains("never formatted"), "{text}");
    // tuttid has no --emu-lba-bytes: the advice must not send the reader there.
    assert!(!text.contains("tuttid read"), "{text}");
    assert_refused(
        &["--device", &device, "--prompt-tokens=160", "--retrieve-only"],
        &[&device, "512-byte LBAs", "4096-byte LBAs", "--emu-lba-bytes"],
    );
    assert_refused(&["--device", &device, "--prompt-tokens=160", "--keep-pool"], &["512-byte LBAs"]);
}

#[test]
fn any_model_geometry_is_accepted_by_flags_or_config_file_and_reports_its_mapping_table() {
    // Goal (issue 17 item 9): a geometry that is no preset runs end to end; bad values are
    // refused in words; the mapping table's memory is reported in JSON and text.
    let custom = [
        "--device",
        "emu:mem:64m",
        "--layers=4",
        "--kv-heads=2",
        "--head-dim=64",
        "--dtype=fp8",
        "--tokens-per-block=32",
        "--prompt-tokens=320",
        "--hit-rate=0.5",
        "--verify",
        "--output-format=json",
    ];
    let output = bench(&custom);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let options = &json["global options"];
    assert_eq!((options["layers"].as_u64(), options["kv_heads"].as_u64(), options["dtype_bytes"].as_u64()), (Some(4), Some(2), Some(1)));
    assert_eq!(options["model"], "custom");
    assert_eq!(options["mapping_table"]["form"], "16-byte SGL descriptors");
    // 10 blocks x 4 layers x (K, V) x 16 bytes, plus the pad of the longest command (a layer of
    // a slot: 16 blocks by default, 2 objects of 4 KiB each), in whole 4 KiB pages of DMA memory.
    assert_eq!(options["blocks_per_slot"], 16);
    assert_eq!(options["mapping_table"]["bytes"], (10 * 4 * 2 * 16 + 16 * 2 * 4096_u64).div_ceil(4096) * 4096);
    let phases = json["phases"].as_array().unwrap();
    assert_eq!(phases[1]["verified_bytes"], 5 * 4 * 2 * 4096);
    assert!(phases.iter().all(|phase| phase["layers"].as_array().unwrap().len() == 4));

    let directory = tempfile::tempdir().unwrap();
    let config = directory.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"num_hidden_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    let output = bench(&["--device", "emu:mem:64m", "--model-config", config.to_str().unwrap(), "--prompt-tokens=64", "--verify"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("2 layers x 2 KV heads x dim 64 x 2 B, 16 tokens/block"), "{text}");
    assert!(text.contains("mapping table: "), "{text}");

    assert_refused(&["--workload=kv", "--head-dim=0"], &["--head-dim=0", "at least 1"]);
    assert_refused(&["--workload=kv", "--layers=99999999999"], &["--layers", "99999999999"]);
    assert_refused(&["--workload=kv", "--kv-heads=1024", "--head-dim=1024", "--tokens-per-block=1024"], &["exceeds 1 GiB"]);
    assert_refused(&["--workload=kv", "--dtype=int3"], &["int3", "bf16"]);
    assert_refused(&["--model-config", "/nonexistent/config.json"], &["cannot read it"]);
    assert_refused(&["--device", "emu:mem:16m", "--rw=read", "--layers=4"], &["--layers", "--workload=kv"]);
}

#[test]
fn an_emulated_timing_model_slows_the_run_and_says_so() {
    // Goal (issue 13 item 2): --emu-timing holds completions back as the modelled SSD would,
    // and every output names the model; it is refused where there is no software controller.
    let mut args = small_kv_run(&["emu:mem:128m"]);
    args.push("--emu-timing=read=16m,write=32m,mixed=0.5,latency=1ms");
    let output = bench(&args);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    let options = &json["global options"];
    assert_eq!(options["emu_timing"]["read_bytes_per_s"], 16 << 20, "{json}");
    assert_eq!(options["emu_timing"]["command_latency_us"], 1000);
    assert!(options["device_description"].as_str().unwrap().contains("EMULATED timing model: read 17 MB/s"), "{json}");
    // Retrieving 6 blocks x 32 layers x 64 KiB = 12 MiB at 16 MiB/s takes at least 0.75 s.
    let retrieve = &json["phases"][1];
    let layer_ns: u64 = retrieve["layers"].as_array().unwrap().iter().map(|layer| layer["lat_ns"].as_u64().unwrap()).sum();
    assert!(layer_ns >= 740_000_000, "retrieve took {layer_ns} ns of layer time");
    assert_refused(&["--device", "uring:/dev/null", "--emu-timing=tutti-ssd"], &["--emu-timing models the software controller"]);
    assert_refused(&["--emu-timing=fast"], &["timing model 'fast'", "accepted: tutti-ssd"]);
}

#[test]
fn a_pool_directory_in_memory_is_named_memory_in_text_and_json() {
    // Goal: a run over a file on tmpfs measures memory; an explicit --directory there still
    // runs, but the device description (text and JSON) says so plainly.
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipped: no /dev/shm here");
        return;
    }
    let arguments = ["--directory", "/dev/shm", "--rw", "read", "--size", "1m"];
    let output = bench(&[&arguments[..], &["--output-format=json"]].concat());
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON output parses");
    let description = json["global options"]["devices"][0]["description"].as_str().unwrap_or_default();
    assert!(description.contains("tmpfs: memory, not a disk"), "{description}");
    let output = bench(&arguments);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("tmpfs: memory, not a disk"), "{text}");
}

#[test]
fn raw_arguments_are_checked_before_a_temporary_pool_is_written() {
    // Goal: with no --device a raw run lays out --offset + --size bytes of a pool file; bad
    // arguments that need no device must be refused first (30 GiB were written before a
    // `--bs 1000` was refused). A directory that does not exist shows the order: the refusal
    // names the argument, not the directory.
    let missing = ["--directory", "/nonexistent-tutti-bench-dir"];
    assert_refused(&[&missing[..], &["--size", "1m", "--bs", "1000"]].concat(), &["--bs=1000", "512"]);
    assert_refused(&[&missing[..], &["--size", "1m", "--bs", "128m"]].concat(), &["--bs", "64 MiB"]);
    assert_refused(&[&missing[..], &["--size", "1m", "--offset", "1000"]].concat(), &["--offset"]);
    assert_refused(&[&missing[..], &["--size", "1m", "--time_based"]].concat(), &["--time_based needs --runtime"]);
    assert_refused(&[&missing[..], &["--size", "4k", "--bs", "8k"]].concat(), &["smaller than --bs"]);
    assert_refused(&[&missing[..], &["--size", "1m", "--rw=randrw", "--verify"]].concat(), &["randrw"]);
    // Without --size the pool is the default one, at most 1 GiB: an --offset past that is
    // refused before the pool is laid out (before, 1 GiB was written and fsynced first).
    assert_refused(&[&missing[..], &["--offset", "1t"]].concat(), &["--offset", "temporary pool"]);
    // Nor one past its last whole --bs block: 1023 MiB is 341 blocks of 3 MiB, all of them.
    assert_refused(&[&missing[..], &["--bs", "3m", "--offset", "1023m"]].concat(), &["--offset", "temporary pool", "--bs"]);
    // A pool that does not fit the free space is named as the user gave it: --size from
    // --offset (the file holds both), not a --size of their sum.
    let directory = tempfile::tempdir().unwrap();
    let here = ["--directory", directory.path().to_str().unwrap()];
    let output = bench(&[&here[..], &["--offset", "50t", "--size", "50t"]].concat());
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("--size=50") && text.contains("--offset=50") && !text.contains("--size=100"),
        "the sum was called --size: {text}"
    );
    assert_eq!(std::fs::read_dir(directory.path()).unwrap().count(), 0, "a file was written: {text}");
}

/// Whether `data` repeats with period `period` bytes throughout.
fn is_periodic(data: &[u8], period: usize) -> bool {
    data.iter().zip(&data[period..]).all(|(a, b)| a == b)
}

#[test]
fn written_blocks_carry_pseudorandom_data_that_differs_between_blocks() {
    // Goal: fio writes random, per-I/O scrambled buffers; a 256-byte pattern repeated in every
    // write compresses and deduplicates, which inflates write rows on such storage. Each slot's
    // buffer is filled with pseudorandom bytes instead, on the software controller and on
    // io_uring: two 4 KiB writes from one slot are not equal, and neither is periodic.
    let directory = tempfile::tempdir().unwrap();
    for kind in ["emu", "uring"] {
        let file = directory.path().join(format!("{kind}.img"));
        let device = format!("{kind}:{}", file.display());
        let output = bench(&["--device", &device, "--rw=write", "--bs=4k", "--size=8k"]);
        if kind == "uring" && output.status.code() != Some(0) && stderr(&output).contains("io_uring") {
            skip_uring(&format!("io_uring: {}", stderr(&output)));
            continue;
        }
        assert_eq!(output.status.code(), Some(0), "{device}: {}", stderr(&output));
        let data = std::fs::read(&file).unwrap();
        assert!(data.len() >= 8192, "{device}: {} bytes", data.len());
        assert_ne!(data[..4096], data[4096..8192], "{device}: both blocks carry the same bytes");
        assert!(!is_periodic(&data[..8192], 256), "{device}: the data repeats every 256 bytes");
        assert!(!is_periodic(&data[..4096], 512), "{device}: the first block repeats every 512 bytes");
    }
    // --scramble_buffers=0 (as SPDK's perf, which vm-bench compares with, writes its buffers):
    // the slot's pseudorandom bytes go unchanged, so two writes from one slot are equal.
    let file = directory.path().join("unscrambled.img");
    let device = format!("emu:{}", file.display());
    let output = bench(&["--device", &device, "--rw=write", "--bs=4k", "--size=8k", "--scramble_buffers=0"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let data = std::fs::read(&file).unwrap();
    assert_eq!(data[..4096], data[4096..8192], "one slot, no stamp: the same bytes twice");
    assert!(!is_periodic(&data[..4096], 512), "still pseudorandom");
    let refused = bench(&["--device", &device, "--scramble_buffers=2"]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
}

#[test]
fn raw_options_with_the_kv_and_serve_workloads_are_refused_naming_them() {
    // Goal: the kv and serve workloads used to drop --runtime, --numjobs, --iodepth, --bs, --rw,
    // --size and --offset without a word; like kv options with the raw workload, they are
    // refused (exit 2) naming each option given. And --verify makes one pass, so a --runtime
    // beside it (dropped, while the configuration printed it) is refused too.
    assert_refused(&["--workload=kv", "--device", "emu:mem:128m", "--runtime", "5"], &["--runtime", "--workload=raw"]);
    assert_refused(&["--workload=kv", "--iodepth", "8", "--bs", "1m"], &["--iodepth", "--bs", "--workload=raw"]);
    for option in ["--numjobs=2", "--rw=write", "--size=1m", "--offset=4k", "--time_based", "--number_ios=5", "--rwmixread=10"] {
        assert_refused(&["--workload=kv", "--device", "emu:mem:128m", option], &[option.split('=').next().unwrap(), "--workload=raw"]);
    }
    assert_refused(&["--workload=serve", "--runtime", "5"], &["--runtime", "--workload=raw"]);
    assert_refused(&["--policy=all", "--size", "1m"], &["--size", "--workload=raw"]);
    assert_refused(&["--device", "emu:mem:16m", "--verify", "--runtime", "5"], &["--verify", "--runtime"]);
}

#[test]
fn options_a_workload_does_not_use_are_refused_naming_them() {
    // Goal: serve's options given to the kv or raw workload, and the kv options serve does not
    // use (it formats a fresh pool of one block per slot and never sets layers in flight), were
    // dropped without a word while the figures were printed as if they applied; like raw
    // options with kv and serve, they are refused (exit 2) naming each option given.
    assert_refused(&["--workload=kv", "--device", "emu:mem:64m", "--prompt-tokens=160", "--repeat=3"], &["--repeat", "--workload=serve"]);
    assert_refused(
        &["--workload=raw", "--device", "emu:mem:16m", "--policy=naive", "--turns=2"],
        &["--policy", "--turns", "--workload=serve"],
    );
    for option in ["--blocks-per-slot=4", "--layers-in-flight=1", "--overwrite"] {
        assert_refused(&["--workload=serve", option], &[option.split('=').next().unwrap(), "--workload=kv"]);
    }
    // What serve does accept is said as it is: not --device.
    let text = stderr(&bench(&["--workload=serve", "--runtime", "5"]));
    assert!(!text.contains("--device"), "{text}");
}

#[test]
fn keep_does_not_keep_a_named_file_a_failed_run_created() {
    // Goal: --keep keeps the temporary pool of a run without --device; a file a run creates
    // for a --device it was given is removed when the run fails ("no file left behind"), and
    // --keep with --device is refused, naming it, before the file is created. Here 512-byte
    // blocks pass the argument checks, the file is created, and the device's 4096-byte blocks
    // refuse them.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("new.img");
    let device = format!("emu:{}", path.display());
    for keep in [false, true] {
        let mut arguments = vec!["--device", &device, "--size", "1m", "--bs", "512"];
        arguments.extend(keep.then_some("--keep"));
        assert_refused(&arguments, if keep { &["--keep", "--device"] } else { &["512"] });
        assert!(!path.exists(), "{arguments:?} left {} behind", path.display());
    }
}

#[test]
fn temporary_pool_options_where_there_is_no_temporary_pool_are_refused_naming_them() {
    // Goal: --directory and --keep are about the temporary pool a run without --device makes,
    // --lock-dir about the locks of the devices the run names; with --device (the run's files
    // are the ones named) or --attach (the pool is tuttid's, locked by tuttid) they would be
    // ignored without a word, so they are refused (exit 2), as each workload refuses what it
    // would not use.
    let directory = tempfile::tempdir().unwrap();
    let directory_arg = directory.path().display().to_string();
    for (arguments, named) in [
        (vec!["--device", "emu:mem:16m", "--keep"], "--keep"),
        (vec!["--device", "emu:mem:16m", "--directory", &directory_arg], "--directory"),
        (vec!["--device", "emu:mem:64m", "--workload=kv", "--prompt-tokens=160", "--keep"], "--keep"),
        (vec!["--attach", "/nonexistent/tuttid.sock", "--keep"], "--keep"),
        (vec!["--attach", "/nonexistent/tuttid.sock", "--directory", &directory_arg], "--directory"),
        (vec!["--attach", "/nonexistent/tuttid.sock", "--lock-dir", &directory_arg], "--lock-dir"),
    ] {
        assert_refused(&arguments, &[named]);
    }
    // The serve workload makes no pool file and locks nothing: it builds an in-memory pool per
    // policy, so until 2026-12-01 it ran without a word about these.
    for arguments in [
        vec!["--workload=serve", "--keep"],
        vec!["--workload=serve", "--directory", &directory_arg],
        vec!["--workload=serve", "--lock-dir", &directory_arg],
    ] {
        assert_refused(&arguments, &[arguments[1], "--workload=serve"]);
    }
    assert_eq!(std::fs::read_dir(directory.path()).unwrap().count(), 0, "a file was created");
}

/// A file of `bytes` zeroes but for ext4's superblock magic (at byte 1080, as mkfs writes it).
fn ext4_image(path: &Path, bytes: usize) -> Vec<u8> {
    let mut image = vec![0u8; bytes];
    image[1080..1082].copy_from_slice(&[0x53, 0xef]);
    std::fs::write(path, &image).unwrap();
    image
}

#[test]
fn a_pool_file_another_process_holds_is_refused_and_left_untouched() {
    // Goal: one user per pool. tuttid, `tutti pool` and Python's Store hold an exclusive flock
    // on each emu: file they use; a bench run that would write over it (kv format, a raw write)
    // or read it under them is refused with status 2 ("in use") before a byte moves.
    let directory = tempfile::tempdir().unwrap();
    let pool = directory.path().join("pool.img");
    let original: Vec<u8> = (0..128u32 << 20).map(|index| (index % 251) as u8).collect();
    std::fs::write(&pool, &original).unwrap();
    let holder = std::fs::File::open(&pool).unwrap();
    let _held = nix::fcntl::Flock::lock(holder, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| errno).unwrap();
    let device = format!("emu:{}", pool.display());
    // The kernel path (uring:) reaches the same file: it takes the same lock, named as given.
    let uring = format!("uring:{}", pool.display());
    let kv = small_kv_run(&[&device]);
    let mut kv_overwrite = kv.clone();
    kv_overwrite.push("--overwrite");
    for arguments in [
        kv,
        kv_overwrite,
        vec!["--device", &device, "--rw=write", "--bs=4k", "--size=1m"],
        vec!["--device", &device, "--rw=read", "--bs=4k", "--size=1m"],
        vec!["--device", &uring, "--rw=write", "--bs=4k", "--size=1m"],
        vec!["--device", &uring, "--rw=read", "--bs=4k", "--size=1m"],
    ] {
        let named = arguments[arguments.iter().position(|argument| *argument == "--device").unwrap() + 1].to_string();
        assert_refused(&arguments, &["in use", &pool.display().to_string(), &named]);
        assert!(std::fs::read(&pool).unwrap() == original, "{arguments:?} changed the held file");
    }
}

#[test]
fn a_kv_run_naming_one_existing_file_twice_is_refused_as_such_not_as_in_use() {
    // Goal: one file given as two devices of a kv stripe (here through `./`) is refused as the
    // same file, naming both, before anything is locked: each spec locks through its own open
    // file, so the second lock used to be refused as held by "another process" (this one).
    let directory = tempfile::tempdir().unwrap();
    let pool = directory.path().join("pool.img");
    std::fs::write(&pool, vec![0u8; 64 << 20]).unwrap();
    let spec = format!("emu:{}", pool.display());
    let dotted = format!("emu:{}/./pool.img", directory.path().display());
    let output = bench(&small_kv_run(&[&spec, &dotted]));
    let message = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{message}");
    assert!(message.contains("name the same file") && !message.contains("in use"), "{message}");
}

#[test]
fn a_kv_run_refuses_to_format_over_a_file_system_unless_told_to_overwrite() {
    // Goal: the kv workload formats a pool, which destroys what the file held; like `tutti pool
    // format` and `tuttid --format` it refuses a file holding something else (here ext4's
    // magic), naming what it found, unless given --overwrite. The image is 0644 (written under
    // umask 022), as a disk image others read is: the refusal, its one line, leaves its mode as
    // it was (a kv run narrowed it to 0600 on locking it, before refusing it, with a warning).
    use std::os::unix::fs::PermissionsExt;
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("vm.img");
    let original = ext4_image(&image, 128 << 20);
    std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mode = || std::fs::metadata(&image).unwrap().permissions().mode() & 0o7777;
    let device = format!("emu:{}", image.display());
    assert_refused(&small_kv_run(&[&device]), &["ext2/3/4", "--overwrite"]);
    assert!(std::fs::read(&image).unwrap() == original, "the refused run changed the image");
    assert_eq!(mode(), 0o644, "the refused run changed the image's mode");
    let mut overwrite = small_kv_run(&[&device]);
    overwrite.push("--overwrite");
    let output = bench(&overwrite);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    // Formatted, it is this run's pool: made its owner's only, with one warning.
    let text = stderr(&output);
    let warnings: Vec<&str> = text.lines().filter(|line| line.contains("warning")).collect();
    assert!(warnings.len() == 1 && warnings[0].contains("was mode 0644") && warnings[0].contains("it is now 0600"), "{text}");
    assert_eq!(mode(), 0o600);
    // A pool the bench formatted is reformatted without being told.
    let again = bench(&small_kv_run(&[&device]));
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
}

#[test]
fn a_kv_run_refused_for_a_later_device_leaves_an_earlier_ones_mode_alone() {
    // Goal: the lock step locks one device at a time, and each was narrowed as soon as it was
    // locked: a later device in use (or otherwise refused) left an earlier one, a file others
    // could read, narrowed to 0600 with the run refused. Nothing is narrowed before the pool
    // opens: the refusal is the one line said, and a.img keeps its mode.
    use nix::fcntl::{Flock, FlockArg};
    use std::os::unix::fs::PermissionsExt;
    let directory = tempfile::tempdir().unwrap();
    let [first, held] = ["a.img", "b.img"].map(|name| {
        let path = directory.path().join(name);
        std::fs::write(&path, vec![0u8; 64 << 20]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        path
    });
    let _holder = Flock::lock(std::fs::File::open(&held).unwrap(), FlockArg::LockExclusiveNonblock).expect("hold b.img");
    let devices = [format!("emu:{}", first.display()), format!("emu:{}", held.display())];
    assert_refused(&small_kv_run(&[&devices[0], &devices[1]]), &["in use", &held.display().to_string()]);
    for path in [&first, &held] {
        assert_eq!(std::fs::metadata(path).unwrap().permissions().mode() & 0o7777, 0o644, "{}: mode changed", path.display());
    }
}

#[test]
fn a_file_the_run_creates_is_locked_for_the_whole_run() {
    // Goal: the run locks its devices as tuttid and `tutti pool format` do (flock on the file
    // itself), but a file that did not exist yet was skipped and then created unlocked, so
    // another tuttid, pool format or bench could take it and write it mid-run. The created
    // file must be held from before it is sized to the end: a flock attempt while the run goes
    // on is refused with EWOULDBLOCK.
    use nix::fcntl::{Flock, FlockArg};
    let directory = tempfile::tempdir().unwrap();
    let file = directory.path().join("new.img");
    let device = format!("emu:{}", file.display());
    let mut child = Command::new(env!("CARGO_BIN_EXE_tutti-bench"))
        .args(["--device", &device, "--rw=write", "--bs=4k", "--size=1m", "--runtime=3s", "--time_based"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Sized (the last step before the controller opens it): created and, with the fix, locked.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::fs::metadata(&file).map(|metadata| metadata.len()).unwrap_or(0) < 1 << 20 {
        assert!(std::time::Instant::now() < deadline, "the run did not create {} within 10 s", file.display());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let attempt = Flock::lock(std::fs::File::open(&file).unwrap(), FlockArg::LockExclusiveNonblock).map(drop).map_err(|(_, errno)| errno);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut text = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut text).unwrap();
    assert_eq!(attempt, Err(nix::errno::Errno::EWOULDBLOCK), "another process could lock the file the run created, mid-run");
    assert!(status.success(), "{status:?}: {text}");
}

#[test]
fn an_interrupted_run_removes_the_file_it_created() {
    // Goal: a failed run removes the files it created; so must one ended by Ctrl-C (SIGINT),
    // as the default run's temporary pool already was: a user-named emu: file the run created
    // with --size is removed and the run exits 130, instead of staying behind half written.
    let directory = tempfile::tempdir().unwrap();
    let file = directory.path().join("interrupted.img");
    let device = format!("emu:{}", file.display());
    let mut child = Command::new(env!("CARGO_BIN_EXE_tutti-bench"))
        .args(["--device", &device, "--rw=write", "--bs=4k", "--size=1m", "--runtime=20s", "--time_based"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::fs::metadata(&file).map(|metadata| metadata.len()).unwrap_or(0) < 1 << 20 {
        assert!(std::time::Instant::now() < deadline, "the run did not create {} within 10 s", file.display());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Past creation: the run is under way (the handler is set up as the file is created).
    std::thread::sleep(std::time::Duration::from_millis(200));
    let sent = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(sent.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(!file.exists(), "{} was left behind by the interrupted run ({status:?})", file.display());
    assert_eq!(status.code(), Some(130), "{status:?}");
}

/// Runs `arguments` with standard error a pipe whose read end is closed before the program starts
/// (every status line fails with EPIPE) and standard output a file, returning the exit status
/// and what standard output holds.
fn run_with_stderr_closed(arguments: &[&str]) -> (Option<i32>, String) {
    let directory = tempfile::tempdir().unwrap();
    let out = directory.path().join("stdout.txt");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let status = Command::new(env!("CARGO_BIN_EXE_tutti-bench"))
        .args(arguments)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(writer)
        .status()
        .expect("the built binary runs");
    (status.code(), std::fs::read_to_string(&out).unwrap())
}

#[test]
fn a_closed_standard_error_does_not_lose_the_results() {
    // Goal: `2>&1 | head -1` used to panic the run (exit 101) at its first progress or status
    // line on standard error, results lost; status lines are best effort, the results are not.
    // 6 s: past the first plain progress line (every 5 s).
    let (status, out) = run_with_stderr_closed(&["--device", "emu:mem:16m", "--runtime", "6", "--time_based"]);
    assert_eq!(status, Some(0), "stdout: {out}");
    assert!(out.lines().any(|line| line.trim_start().starts_with("read: IOPS=")), "no read: IOPS line: {out}");
    // A refusal on a closed standard error still exits 2, quietly.
    let (status, out) = run_with_stderr_closed(&["--device", "emu:mem:16m", "--bs", "0"]);
    assert_eq!(status, Some(2), "stdout: {out}");
    let (status, _) = run_with_stderr_closed(&["--frobnicate"]);
    assert_eq!(status, Some(2));
}

#[test]
fn a_model_name_from_a_config_file_cannot_forge_lines() {
    // Goal: a --model-config whose name holds a newline and an escape sequence is printed
    // escaped, in the one-line refusal and in the kv header line alike.
    let directory = tempfile::tempdir().unwrap();
    let config = directory.path().join("evil.json");
    std::fs::write(
        &config,
        r#"{"name":"x\n\u001b[2Kfake line: verify OK","num_hidden_layers":2,"num_key_value_heads":8,"head_dim":128,"num_attention_heads":32,"hidden_size":4096}"#,
    )
    .unwrap();
    let config = config.display().to_string();
    // Too small a device for the model's pool: refused, naming the model.
    let output = bench(&["--workload=kv", "--model-config", &config, "--device", "emu:mem:1m"]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert_eq!(text.trim_end().lines().count(), 1, "not one line: {text}");
    assert!(text.contains("x\\n\\u{1b}[2Kfake line"), "{text}");
    assert!(!text.contains('\u{1b}'), "{text}");
    // A run that goes ahead prints the name escaped in its header.
    let output = bench(&["--workload=kv", "--model-config", &config, "--device", "emu:mem:64m", "--prompt-tokens", "32"]);
    let out = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(!out.contains('\u{1b}') && !out.lines().any(|line| line.starts_with("fake line")), "{out}");
    assert!(out.contains("model=x\\n\\u{1b}[2Kfake line"), "{out}");
}

/// Waits up to `seconds` for `child`, killing it past that.
fn wait_bounded(child: &mut std::process::Child, seconds: u64) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            return child.wait().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn an_interrupted_run_on_memory_exits_130() {
    // Goal: the documented 130 on SIGINT/SIGTERM held only for a run that created a file (the
    // handler was installed then); a run on emu:mem was killed by the signal instead.
    for signal in ["-TERM", "-INT"] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tutti-bench"))
            .args(["--device", "emu:mem:16m", "--runtime=20s", "--time_based"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // The first line on stdout: the run is under way, past start-up.
        let mut first = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.as_mut().unwrap()), &mut first).unwrap();
        let sent = Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
        assert!(sent.success());
        let status = wait_bounded(&mut child, 20);
        assert_eq!(status.code(), Some(130), "{signal}: {status:?}");
    }
}

#[test]
fn an_inherited_ignored_sigint_stays_ignored() {
    // Goal: a run started with SIGINT ignored (`nohup`-like, a shell's background job) keeps
    // ignoring it, as any Unix tool does, instead of exiting 130 at a Ctrl-C meant for others.
    // On a file the run creates: the handler that removes it on an interrupt is in place too.
    let directory = tempfile::tempdir().unwrap();
    let file = directory.path().join("pool.img");
    let script = format!(
        "trap '' INT; exec '{}' --device 'emu:{}' --size=1m --runtime=2s --time_based",
        env!("CARGO_BIN_EXE_tutti-bench"),
        file.display()
    );
    let mut child = Command::new("bash").args(["-c", &script]).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.as_mut().unwrap()), &mut first).unwrap();
    assert!(first.starts_with("tutti-bench:"), "{first}");
    let sent = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(sent.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut rest).unwrap();
    let status = wait_bounded(&mut child, 20);
    assert_eq!(status.code(), Some(0), "{status:?}: {rest}");
    assert!(rest.contains("read: IOPS="), "{rest}");
}

#[test]
fn paths_that_are_no_file_or_device_are_refused_with_status_2() {
    // Goal: a directory or a FIFO named as a device is unusable input (status 2, one line), as
    // README and docs/tutti-bench.md say of files that cannot be opened, not a failed run.
    let directory = tempfile::tempdir().unwrap();
    let fifo = directory.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    for device in [
        format!("emu:{}", directory.path().display()),
        format!("uring:{}", directory.path().display()),
        format!("emu:{}", fifo.display()),
        format!("uring:{}", fifo.display()),
    ] {
        assert_refused(&["--device", &device], &[&device, "not a regular file or a device"]);
    }
}

#[test]
fn a_missing_required_argument_is_named() {
    // Goal: clap's "the following required arguments were not provided:" names them on the
    // lines below; the one line keeps them.
    assert_refused(&["--clients", "2"], &["--attach"]);
}

#[test]
fn a_raw_run_leaves_the_mode_of_the_file_it_reads_alone() {
    // Goal: a raw run (fio's kind, on any file: a data set, a disk image) took the lock as a
    // pool file's and so narrowed this user's 0644 file to 0600 (others lost access) or refused
    // another user's that it used to read. Only kv runs, which make and use a pool, narrow; a
    // raw run locks the file and leaves its mode as it is.
    use std::os::unix::fs::PermissionsExt;
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("dataset.bin");
    std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mode = || std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
    for kind in ["emu", "uring"] {
        let device = format!("{kind}:{}", path.display());
        let output = bench(&["--device", &device, "--rw=randread", "--bs=4k", "--size=1m"]);
        let text = stderr(&output);
        if kind == "uring" && output.status.code() != Some(0) && (text.contains("io_uring_setup") || text.contains("O_DIRECT")) {
            skip_uring(&format!("io_uring with O_DIRECT is not available here: {text}"));
            continue;
        }
        assert_eq!(output.status.code(), Some(0), "{device}: {text}");
        assert_eq!(mode(), 0o644, "{device}: the raw read run changed the file's mode");
        assert!(!text.contains("was mode"), "{device}: {text}");
    }
}
