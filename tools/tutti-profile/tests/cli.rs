//! The `tutti-profile` binary end to end: simulate prints the crossover figures and writes its
//! files; analytic writes a table that check accepts; io measures on the software controller and
//! writes a table the scheduler loads, and refuses what it cannot measure; bad tables and bad
//! arguments fail with a message, not a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tutti-profile"))
}

/// A test's own directory under the temporary directory, removed when the test ends (pass or
/// fail), so repeated runs do not fill the disk.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("tutti-profile-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// Taken by every test: the `io` tests time real work, and on a small machine a simulator sweep
/// running beside them would be measured too.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("binary runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn simulate_json_prints_crossovers_and_writes_files() {
    let _one = exclusive();
    let out = scratch("simulate");
    let output = run(bin().args(["simulate", "--preset", "llama3-8b-h100-32k", "--json", "--out"]).arg(&out));
    assert!(output.status.success(), "{}", stderr(&output));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    let bound = report["analytic_bound_hit_rate"].as_f64().expect("bound present");
    let policies = report["policies"].as_array().expect("policies");
    let names: Vec<&str> = policies.iter().map(|p| p["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["slack-aware", "naive-pipeline", "no-overlap"]);
    for policy in policies {
        assert!(policy["crossover_hit_rate"].as_f64().is_some(), "{policy}");
    }
    let slack = policies[0]["crossover_hit_rate"].as_f64().unwrap();
    assert!((slack - bound).abs() <= 0.01, "slack {slack} bound {bound}");
    assert!(report["note"].as_str().unwrap().contains("not measured"));
    for file in ["hit_rate_sweep.csv", "prefix_length_sweep.csv", "hit_rate.svg", "summary.json"] {
        let path = out.join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!text.is_empty());
    }
    let csv = std::fs::read_to_string(out.join("hit_rate_sweep.csv")).unwrap();
    // Header + 3 policies × 513 prefix lengths.
    assert_eq!(csv.lines().count(), 1 + 3 * 513);
    let svg = std::fs::read_to_string(out.join("hit_rate.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("★") && svg.contains("bound"));
}

#[test]
fn analytic_then_check_then_simulate_with_the_table() {
    let _one = exclusive();
    let dir = scratch("analytic");
    let table = dir.join("llama.json");
    let output = run(bin()
        .args(["analytic", "--model", "llama3-8b", "--gpu", "h100", "--input-step", "4096"])
        .args(["--input-count", "8", "--prefix-step", "512", "--out"])
        .arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(bin().arg("check").arg(&table).args(["--against-target", "--model", "llama3-8b"]));
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("not measured"));
    // The table belongs to llama3-8b: checking it against qwen3-32b must fail and say why.
    let output = run(bin().arg("check").arg(&table).args(["--against-target", "--model", "qwen3-32b"]));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("model.name"), "{}", stderr(&output));
    let output = run(bin().args(["simulate", "--preset", "llama3-8b-h100-32k", "--out"]).arg(dir.join("sim")).arg("--table").arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(bin().args(["simulate", "--preset", "qwen3-32b-h100-32k", "--out"]).arg(dir.join("sim2")).arg("--table").arg(&table));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("does not fit preset"), "{}", stderr(&output));
}

/// Goal: `simulate --table` counts I/O in the table's IOCB size, not the preset's: a table of
/// 2 MiB IOCBs is simulated with 2 MiB IOCBs (the summary says so). Before, the preset's 8 MiB
/// went to the simulator, and the policy priced 8 MiB kernels with 2 MiB rows.
#[test]
fn simulate_with_a_table_uses_the_tables_iocb_size() {
    let _one = exclusive();
    let dir = scratch("iocb-size");
    let table = dir.join("llama-2m.json");
    let output = run(bin()
        .args(["analytic", "--model", "llama3-8b", "--gpu", "h100", "--input-step", "4096"])
        .args(["--input-count", "8", "--prefix-step", "512", "--iocb-bytes", "2097152", "--out"])
        .arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    let out = dir.join("sim");
    let output = run(bin()
        .args(["simulate", "--preset", "llama3-8b-h100-32k", "--decode-steps", "0", "--out"])
        .arg(&out)
        .arg("--table")
        .arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["preset"]["iocb_bytes"], 2 << 20, "{summary}");
}

/// The tiny grid of the `io` tests: IOCBs of 16 IOCTXs of 4 KiB, so a debug build finishes in
/// about a second while 64 IOCBs move 64× the bytes of one (4 MiB: milliseconds of copying even
/// on the software controller, well above the wake-up latencies that dominate one small IOCB).
const TINY_GRID: [&str; 10] =
    ["--iocb-counts", "1,64", "--sm-budgets", "1,2", "--ioctxs-per-iocb", "16", "--ioctx-bytes", "4K", "--repetitions", "5"];

#[test]
fn io_measures_a_table_on_an_in_memory_emulated_device() {
    // Goal: `io` runs the CPU executor on the software controller and writes a table that the
    // scheduler's loader accepts, labelled with what was measured, whose durations are real
    // measurements: moving 64 IOCBs takes longer than moving one.
    let _one = exclusive();
    let dir = scratch("io");
    let out = dir.join("io.json");
    let output = run(bin().args(["io", "--device", "emu:mem:16M"]).args(TINY_GRID).arg("--out").arg(&out));
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stderr(&output).contains("io [8/8]"), "plain progress lines off a terminal: {}", stderr(&output));
    let text = std::fs::read_to_string(&out).expect("table written");
    let profile = scheduler::table::Profile::from_json(&text).expect("the measured table passes the scheduler's validation");
    let table = profile.table();
    for label in ["measured", "executor cpu", "nvme-emu", "memory", "host", "not GPU-kernel costs"] {
        assert!(table.io_cost_source.contains(label), "`{label}` missing from {}", table.io_cost_source);
    }
    assert!(table.compute_source.contains("not measured"), "{}", table.compute_source);
    assert_eq!(table.io_costs.len(), 2 * 2 * 2);
    for kind in [scheduler::table::IoKind::Read, scheduler::table::IoKind::Write] {
        for budget in [1, 2] {
            let rows: Vec<_> = table.io_costs.iter().filter(|r| r.kind == kind && r.sm_budget == budget).collect();
            assert_eq!(rows.iter().map(|r| r.iocb_count).collect::<Vec<_>>(), [1, 64]);
            assert!(rows.iter().all(|r| r.duration_us > 0.0 && r.bytes == u64::from(r.iocb_count) * 16 * 4096), "{rows:?}");
            assert!(rows[1].duration_us > rows[0].duration_us, "{kind:?} budget {budget}: 64 IOCBs no slower than 1: {rows:?}");
        }
    }
    let output = run(bin().arg("check").arg(&out));
    assert!(output.status.success(), "{}", stderr(&output));
    // `import` takes the measured rows and keeps their provenance.
    let timeline = dir.join("timeline.csv");
    let mut csv = String::from("phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used\n");
    for layer in 0..32 {
        let t = f64::from(layer) * 1000.0;
        for prefix in [0, 4096] {
            csv.push_str(&format!("prefill,4096,{prefix},{layer},attn,{t},{},120\n", t + 900.0));
        }
    }
    csv.push_str("decode,4096,,,step,0,3000,60\n");
    std::fs::write(&timeline, csv).unwrap();
    let imported = dir.join("imported.json");
    let output = run(bin().arg("import").arg("--timeline").arg(&timeline).arg("--io-costs").arg(&out).arg("--out").arg(&imported));
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(bin().arg("check").arg(&imported));
    assert!(String::from_utf8_lossy(&output.stdout).contains("measured by tutti-profile io"), "{}", stderr(&output));
}

#[test]
fn io_on_the_default_temporary_device_with_prp_lists_removes_its_file() {
    // Goal: without --device, `io` creates a file-backed software controller and removes the file
    // afterwards; PRP data pointers with lists (16 KiB = 4 pages per IOCTX) work as SGLs do.
    let _one = exclusive();
    let child = bin()
        .args(["io", "--iocb-counts", "1,2", "--sm-budgets", "1", "--ioctxs-per-iocb", "4", "--ioctx-bytes", "16K", "--repetitions", "1"])
        .args(["--data-pointer", "prp"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("binary runs");
    let pid = child.id();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stderr(&output).contains("temporary file") && stderr(&output).contains("PRP"), "{}", stderr(&output));
    assert!(stderr(&output).contains("nothing written"), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("duration_us"));
    let prefix = format!("tutti-profile-io-{pid}-");
    let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.file_name().to_string_lossy().starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "temporary device file left behind: {left:?}");
}

#[test]
fn io_refuses_what_it_cannot_measure_and_writes_nothing() {
    // Goal: a GPU executor that is not here, a device holding data without --overwrite, and bad
    // grid or device arguments are errors with a message; no table appears.
    let _one = exclusive();
    let dir = scratch("io-refuse");
    let out = dir.join("io.json");
    let output = run(bin().args(["io", "--executor", "cuda", "--out"]).arg(&out));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("GPU executor cannot run here"), "{}", stderr(&output));
    // An existing file holds data: writes would overwrite it.
    let file = dir.join("precious.img");
    std::fs::write(&file, vec![7u8; 1 << 20]).unwrap();
    let output = run(bin().arg("io").arg(format!("--device=emu:{}", file.display())).args(TINY_GRID).arg("--out").arg(&out));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("--overwrite"), "{}", stderr(&output));
    // The span is named in a unit that shows it (not `>> 20`, which printed a small span as "0 MiB").
    assert!(stderr(&output).contains("the first 4MiB of the device's first namespace"), "{}", stderr(&output));
    assert!(std::fs::read(&file).unwrap().iter().all(|&b| b == 7), "the file was touched");
    for bad in [
        vec!["--sm-budgets", "0"],
        vec!["--device", "uring:/dev/nvme0n1"],
        vec!["--device", "emu:mem:lots"],
        vec!["--sm-budgets", "500"],
        vec!["--ioctx-bytes", "1000", "--device", "emu:mem:1M"],
    ] {
        let output = run(bin().arg("io").args(&bad).arg("--out").arg(&out));
        assert!(!output.status.success(), "{bad:?} accepted");
        assert!(!stderr(&output).contains("panicked"), "{bad:?}: {}", stderr(&output));
    }
    // A timeout past a day would overflow the sample's deadline (Instant + Duration): exit 2.
    let (code, text) = status(&[&["io", "--device", "emu:mem:16M", "--timeout-s", "18446744073709551615"][..], &TINY_GRID[..]].concat());
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("accepted: whole seconds from 1 to 86400"), "{text}");
    assert!(!out.exists(), "io must not write a table it did not measure");
}

#[test]
fn io_on_a_file_another_process_holds_is_status_2_naming_the_holder() {
    // Goal: tuttid flocks its pool file for its life; `io --overwrite` on that file would
    // overwrite what the daemon serves, so it takes the same lock first: status 2, naming the
    // holder (this process, holding tutti-devices' lock as tuttid does), the bytes unchanged.
    let _one = exclusive();
    let dir = scratch("io-held");
    let file = dir.join("pool.img");
    std::fs::write(&file, vec![7u8; 8 << 20]).unwrap();
    let spec = tutti_devices::DeviceSpec::EmuFile(file.clone());
    let lock_dir = dir.join("locks");
    let holder = tutti_devices::DeviceLocks::acquire(std::slice::from_ref(&spec), &lock_dir, false).unwrap();
    let output = run(bin()
        .arg("io")
        .arg(format!("--device=emu:{}", file.display()))
        .arg("--overwrite")
        .arg("--lock-dir")
        .arg(&lock_dir)
        .args(TINY_GRID));
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("is in use by another process") && text.contains("is held by"), "{text}");
    if !text.contains(&format!("held by pid {} (", std::process::id())) {
        // /proc/locks may hide the holder (another mount namespace): the text is what is checked.
        eprintln!("note: the holder was not named here: {text}");
    }
    assert!(std::fs::read(&file).unwrap().iter().all(|&b| b == 7), "a refused run wrote to the file");
    drop(holder);
    // A file that does not exist yet is created (locked from the start) and grown to the span.
    let new_file = dir.join("new.img");
    let output = run(bin().arg("io").arg(format!("--device=emu:{}", new_file.display())).arg("--lock-dir").arg(&lock_dir).args(TINY_GRID));
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(std::fs::metadata(&new_file).unwrap().len(), 4 << 20);
}

/// Says why a loop-device test cannot run here and returns (the test passes as skipped), unless
/// `TUTTI_REQUIRE_LOOP=1` is in the environment (tools/test.sh sets it where it could attach,
/// format and mount a loop device itself): then the skip fails the test. As in
/// tools/tutti/tests/cli.rs.
fn skip_without_loop(reason: &str) {
    if std::env::var_os("TUTTI_REQUIRE_LOOP").is_some_and(|value| value == "1") {
        panic!("TUTTI_REQUIRE_LOOP=1, but the loop-device test cannot run: {reason}");
    }
    eprintln!("SKIPPED (set TUTTI_REQUIRE_LOOP=1 to fail instead): {reason}");
}

/// A loop device over a file, detached when dropped.
struct LoopDevice {
    node: String,
}

impl LoopDevice {
    /// `None` with the reason given to `skip_without_loop` where this host cannot make one (not
    /// root, no losetup, no free loop device: losetup says which).
    fn attach(image: &Path) -> Option<LoopDevice> {
        match Command::new("losetup").args(["--find", "--show"]).arg(image).output() {
            Ok(output) if output.status.success() => Some(LoopDevice { node: String::from_utf8_lossy(&output.stdout).trim().to_string() }),
            Ok(output) => {
                skip_without_loop(&format!("losetup --find --show failed: {}", String::from_utf8_lossy(&output.stderr).trim()));
                None
            }
            Err(error) => {
                skip_without_loop(&format!("losetup cannot run: {error}"));
                None
            }
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.node).status();
    }
}

#[test]
fn io_on_a_block_device_tuttid_holds_is_status_2_naming_the_holder() {
    // Goal: on an emu: block device tuttid holds both its flock and an exclusive (O_EXCL) claim.
    // `io` takes the lock before the claim, as tuttid and tutti-bench do, so it is refused
    // naming the holder (status 2), not with the anonymous "the block device is in use"; the
    // disk is unchanged, and once released `io --overwrite` measures on it (its own lock and
    // claim do not exclude each other). Needs root and losetup (skipped, saying why, otherwise;
    // a failure instead with TUTTI_REQUIRE_LOOP=1).
    let _one = exclusive();
    let dir = scratch("io-held-block");
    let image = dir.join("disk.img");
    std::fs::write(&image, vec![7u8; 8 << 20]).unwrap();
    let Some(disk) = LoopDevice::attach(&image) else { return };
    let spec = tutti_devices::DeviceSpec::EmuFile(PathBuf::from(&disk.node));
    let lock_dir = dir.join("locks");
    // As tuttid holds it (crates/daemon/src/lock.rs): the lock, then the claim.
    let locks = tutti_devices::DeviceLocks::acquire(std::slice::from_ref(&spec), &lock_dir, false).unwrap();
    let claims = tutti_devices::BlockDeviceClaims::acquire(std::slice::from_ref(&spec), &tutti_devices::HostBlockDevices).unwrap();
    let io = || {
        run(bin().arg("io").arg(format!("--device=emu:{}", disk.node)).arg("--overwrite").arg("--lock-dir").arg(&lock_dir).args(TINY_GRID))
    };
    let output = io();
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("is in use by another process") && text.contains("is held by"), "{text}");
    if !text.contains(&format!("held by pid {} (", std::process::id())) {
        // /proc/locks may hide the holder (another mount namespace): the text is what is checked.
        eprintln!("note: the holder was not named here: {text}");
    }
    assert!(std::fs::read(&image).unwrap().iter().all(|&b| b == 7), "a refused run wrote to the disk");
    drop(claims);
    drop(locks);
    let output = io();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
}

#[test]
fn bad_tables_and_arguments_fail_cleanly() {
    let _one = exclusive();
    let dir = scratch("bad");
    let table = dir.join("bad.json");
    std::fs::write(&table, r#"{"format_version": 7, "anything": true}"#).unwrap();
    let output = run(bin().arg("check").arg(&table));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("format_version 7"), "{}", stderr(&output));
    assert!(!stderr(&output).contains("panicked"));

    std::fs::write(&table, "not json").unwrap();
    let output = run(bin().arg("check").arg(&table));
    assert!(!output.status.success() && !stderr(&output).contains("panicked"));

    let output = run(bin().args(["simulate", "--preset", "llama3-70b-b200-1m"]));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("unknown preset"), "{}", stderr(&output));

    let output = run(bin().args(["analytic", "--model", "gpt-9", "--out"]).arg(dir.join("x.json")));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("unknown model 'gpt-9'"), "{}", stderr(&output));

    let output = run(bin().args(["analytic", "--io-sms", "500", "--out"]).arg(dir.join("y.json")));
    assert!(!output.status.success() && stderr(&output).contains("io_sms"), "{}", stderr(&output));

    let output = run(bin().args(["simulate", "--prefix-sweep-hit-rate", "1.5", "--out"]).arg(dir.join("z")));
    assert!(!output.status.success() && stderr(&output).contains("hit_rate"), "{}", stderr(&output));
}

#[test]
fn import_builds_a_table_from_a_timeline() {
    let _one = exclusive();
    let dir = scratch("import");
    let timeline = dir.join("timeline.csv");
    let mut csv = String::from("phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used\n");
    for (input, prefix) in [(4096, 0), (4096, 4096)] {
        for layer in 0..32 {
            let t = f64::from(layer) * 1000.0;
            csv.push_str(&format!("prefill,{input},{prefix},{layer},qkv,{t},{},128\n", t + 100.0));
            csv.push_str(&format!("prefill,{input},{prefix},{layer},attn,{},{},120\n", t + 100.0, t + 900.0));
        }
    }
    csv.push_str("decode,4096,,,step,0,3000,60\n");
    std::fs::write(&timeline, csv).unwrap();
    let table = dir.join("imported.json");
    let output =
        run(bin().arg("import").arg("--timeline").arg(&timeline).args(["--model", "llama3-8b", "--gpu", "h100", "--out"]).arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(bin().arg("check").arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("imported-timeline"));

    // Valid JSON of the wrong shape as --io-costs: the row and the expected shape are named
    // (it said "not valid JSON at ... line 0 column 0").
    let rows = dir.join("rows.json");
    std::fs::write(&rows, r#"[{"kind": "read", "iocb_count": 1, "sm_budget": 1, "duration_us": 5.0, "bytes": 4096}, {"kind": "read"}]"#)
        .unwrap();
    let arguments = ["import", "--timeline", timeline.to_str().unwrap(), "--io-costs", rows.to_str().unwrap()];
    let (code, text) = status(&[&arguments[..], &["--out", dir.join("rows-table.json").to_str().unwrap()]].concat());
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("row 1 of the array is not an io_costs row") && text.contains("\"iocb_count\": N"), "{text}");
    assert!(!text.contains("not valid JSON") && !text.contains("line 0"), "{text}");

    // A GPU spec file is input too: one claiming 4e9 SMs is refused on load (status 2), not
    // used to sum SMs past a u32.
    let spec = dir.join("huge-gpu.json");
    std::fs::write(
        &spec,
        r#"{"name": "huge", "sm_count": 4000000000, "dense_flops_per_s": 1e15, "hbm_bytes_per_s": 3e12,
            "gemm_efficiency": 0.7, "attention_efficiency": 0.5, "memory_efficiency": 0.8, "kernel_overhead_us": 5.0}"#,
    )
    .unwrap();
    let arguments = ["import", "--timeline", timeline.to_str().unwrap(), "--model", "llama3-8b", "--gpu-spec", spec.to_str().unwrap()];
    let (code, text) = status(&[&arguments[..], &["--out", dir.join("huge.json").to_str().unwrap()]].concat());
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("gpu.sm_count"), "{text}");
}

/// Goal: a timeline measured with every kernel on the whole GPU (what `slack-profile.py` and the
/// `--timing events` fallback write: min(grid, SMs) or all SMs) imports into a table the
/// slack-aware runtime accepts: import reserves `--io-sms` for I/O, as the analytic model runs
/// compute on sm_count − io_sms SMs, so every decode step and every layer keeps them free.
/// Before, such a table had 0 free SMs everywhere, `check` called it valid, and
/// `Runtime::new(slack-aware)` refused it.
#[test]
fn import_reserves_the_io_sms_of_a_timeline_measured_on_every_sm() {
    let _one = exclusive();
    let dir = scratch("import-io-sms");
    let timeline = dir.join("timeline.csv");
    let mut csv = String::from("phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used\n");
    for (input, prefix) in [(4096, 0), (4096, 4096)] {
        for layer in 0..32 {
            let t = f64::from(layer) * 1000.0;
            csv.push_str(&format!("prefill,{input},{prefix},{layer},qkv,{t},{},132\n", t + 100.0));
            csv.push_str(&format!("prefill,{input},{prefix},{layer},attn,{},{},132\n", t + 100.0, t + 1000.0));
        }
    }
    csv.push_str("decode,4096,,,step,0,3000,132\ndecode,8192,,,step,0,3500,132\n");
    std::fs::write(&timeline, csv).unwrap();
    let table = dir.join("imported.json");
    let arguments = ["import", "--timeline", timeline.to_str().unwrap(), "--io-sms", "4", "--out", table.to_str().unwrap()];
    let (code, text) = status(&arguments);
    assert_eq!(code, Some(0), "{text}");
    let value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&table).unwrap()).unwrap();
    for step in value["decode_steps"].as_array().unwrap() {
        assert!(step["free_sms"].as_u64().unwrap() >= 4, "{step}");
    }
    for bucket in value["buckets"].as_array().unwrap() {
        for layer in bucket["layers"].as_array().unwrap() {
            let windows = layer["slack_windows"].as_array().unwrap();
            assert!(windows.iter().any(|window| window["free_sms"].as_u64().unwrap() >= 4), "{layer}");
        }
    }
    let (code, text) = status(&["check", table.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");

    // `check` refuses (status 1) a table the slack-aware runtime would refuse: no decode step
    // leaves the write budget free.
    let mut starved = value.clone();
    for step in starved["decode_steps"].as_array_mut().unwrap() {
        step["free_sms"] = serde_json::json!(0);
    }
    let starved_path = dir.join("starved.json");
    std::fs::write(&starved_path, serde_json::to_string(&starved).unwrap()).unwrap();
    let (code, text) = status(&["check", starved_path.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("slack-aware") && text.contains("smallest write budget (4 SMs)"), "{text}");
}

/// Goal: a grid too large to hold is refused at once with status 2, naming the flags: this one
/// (49.6M bucket × layer entries) was accepted under the old cap and ran out of memory.
#[test]
fn an_analytic_grid_too_large_to_hold_is_status_2() {
    let _one = exclusive();
    let dir = scratch("huge-grid");
    let out = dir.join("x.json");
    let arguments = ["analytic", "--input-step", "64", "--input-count", "1760", "--prefix-step", "64", "--out", out.to_str().unwrap()];
    let (code, text) = status(&arguments);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("--prefix-step") && text.contains("--input-count") && text.contains("--input-step"), "{text}");
    assert!(!out.exists());
}

/// Goal: a timeline import cannot use is unusable input (status 2), however the table built
/// from it fails: a bucket missing, an input off the grid import inferred (said in those terms),
/// no decode step where a write fits. They were status 1, and an input off the grid was "not on
/// the grid declared by input_step_tokens/…", which the timeline never declared.
#[test]
fn import_of_an_unusable_timeline_is_status_2() {
    let _one = exclusive();
    let dir = scratch("import-status");
    let write = |name: &str, buckets: &[(u32, u32)], decode_sms: u32| {
        let mut csv = String::from("phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used\n");
        for (input, prefix) in buckets {
            for layer in 0..32 {
                let t = f64::from(layer) * 1000.0;
                csv.push_str(&format!("prefill,{input},{prefix},{layer},qkv,{t},{},100\n", t + 100.0));
                csv.push_str(&format!("prefill,{input},{prefix},{layer},attn,{},{},100\n", t + 100.0, t + 900.0));
            }
        }
        csv.push_str(&format!("decode,4096,,,step,0,3000,{decode_sms}\n"));
        let path = dir.join(name);
        std::fs::write(&path, csv).unwrap();
        path
    };
    let import = |timeline: &Path, extra: &[&str]| {
        let out = dir.join("out.json");
        let arguments = [&["import", "--timeline", timeline.to_str().unwrap(), "--out", out.to_str().unwrap()][..], extra].concat();
        status(&arguments)
    };
    // (8192, 4096) missing.
    let missing = write("missing.csv", &[(4096, 0), (4096, 4096), (8192, 0), (8192, 8192)], 100);
    let (code, text) = import(&missing, &[]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("missing bucket input_tokens=8192 prefix_tokens=4096") && text.contains("inferred"), "{text}");
    // 6144 is no multiple of the smallest input.
    let off_grid = write("off-grid.csv", &[(4096, 0), (4096, 4096), (6144, 0), (6144, 4096)], 100);
    let (code, text) = import(&off_grid, &[]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("multiple of the smallest, 4096") && !text.contains("declared"), "{text}");
    // A reservation of 1 SM leaves the decode step (132 SMs busy) 1 free SM, below the write
    // rows' budget of 4.
    let full = write("full.csv", &[(4096, 0), (4096, 4096)], 132);
    let costs = dir.join("costs.json");
    let (code, text) = status(&["analytic", "--input-count", "1", "--out", costs.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    let (code, text) = import(&full, &["--io-sms", "1", "--io-costs", costs.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("smallest write budget (4 SMs)"), "{text}");
}

/// Goal: `--io-sms 0` is refused as such (status 2, naming the flag): it made analytic I/O cost
/// rows of 0 SMs, and the run failed with "io_costs.duration_us … inf is not a finite number"
/// (status 1).
#[test]
fn io_sms_of_zero_is_refused_naming_the_flag() {
    let _one = exclusive();
    let dir = scratch("io-sms-0");
    let timeline = dir.join("t.csv");
    std::fs::write(&timeline, "phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used\nprefill,64,0,0,attn,0,10,1\n")
        .unwrap();
    for command in ["analytic", "import"] {
        let mut arguments = vec![command, "--io-sms", "0", "--out"];
        let out = dir.join(format!("{command}.json"));
        arguments.push(out.to_str().unwrap());
        if command == "import" {
            arguments.extend(["--timeline", timeline.to_str().unwrap()]);
        }
        let (code, text) = status(&arguments);
        assert_eq!(code, Some(2), "{command}: {text}");
        assert!(text.contains("--io-sms") && !text.contains("not a finite number"), "{command}: {text}");
    }
}

/// Exit status and standard error of `arguments`, asserting no panic.
fn status(arguments: &[&str]) -> (Option<i32>, String) {
    let output = run(bin().args(arguments));
    let text = stderr(&output);
    assert!(!text.contains("panicked"), "{arguments:?}: {text}");
    (output.status.code(), text)
}

#[test]
fn exit_statuses_are_0_1_2_and_documented() {
    // Goal (issue 17 item 9): 0 done, 1 failure or damage found (check), 2 unusable input.
    let _one = exclusive();
    let dir = scratch("status");
    let table = dir.join("t.json");
    let (code, text) = status(&["analytic", "--input-count", "2", "--out", table.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    assert_eq!(status(&["check", table.to_str().unwrap()]).0, Some(0));
    std::fs::write(dir.join("bad.json"), r#"{"format_version": 1, "anything": true}"#).unwrap();
    assert_eq!(status(&["check", dir.join("bad.json").to_str().unwrap()]).0, Some(1), "an invalid table is what check finds");
    assert_eq!(status(&["check", dir.join("absent.json").to_str().unwrap()]).0, Some(2));
    assert_eq!(status(&["simulate", "--table", dir.join("bad.json").to_str().unwrap()]).0, Some(2), "an invalid input table");
    assert_eq!(status(&["analytic", "--model", "gpt-9", "--out", "x.json"]).0, Some(2));
    assert_eq!(status(&["analytic", "--io-sms", "500", "--out", dir.join("y.json").to_str().unwrap()]).0, Some(2));
    assert_eq!(status(&["simulate", "--preset", "nope"]).0, Some(2));
    assert_eq!(status(&["--frobnicate"]).0, Some(2));
    let help = run(bin().arg("--help"));
    assert!(String::from_utf8_lossy(&help.stdout).contains("Exit status: 0 done; 1 the run failed, or damage was found; 2 unusable input"));
}

#[test]
fn an_iocb_grid_past_2_pow_64_bytes_is_status_2() {
    // Goal: --iocb-bytes × --iocb-count-max past 2^64 used to overflow a multiplication in the
    // SSD model (a panic, status 101, in a debug build); it is unusable input, named.
    let _one = exclusive();
    let dir = scratch("iocb-overflow");
    let out = dir.join("t.json");
    let (code, text) = status(&["analytic", "--iocb-bytes", "18446744073709551615", "--input-count", "2", "--out", out.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("io cost grid") && text.contains("2^64") && !text.contains("panicked"), "{text}");
    assert!(!out.exists());
}

#[test]
fn io_flags_the_device_cannot_take_are_status_2() {
    // Goal: an --ioctx-bytes that is not whole blocks of the device, or larger than its
    // namespace, is a bad flag (2, naming what is accepted), not a failed measurement (1).
    let _one = exclusive();
    let dir = scratch("io-flags");
    let out = dir.join("io.json");
    for (device, ioctx_bytes, needle) in [("emu:mem:64m", "1000", "--ioctx-bytes 1000"), ("emu:mem:1m", "2M", "smaller than one IOCTX")] {
        let grid = ["--iocb-counts", "1", "--ioctxs-per-iocb", "1", "--repetitions", "1", "--ioctx-bytes", ioctx_bytes];
        let (code, text) = status(&[&["io", "--device", device][..], &grid[..], &["--out", out.to_str().unwrap()]].concat());
        assert_eq!(code, Some(2), "{device} {ioctx_bytes}: {text}");
        assert!(text.contains(needle), "{device} {ioctx_bytes}: {text}");
    }
    assert!(!out.exists());
}

#[test]
fn simulate_decode_steps_and_io_repetitions_are_bounded_at_parse() {
    // Goal: --decode-steps 4000000000 ran until the simulator's event budget ran out and was
    // reported as an invalid policy decision (1); --repetitions had no upper bound. Both are
    // refused at parse (2) with the range accepted.
    let _one = exclusive();
    let dir = scratch("bounds");
    let (code, text) = status(&["simulate", "--decode-steps", "4000000000", "--out", dir.join("sim").to_str().unwrap()]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("--decode-steps") && text.contains("0..=100000"), "{text}");
    for repetitions in ["0", "1001"] {
        let (code, text) =
            status(&["io", "--device", "emu:mem:16m", "--repetitions", repetitions, "--out", dir.join("io.json").to_str().unwrap()]);
        assert_eq!(code, Some(2), "{repetitions}: {text}");
        assert!(text.contains("--repetitions") && text.contains("1..=1000"), "{repetitions}: {text}");
    }
    assert!(!dir.join("io.json").exists());
}

#[test]
fn a_nan_in_a_table_is_named_in_words() {
    // Goal (issue 17 item 9): a NaN in a table used to get only serde's "expected value at line
    // 1 column N"; now the field, the position and why it cannot be read.
    let _one = exclusive();
    let dir = scratch("nan");
    let table = dir.join("t.json");
    assert_eq!(status(&["analytic", "--input-count", "2", "--out", table.to_str().unwrap()]).0, Some(0));
    let text = std::fs::read_to_string(&table).unwrap();
    let at = text.find("\"duration_us\":").expect("an io cost row") + "\"duration_us\":".len();
    let end = at + text[at..].find([',', '}']).unwrap();
    let nan = dir.join("nan.json");
    std::fs::write(&nan, format!("{}NaN{}", &text[..at], &text[end..])).unwrap();
    let (code, message) = status(&["check", nan.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{message}");
    assert!(message.contains("field `duration_us` at line 1 column"), "{message}");
    assert!(message.contains("holds `NaN`, which is not a number JSON can hold"), "{message}");
    let (code, message) = status(&["simulate", "--table", nan.to_str().unwrap(), "--out", dir.join("sim").to_str().unwrap()]);
    assert_eq!(code, Some(2), "{message}");
    assert!(message.contains("`NaN`"), "{message}");
}

#[test]
fn memory_devices_larger_than_the_machine_are_refused_with_status_2() {
    // Goal (issue 17 item 9): `io --device emu:mem:1T` used to abort (exit 134).
    let _one = exclusive();
    let (code, message) = status(&["io", "--device", "emu:mem:1T"]);
    assert_eq!(code, Some(2), "{message}");
    assert!(message.contains("1TiB of memory asked") && message.contains("use emu:PATH"), "{message}");
}

#[test]
fn a_closed_standard_output_is_status_141() {
    // Goal (issue 17 item 9): `tutti-profile ... | head -c1` used to panic (exit 101).
    let _one = exclusive();
    let dir = scratch("epipe");
    // The pipe's read end is closed before the program starts: its first write fails, always.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let output = bin().args(["simulate", "--preset", "llama3-8b-h100-32k", "--out"]).arg(&dir).stdout(writer).output().unwrap();
    assert_eq!(output.status.code(), Some(141), "{}", stderr(&output));
    assert!(!stderr(&output).contains("panicked"), "{}", stderr(&output));
}

#[test]
fn any_model_geometry_reaches_the_tables() {
    // Goal (issue 17 item 9): a config.json or geometry flags instead of the two presets; the
    // I/O grid's IOCTX is one KV object of the model unless --ioctx-bytes says otherwise.
    let _one = exclusive();
    let dir = scratch("geometry");
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        r#"{"_name_or_path": "my-model", "num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
            "num_key_value_heads": 4, "intermediate_size": 8192, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    let table = dir.join("t.json");
    let (code, text) =
        status(&["analytic", "--model-config", config.to_str().unwrap(), "--input-count", "2", "--out", table.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    let profile = scheduler::table::Profile::from_json(&std::fs::read_to_string(&table).unwrap()).unwrap();
    assert_eq!((profile.model().name.as_str(), profile.layer_count()), ("my-model", 24));
    let (code, text) = status(&["analytic", "--layers", "40", "--input-count", "2", "--out", table.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    let profile = scheduler::table::Profile::from_json(&std::fs::read_to_string(&table).unwrap()).unwrap();
    assert_eq!((profile.model().name.as_str(), profile.layer_count()), ("custom", 40));
    assert_eq!(status(&["analytic", "--head-dim", "0", "--out", table.to_str().unwrap()]).0, Some(2));
    // 8 tokens x 8 KV heads x 128 x 2 bytes = 16 KiB per IOCTX.
    let output = run(bin().args(["io", "--device", "emu:mem:16M", "--tokens-per-block", "8"]).args([
        "--iocb-counts",
        "1",
        "--sm-budgets",
        "1",
        "--ioctxs-per-iocb",
        "4",
        "--repetitions",
        "1",
    ]));
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stderr(&output).contains("IOCB = 4 IOCTXs x 16384 bytes"), "{}", stderr(&output));
}

/// A base table in `dir` (base.json) whose decode steps leave 1 SM free (its own write rows run
/// on 1: valid): its path.
fn starved_base(dir: &std::path::Path) -> std::path::PathBuf {
    let analytic = dir.join("analytic.json");
    let (code, text) = status(&["analytic", "--input-count", "1", "--io-sms", "1", "--out", analytic.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    let mut table = scheduler::table::Profile::from_json(&std::fs::read_to_string(&analytic).unwrap()).unwrap().table().clone();
    for step in &mut table.decode_steps {
        step.free_sms = 1;
    }
    let base = dir.join("base.json");
    std::fs::write(&base, scheduler::table::Profile::from_table(table).unwrap().to_json().unwrap()).unwrap();
    base
}

/// Goal: `io` never writes a table `check` (and the slack-aware runtime) would refuse: write rows
/// measured on more SMs than the base table's decode steps leave free are refused with status 2
/// and nothing written. Before, the table was written (status 0) and `check` called it invalid.
/// `--io-sms 0` is refused naming the flag, as for `analytic` and `import`.
#[test]
fn io_refuses_to_write_a_table_check_would_refuse() {
    let _one = exclusive();
    let dir = scratch("io-starved");
    let base = starved_base(&dir);
    assert_eq!(status(&["check", base.to_str().unwrap()]).0, Some(0));
    let out = dir.join("io.json");
    let grid = ["--iocb-counts", "1,2", "--sm-budgets", "2", "--ioctxs-per-iocb", "4", "--ioctx-bytes", "4K", "--repetitions", "1"];
    let measure =
        [&["io", "--device", "emu:mem:16M", "--base", base.to_str().unwrap(), "--out", out.to_str().unwrap()][..], &grid[..]].concat();
    let (code, text) = status(&measure);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("smallest write budget"), "{text}");
    assert!(!out.exists(), "nothing written");
    let (code, text) =
        status(&[&["io", "--device", "emu:mem:16M", "--io-sms", "0", "--out", out.to_str().unwrap()][..], &grid[..]].concat());
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("--io-sms"), "{text}");
}

/// Goal: the refusal above comes before the device is opened: the base's decode steps and the
/// smallest --sm-budgets are known before anything is measured, so a device file is neither
/// created nor written (nor its LBAs overwritten for the whole measurement, only to be refused
/// after). Before, `io` measured first (laying out and writing the span) and refused after.
#[test]
fn io_refuses_a_starved_base_before_touching_the_device() {
    let _one = exclusive();
    let dir = scratch("io-starved-early");
    let base = starved_base(&dir);
    let lock_dir = dir.join("locks");
    std::fs::create_dir_all(&lock_dir).unwrap();
    let grid = ["--iocb-counts", "1,2", "--sm-budgets", "2,4", "--ioctxs-per-iocb", "4", "--ioctx-bytes", "4K", "--repetitions", "1"];
    // A device file holding data, --overwrite given: left as it was.
    let held = dir.join("held.img");
    std::fs::write(&held, vec![7u8; 4 << 20]).unwrap();
    // A device file that does not exist: not created.
    let absent = dir.join("absent.img");
    for (file, extra) in [(&held, &["--overwrite"][..]), (&absent, &[][..])] {
        let device = format!("--device=emu:{}", file.display());
        let lock = format!("--lock-dir={}", lock_dir.display());
        let out = dir.join("io.json");
        let measure =
            [&["io", &device, &lock, "--base", base.to_str().unwrap(), "--out", out.to_str().unwrap()][..], extra, &grid[..]].concat();
        let (code, text) = status(&measure);
        assert_eq!(code, Some(2), "{text}");
        assert!(text.contains("smallest write budget"), "{text}");
        assert!(!text.contains("io: measuring"), "refused only after measuring: {text}");
        assert!(!out.exists(), "nothing written");
    }
    assert!(std::fs::read(&held).unwrap().iter().all(|&b| b == 7), "a refused run wrote to the device file");
    assert!(!absent.exists(), "a refused run created the device file");
}
