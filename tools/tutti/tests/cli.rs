//! `tutti` as a user runs it: pool format/inspect/check on a file-backed software controller,
//! the exit statuses (0 clean, 1 damage found, 2 unusable input, 141 standard output closed),
//! messages in words for truncated and foreign files, and any model geometry for `pool format`.

use std::path::Path;
use std::process::{Command, Output, Stdio};

fn tutti(arguments: &[&str]) -> Output {
    tutti_logging(arguments, None)
}

/// Runs tutti with `TUTTI_LOG` set to `filter`, or removed (the default filter, whatever the
/// caller's environment holds: these tests read standard error).
fn tutti_logging(arguments: &[&str], filter: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tutti"));
    match filter {
        Some(filter) => command.env("TUTTI_LOG", filter),
        None => command.env_remove("TUTTI_LOG"),
    };
    command.args(arguments).output().expect("the built binary runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Asserts the exit status and that standard error contains every needle and no Rust dump.
fn assert_status(output: &Output, status: i32, needles: &[&str]) {
    let text = stderr(output);
    assert_eq!(output.status.code(), Some(status), "stderr: {text}\nstdout: {}", stdout(output));
    for needle in needles {
        assert!(text.contains(needle), "'{needle}' missing from: {text}");
    }
    for dump in ["Superblock {", "ModelGeometry {", "panicked", "Stack backtrace"] {
        assert!(!text.contains(dump), "'{dump}' in: {text}");
    }
}

fn device(path: &Path) -> String {
    format!("emu:{}", path.display())
}

fn format(path: &Path, extra: &[&str]) -> Output {
    let device = device(path);
    let mut arguments = vec!["pool", "format", "--device", &device, "--emu-create-bytes", "64m"];
    arguments.extend_from_slice(extra);
    tutti(&arguments)
}

#[test]
fn format_inspect_check_then_damage_is_status_1() {
    // Goal: the three subcommands run end to end; check and inspect are 0 on a clean pool and 1
    // once the slot headers or the superblock are damaged, with the reason in words; neither
    // takes the option that grows a file.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("pool.img");
    let output = format(&path, &["--model", "llama3-8b", "--payload-crc"]);
    assert_status(&output, 0, &[]);
    assert!(stdout(&output).contains("31 slots") && stdout(&output).contains("payload CRC on"), "{}", stdout(&output));
    assert!(stdout(&output).contains("of SGL descriptors"), "the mapping table's memory is reported: {}", stdout(&output));
    let device = device(&path);
    assert_status(&tutti(&["pool", "inspect", "--device", &device]), 0, &[]);
    // Reading a pool never changes its files: the option that grows them is format's only.
    for command in ["inspect", "check"] {
        assert_status(&tutti(&["pool", command, "--device", &device, "--emu-create-bytes", "128m"]), 2, &["--emu-create-bytes"]);
    }
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 64 << 20);
    let output = tutti(&["pool", "check", "--device", &device, "--payload"]);
    assert_status(&output, 0, &[]);
    assert!(stdout(&output).contains("31 slots checked: 0 valid, 31 empty, 0 corrupt headers"), "{}", stdout(&output));
    // Zero the slot-header region (byte 4096 on, one 4 KiB LBA here): check reports damage (every
    // empty slot carries a tagged, checksummed entry), not an empty pool.
    let mut bytes = std::fs::read(&path).unwrap();
    let pristine = bytes.clone();
    bytes[4096..8192].fill(0);
    std::fs::write(&path, &bytes).unwrap();
    let output = tutti(&["pool", "check", "--device", &device]);
    assert_status(&output, 1, &[]);
    assert!(stdout(&output).contains("31 all zeroes") && stdout(&output).contains("zeroed or deallocated"), "{}", stdout(&output));
    // inspect reports the same damage with the same status.
    let output = tutti(&["pool", "inspect", "--device", &device]);
    assert_status(&output, 1, &["damaged"]);
    assert!(stdout(&output).contains("31 corrupt headers"), "{}", stdout(&output));
    std::fs::write(&path, &pristine).unwrap();
    assert_status(&tutti(&["pool", "check", "--device", &device]), 0, &[]);
    let mut bytes = pristine;
    bytes[100] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    assert_status(&tutti(&["pool", "check", "--device", &device]), 1, &["superblock", "CRC32"]);
    assert_status(&tutti(&["pool", "inspect", "--device", &device]), 1, &["superblock", "CRC32"]);
}

#[test]
fn the_libraries_warnings_reach_standard_error_filtered_by_tutti_log() {
    // Goal: the libraries' tracing events are printed on standard error; before the tools
    // installed a subscriber they were all discarded. Here objstore's warning on opening a pool
    // whose slot headers are all zeroes: shown by default (warn), shown at TUTTI_LOG=info, gone
    // at TUTTI_LOG=off, and an invalid TUTTI_LOG says so in one line and keeps the default.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("pool.img");
    assert_status(&format(&path, &["--model", "llama3-8b"]), 0, &[]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[4096..8192].fill(0);
    std::fs::write(&path, &bytes).unwrap();
    let device = device(&path);
    let inspect = ["pool", "inspect", "--device", &device];
    let warning = "slot headers are all zeroes";

    let output = tutti_logging(&inspect, None);
    assert_status(&output, 1, &["WARN", warning, "damaged"]);
    assert!(!stdout(&output).contains(warning), "an event on standard output: {}", stdout(&output));
    assert_status(&tutti_logging(&inspect, Some("info")), 1, &["WARN", warning]);
    let silenced = tutti_logging(&inspect, Some("off"));
    assert_status(&silenced, 1, &["damaged"]);
    assert!(!stderr(&silenced).contains(warning), "TUTTI_LOG=off: {}", stderr(&silenced));

    let output = tutti_logging(&inspect, Some("objstore=loud"));
    assert_status(&output, 1, &["WARN", warning]);
    let text = stderr(&output);
    let complaints: Vec<&str> = text.lines().filter(|line| line.contains("TUTTI_LOG")).collect();
    assert_eq!(complaints.len(), 1, "{text}");
    assert!(complaints[0].contains("objstore=loud") && complaints[0].contains("default"), "{}", complaints[0]);
}

#[test]
fn truncated_and_foreign_files_are_described_in_words() {
    // Goal (issue 17 item 9): a truncated pool file used to print the superblock as a Rust
    // Debug dump, an empty one "needs 0 bytes but 0 of the 0-byte backing store remain".
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("pool.img");
    assert_status(&format(&path, &["--model", "llama3-8b"]), 0, &[]);
    let pool_device = device(&path);
    let device = pool_device.as_str();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(32 << 20).unwrap();
    let output = tutti(&["pool", "check", "--device", device]);
    assert_status(&output, 1, &["slot count 31 recorded, 15 fit", "smaller than when the pool was formatted", "truncated"]);
    assert_status(&tutti(&["pool", "inspect", "--device", device]), 1, &["truncated"]);
    assert!(!stdout(&tutti(&["pool", "inspect", "--device", device])).contains("Superblock {"));

    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(0).unwrap();
    assert_status(&tutti(&["pool", "check", "--device", device]), 2, &["the file is empty (0 bytes)"]);

    // A device that holds no pool is a fact about the device (a destroyed superblock looks the
    // same as a never-formatted one), not a usage error: 1, as README.md's exit-status table says.
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    assert_status(&tutti(&["pool", "check", "--device", device]), 1, &["not a tutti pool, or never formatted"]);

    let missing = format!("emu:{}", directory.path().join("absent.img").display());
    assert_status(&tutti(&["pool", "inspect", "--device", &missing]), 2, &["absent.img: no such file"]);
}

#[test]
fn unusable_input_is_status_2_and_writes_nothing() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("pool.img");
    assert_status(&format(&path, &[]), 2, &["no model given", "--model-config"]);
    assert!(!path.exists(), "a refused format created {}", path.display());
    assert_status(&format(&path, &["--model", "gpt-5"]), 2, &["unknown model 'gpt-5'", "llama3-8b"]);
    assert_status(&format(&path, &["--model", "llama3-8b", "--head-dim", "0"]), 2, &["--head-dim=0"]);
    assert_status(&tutti(&["pool", "check", "--device", "emu:mem:64m"]), 2, &["cannot be used here", "vfio:BDF", "emu:PATH"]);
    assert_status(&tutti(&["pool", "check", "--device", "nvme:/dev/x"]), 2, &["unknown type 'nvme'"]);
    assert_status(&tutti(&["pool", "check", "--device", "vfio:banana"]), 2, &["not a PCI address"]);
    let small = device(&directory.path().join("small.img"));
    assert_status(
        &tutti(&["pool", "format", "--device", &small, "--emu-create-bytes", "1m", "--model", "llama3-8b"]),
        2,
        &["too small", "the format needs"],
    );
    assert_status(&tutti(&["bind", "banana"]), 2, &["'banana' is not a PCI address"]);
    assert_status(&tutti(&["frobnicate"]), 2, &[]);
    // Zero slots and namespace 0 (no NVMe namespace has id 0) are refused at parse, before a file
    // is created: --slots 0 was called a namespace too small for the format, nsid 0 a device
    // failure (status 1).
    let zero = directory.path().join("zero.img");
    assert_status(&format(&zero, &["--model", "llama3-8b", "--slots", "0"]), 2, &["--slots"]);
    assert_status(&format(&zero, &["--model", "llama3-8b", "--namespace", "0"]), 2, &["--namespace"]);
    assert_status(&format(&zero, &["--model", "llama3-8b", "--blocks-per-slot", "0"]), 2, &["--blocks-per-slot"]);
    assert_status(&tutti(&["pool", "check", "--device", &device(&path), "--namespace", "0"]), 2, &["--namespace"]);
    assert!(!zero.exists(), "a refused format created {}", zero.display());
}

#[test]
fn a_refused_format_leaves_the_emu_file_as_it_was() {
    // Goal: exit status 2 means nothing was changed, --emu-create-bytes included. A namespace too
    // small for the model was refused after the file had been created (or grown) to the size
    // asked for; the refusal now comes first.
    let directory = tempfile::tempdir().unwrap();
    let absent = directory.path().join("absent.img");
    assert_status(
        &tutti(&["pool", "format", "--device", &device(&absent), "--emu-create-bytes", "1m", "--model", "llama3-8b"]),
        2,
        &["too small", "the format needs"],
    );
    assert!(!absent.exists(), "a refused format created {}", absent.display());
    // The software controller on a file has namespace 1 only: another was refused as a device
    // failure (status 1) after the file had been created.
    assert_status(
        &tutti(&["pool", "format", "--device", &device(&absent), "--emu-create-bytes", "64m", "--model", "llama3-8b", "--namespace", "2"]),
        2,
        &["--namespace 2", "one namespace, nsid 1"],
    );
    assert!(!absent.exists(), "a refused format created {}", absent.display());
    // An LBA size the model's objects are not a whole number of is refused the same way.
    let layers = ["--layers", "1", "--kv-heads", "1", "--head-dim", "64", "--tokens-per-block", "1"];
    let mut arguments = vec!["pool", "format", "--emu-lba-bytes", "65536"];
    arguments.extend_from_slice(&layers);
    let absent_device = device(&absent);
    arguments.extend_from_slice(&["--device", &absent_device, "--emu-create-bytes", "64m"]);
    assert_status(&tutti(&arguments), 2, &["whole number"]);
    assert!(!absent.exists(), "a refused format created {}", absent.display());
    // An existing file smaller than asked is not grown by a format that is refused.
    let small = directory.path().join("small.img");
    std::fs::File::create(&small).unwrap().set_len(512 << 10).unwrap();
    assert_status(
        &tutti(&["pool", "format", "--device", &device(&small), "--emu-create-bytes", "1m", "--model", "llama3-8b"]),
        2,
        &["too small"],
    );
    assert_eq!(std::fs::metadata(&small).unwrap().len(), 512 << 10, "a refused format grew {}", small.display());
    // The size that counts is the larger of the file's and the one asked for: a file already
    // big enough formats although the size asked for alone would be too small.
    let big = directory.path().join("big.img");
    std::fs::File::create(&big).unwrap().set_len(64 << 20).unwrap();
    assert_status(&tutti(&["pool", "format", "--device", &device(&big), "--emu-create-bytes", "1m", "--model", "llama3-8b"]), 0, &[]);
    assert_eq!(std::fs::metadata(&big).unwrap().len(), 64 << 20);
}

/// The names and sizes of the files in `directory`, sorted.
fn listing(directory: &Path) -> Vec<(String, u64)> {
    let mut files: Vec<(String, u64)> = std::fs::read_dir(directory)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            (entry.file_name().to_string_lossy().into_owned(), entry.metadata().unwrap().len())
        })
        .collect();
    files.sort();
    files
}

#[test]
fn a_format_refused_after_files_were_made_leaves_none_behind() {
    // Goal: exit status 2 leaves the directory as it was, also for refusals that used to come
    // after the creating lock made the missing files empty or the software controller grew
    // them: a set mixing emu: and vfio: devices (0-byte file left), a character device among
    // the files (the other file left at its full size), a size no file can have (0-byte file).
    let directory = tempfile::tempdir().unwrap();
    let new = device(&directory.path().join("new.img"));
    let other = device(&directory.path().join("other.img"));
    let existing = directory.path().join("existing.img");
    std::fs::File::create(&existing).unwrap().set_len(512 << 10).unwrap();
    let existing = device(&existing);
    let before = listing(directory.path());
    let model = ["--model", "llama3-8b"];
    let runs: [(Vec<&str>, &[&str]); 3] = [
        (vec!["--device", &new, "--device", "vfio:0000:00:04.0", "--emu-create-bytes", "64m"], &["share one DMA space"]),
        (vec!["--device", &new, "--device", &existing, "--device", "emu:/dev/null", "--emu-create-bytes", "64m"], &["emu:/dev/null"]),
        (vec!["--device", &new, "--device", &other, "--emu-create-bytes", "9000000t", "--slots", "4"], &["backing store"]),
    ];
    for (devices, needles) in runs {
        let mut arguments = vec!["pool", "format"];
        arguments.extend_from_slice(&devices);
        arguments.extend_from_slice(&model);
        assert_status(&tutti(&arguments), 2, needles);
        assert_eq!(listing(directory.path()), before, "{arguments:?} left the directory changed");
    }
}

#[test]
fn a_pool_read_with_another_lba_size_is_unusable_input_not_damage() {
    // Goal: a pool formatted with --emu-lba-bytes 512 and checked without it (the default 4096)
    // was reported as a damaged superblock (status 1); it is the wrong option (status 2), and
    // the message says which LBA size to give.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("small-lba.img");
    assert_status(&format(&path, &["--model", "llama3-8b", "--emu-lba-bytes", "512"]), 0, &[]);
    for command in ["check", "inspect"] {
        assert_status(&tutti(&["pool", command, "--device", &device(&path)]), 2, &["512-byte LBAs", "--emu-lba-bytes 512"]);
    }
    assert_status(&tutti(&["pool", "check", "--device", &device(&path), "--emu-lba-bytes", "512"]), 0, &[]);
}

#[test]
fn pool_format_takes_any_geometry() {
    // Goal (issue 17 item 9): a geometry that is no preset, by flags or by a config.json.
    let directory = tempfile::tempdir().unwrap();
    let output = format(
        &directory.path().join("a.img"),
        &["--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "fp8", "--tokens-per-block", "32"],
    );
    assert_status(&output, 0, &[]);
    assert!(stdout(&output).contains("geometry: 4 layers x 2 KV heads x dim 64 x 1 B, 32 tokens/block"), "{}", stdout(&output));
    let config = directory.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"num_hidden_layers": 48, "num_attention_heads": 40, "hidden_size": 5120, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    let output = format(&directory.path().join("b.img"), &["--model-config", config.to_str().unwrap(), "--tokens-per-block", "32"]);
    assert_status(&output, 0, &[]);
    assert!(stdout(&output).contains("geometry: 48 layers x 8 KV heads x dim 128 x 2 B, 32 tokens/block"), "{}", stdout(&output));
}

#[test]
fn a_closed_standard_output_is_status_141_without_a_panic() {
    // Goal (issue 17 item 9): `tutti pool format ... | head -c1` used to panic (exit 101).
    let directory = tempfile::tempdir().unwrap();
    let device = device(&directory.path().join("pool.img"));
    // The pipe's read end is closed before the program starts: its first write fails, always.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let output = Command::new(env!("CARGO_BIN_EXE_tutti"))
        .args(["pool", "format", "--device", &device, "--emu-create-bytes", "64m", "--model", "llama3-8b"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_status(&output, 141, &[]);
    assert!(stderr(&output).is_empty(), "quietly: {}", stderr(&output));
}

#[test]
fn help_documents_the_exit_statuses() {
    let output = tutti(&["--help"]);
    assert_eq!(output.status.code(), Some(0));
    assert!(
        stdout(&output).contains("Exit status: 0 done; 1 the run failed, or damage was found; 2 unusable input"),
        "{}",
        stdout(&output)
    );
}

/// Holds an exclusive `flock` on `path` (as tuttid does on its pool file) until dropped.
struct FlockHolder {
    _file: std::fs::File,
}

impl FlockHolder {
    fn take(path: &Path) -> FlockHolder {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::open(path).unwrap();
        // SAFETY: flock on a descriptor this process owns for the call; no memory is passed.
        let result = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(result, 0, "flock: {}", std::io::Error::last_os_error());
        FlockHolder { _file: file }
    }
}

#[test]
fn a_pool_held_by_another_process_is_refused_naming_the_holder() {
    // Goal: tuttid flocks its pool file for its life; `tutti pool format|inspect|check` take the
    // same lock, so none of them runs under a live daemon (format would zero what the daemon
    // serves): status 2, naming the holder (this test's pid, found in /proc/locks), the file
    // unchanged. Once the lock is let go, all three run.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("pool.img");
    assert_status(&format(&path, &["--model", "llama3-8b"]), 0, &[]);
    let before = std::fs::read(&path).unwrap();
    let device = device(&path);
    let holder = FlockHolder::take(&path);
    let pid = std::process::id();
    let runs = [
        tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b"]),
        tutti(&["pool", "inspect", "--device", &device]),
        tutti(&["pool", "check", "--device", &device]),
    ];
    for output in &runs {
        assert_status(output, 2, &["is in use by another process", &path.display().to_string(), "is held by"]);
        // Named when /proc/locks lists our lock on the file's own device (see tutti-devices'
        // `lists_flock_exactly`, which a user of the binary cannot call: the text is checked).
        let text = stderr(output);
        if !text.contains(&format!("held by pid {pid} (")) {
            eprintln!("note: the holder was not named (/proc/locks hides it here): {text}");
        }
    }
    assert!(std::fs::read(&path).unwrap() == before, "a refused format wrote to the pool");
    drop(holder);
    assert_status(&tutti(&["pool", "check", "--device", &device]), 0, &[]);
    assert_status(&tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b"]), 0, &[]);
}

#[test]
fn a_file_holding_something_else_is_formatted_only_with_overwrite() {
    // Goal: `pool format` destroys what the device holds (LBA 0 first). An existing file whose
    // first bytes are neither a tutti pool nor blank is refused (status 2, saying what is there,
    // the file unchanged) unless --overwrite is given; a tutti pool is reformatted without it,
    // as before, and so is a blank (all-zero) file.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("data.img");
    let mut bytes: Vec<u8> = (0..(64u32 << 20)).map(|i| (i % 251) as u8).collect();
    bytes[510] = 0x55;
    bytes[511] = 0xAA;
    std::fs::write(&path, &bytes).unwrap();
    let device = device(&path);
    assert_status(
        &tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b"]),
        2,
        &["is not a tutti pool", "partition table", "--overwrite"],
    );
    assert!(std::fs::read(&path).unwrap() == bytes, "a refused format wrote to the file");
    let arbitrary = directory.path().join("arbitrary.img");
    bytes[510] = 1;
    std::fs::write(&arbitrary, &bytes).unwrap();
    let arbitrary = format!("emu:{}", arbitrary.display());
    assert_status(&tutti(&["pool", "format", "--device", &arbitrary, "--model", "llama3-8b"]), 2, &["non-zero bytes", "--overwrite"]);
    assert_status(&tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b", "--overwrite"]), 0, &[]);
    assert_status(&tutti(&["pool", "check", "--device", &device]), 0, &[]);
    // Now a tutti pool: reformatting needs no flag.
    assert_status(&tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b"]), 0, &[]);
}

/// Says why a loop-device test cannot run here and returns (the test passes as skipped), unless
/// `TUTTI_REQUIRE_LOOP=1` is in the environment (tools/test.sh's rust stage sets it when it has
/// just attached, formatted and mounted a loop device itself): then the skip fails the test, so
/// such a machine cannot make it vanish.
fn skip_without_loop(reason: &str) {
    if std::env::var_os("TUTTI_REQUIRE_LOOP").is_some_and(|value| value == "1") {
        panic!("TUTTI_REQUIRE_LOOP=1, but the loop-device test cannot run: {reason}");
    }
    eprintln!("SKIPPED (set TUTTI_REQUIRE_LOOP=1 to fail instead): {reason}");
}

/// A loop device over a file, detached (and its file system unmounted) when dropped.
struct LoopDevice {
    node: String,
    mount_point: Option<std::path::PathBuf>,
}

impl LoopDevice {
    /// `None` with the reason given to `skip_without_loop` where this host cannot make one (not
    /// root, no losetup, no free loop device).
    fn attach(image: &Path) -> Option<LoopDevice> {
        // SAFETY: geteuid has no preconditions and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            skip_without_loop("not root, so no loop device can be attached");
            return None;
        }
        let output = Command::new("losetup").args(["--find", "--show"]).arg(image).output();
        match output {
            Ok(output) if output.status.success() => {
                Some(LoopDevice { node: String::from_utf8_lossy(&output.stdout).trim().to_string(), mount_point: None })
            }
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

    fn unmount(&mut self) {
        if let Some(point) = self.mount_point.take() {
            let status = Command::new("umount").arg(&point).status().unwrap();
            assert!(status.success(), "umount {}", point.display());
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        if let Some(point) = self.mount_point.take() {
            let _ = Command::new("umount").arg(&point).status();
        }
        let _ = Command::new("losetup").arg("-d").arg(&self.node).status();
    }
}

#[test]
fn a_block_device_a_daemon_holds_is_refused_naming_its_holder() {
    // Goal: on an emu: block device tuttid holds both its flock and an exclusive (O_EXCL)
    // claim. `tutti pool format|inspect|check` take the lock before the claim, as tuttid and
    // tutti-bench do, so the refusal (status 2) names the holder instead of only saying the
    // block device is in use (the claim's refusal cannot name anyone). Needs root and losetup
    // (skipped, saying why, otherwise; a failure instead with TUTTI_REQUIRE_LOOP=1).
    use std::os::unix::fs::OpenOptionsExt;
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
    let Some(disk) = LoopDevice::attach(&image) else { return };
    let device = format!("emu:{}", disk.node);
    assert_status(&tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b", "--overwrite"]), 0, &[]);
    let before = std::fs::read(&image).unwrap();
    let held = {
        let _lock = FlockHolder::take(Path::new(&disk.node));
        let _claim = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_EXCL).open(&disk.node).unwrap();
        [
            tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b", "--overwrite"]),
            tutti(&["pool", "inspect", "--device", &device]),
            tutti(&["pool", "check", "--device", &device]),
        ]
    };
    for output in &held {
        assert_status(output, 2, &["is in use by another process", &disk.node, "is held by"]);
    }
    assert!(std::fs::read(&image).unwrap() == before, "a refused run wrote to the disk");
    assert_status(&tutti(&["pool", "check", "--device", &device]), 0, &[]);
}

#[test]
fn a_mounted_block_device_is_refused_as_in_use() {
    // Goal: `emu:` also takes a block device (docs/vllm.md's pool is emu:/dev/nvme0n1), and
    // kernel NVMe names can swap between boots: format on a mounted disk is refused as in use
    // (an exclusive open fails with EBUSY), even with --overwrite, before anything is written.
    // Unmounted, the ext4 file system there is named and needs --overwrite; then the pool works.
    // Needs root, losetup, mkfs.ext4 and mount (skipped, saying why, otherwise; a failure
    // instead with TUTTI_REQUIRE_LOOP=1).
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
    let Some(mut disk) = LoopDevice::attach(&image) else { return };
    match Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&disk.node).output() {
        Ok(output) if output.status.success() => {}
        other => {
            skip_without_loop(&format!("mkfs.ext4 {} failed: {other:?}", disk.node));
            return;
        }
    }
    let point = directory.path().join("mnt");
    std::fs::create_dir(&point).unwrap();
    match Command::new("mount").arg(&disk.node).arg(&point).output() {
        Ok(output) if output.status.success() => disk.mount_point = Some(point.clone()),
        other => {
            skip_without_loop(&format!("mount {} failed: {other:?}", disk.node));
            return;
        }
    }
    std::fs::write(point.join("keep.txt"), b"user data").unwrap();
    let before = std::fs::read(&image).unwrap()[..4096].to_vec();
    let device = format!("emu:{}", disk.node);
    assert_status(&tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b", "--overwrite"]), 2, &[&disk.node, "in use"]);
    assert_status(&tutti(&["pool", "check", "--device", &device]), 2, &["in use"]);
    assert!(std::fs::read(&image).unwrap()[..4096] == before[..], "a refused format wrote to the disk");
    assert_eq!(std::fs::read(point.join("keep.txt")).unwrap(), b"user data");
    disk.unmount();
    assert_status(&tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b"]), 2, &["ext2/3/4", "--overwrite"]);
    assert_status(&tutti(&["pool", "format", "--device", &device, "--model", "llama3-8b", "--overwrite"]), 0, &[]);
    assert_status(&tutti(&["pool", "check", "--device", &device]), 0, &[]);
}

/// A fake host under `directory` (sysfs, procfs, /dev) with one NVMe function, 0000:00:04.0
/// (no IOMMU group, no driver), whose controller nvme0 reports `model`: the arguments that
/// point tutti at it.
fn fake_host(directory: &Path, model: &str) -> [String; 6] {
    let (sys, proc, dev) = (directory.join("sys"), directory.join("proc"), directory.join("dev"));
    let function = sys.join("bus/pci/devices/0000:00:04.0");
    std::fs::create_dir_all(function.join("nvme/nvme0")).unwrap();
    std::fs::create_dir_all(&proc).unwrap();
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(function.join("class"), "0x010802\n").unwrap();
    std::fs::write(function.join("vendor"), "0x1b36\n").unwrap();
    std::fs::write(function.join("device"), "0x0010\n").unwrap();
    std::fs::write(function.join("nvme/nvme0/model"), model).unwrap();
    let [sys, proc, dev] = [sys, proc, dev].map(|root| root.display().to_string());
    ["--sysfs-root".into(), sys, "--proc-root".into(), proc, "--dev-root".into(), dev]
}

#[test]
fn a_device_model_is_listed_on_its_line_with_control_characters_escaped() {
    // Goal: `tutti devices` printed the model string the kernel read from the controller
    // (sysfs nvme/nvmeN/model) as it was: a newline or an escape sequence from a device forged
    // or erased lines of the listing. It stays on its function's line, escaped.
    let directory = tempfile::tempdir().unwrap();
    let roots = fake_host(directory.path(), "X\n\x1b[2Kfake\n");
    let roots: Vec<&str> = roots.iter().map(String::as_str).collect();
    let output = tutti(&[&roots[..], &["devices"]].concat());
    assert_status(&output, 0, &[]);
    let listing = stdout(&output);
    assert!(!listing.contains('\x1b'), "{listing:?}");
    let lines: Vec<&str> = listing.lines().collect();
    assert_eq!(lines.len(), 2, "a header and one line per function: {listing:?}");
    assert!(lines[1].starts_with("0000:00:04.0") && lines[1].contains(r"X\n\u{1b}[2Kfake"), "{listing:?}");
}

#[test]
fn bind_and_unbind_refusals_are_unusable_input() {
    // Goal: `tutti unbind` of a function whose device lock another process holds (tuttid), and
    // `tutti bind`/`unbind` of a function that is not there, exited 1 (a failed run), while
    // `tutti pool` and tutti-bench refuse a held device as unusable input (2, nothing changed).
    let directory = tempfile::tempdir().unwrap();
    let roots = fake_host(directory.path(), "QEMU NVMe Ctrl\n");
    let lock_dir = directory.path().join("locks");
    let lock_dir = lock_dir.to_str().unwrap();
    let spec = tutti_devices::DeviceSpec::parse("vfio:0000:00:04.0", &tutti_devices::DeviceKind::ALL).unwrap();
    let tuttid = tutti_devices::DeviceLocks::acquire(&[spec], Path::new(lock_dir), false).unwrap();
    let roots: Vec<&str> = roots.iter().map(String::as_str).collect();
    let output = tutti(&[&roots[..], &["unbind", "0000:00:04.0", "--lock-dir", lock_dir]].concat());
    assert_status(&output, 2, &["in use", "vfio-0000:00:04.0.lock", "stop it first"]);
    drop(tuttid);
    for command in [&["bind", "0000:00:09.0"][..], &["unbind", "0000:00:09.0", "--lock-dir", lock_dir]] {
        assert_status(&tutti(&[&roots[..], command].concat()), 2, &["no PCI function 0000:00:09.0"]);
    }
}

#[test]
fn a_pool_file_others_can_open_is_narrowed_and_the_user_told() {
    // Goal: a pool file made world-readable (truncate under umask 022) is its owner's only once
    // `tutti pool format` has formatted it (locking it changes no mode), and the user is told on
    // standard error which file changed and from what mode; a file already its owner's only is
    // used without a word.
    use std::os::unix::fs::PermissionsExt;
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("pool.img");
    std::fs::File::create(&path).unwrap().set_len(64 << 20).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let output = format(&path, &["--model", "llama3-8b"]);
    let note = format!("warning: pool file {} was mode 0644", path.display());
    assert_status(&output, 0, &[&note, "it is now 0600"]);
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777, 0o600);
    let output = tutti(&["pool", "inspect", "--device", &device(&path)]);
    assert_status(&output, 0, &[]);
    assert!(!stderr(&output).contains("was mode") && !stderr(&output).contains("warning"), "{}", stderr(&output));
    // inspect and check read the pool and change nothing: a pool file others can open is
    // told, with how to make it its owner's only (`chmod go-rwx`, right whatever the mode: the
    // warning said `chmod 700` for a 0755 file, the docs `chmod 600`), and left as it is.
    for mode in [0o640, 0o755] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        for command in ["inspect", "check"] {
            let output = tutti(&["pool", command, "--device", &device(&path)]);
            let note = format!("warning: pool file {} is mode {mode:04o}", path.display());
            let advice = format!("chmod go-rwx {}", path.display());
            assert_status(&output, 0, &[&note, &advice, "Python Store"]);
            assert_eq!(stderr(&output).lines().count(), 1, "{command}: {}", stderr(&output));
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777, mode, "{command} changed the mode");
        }
    }
}

#[test]
fn a_format_whose_standard_output_fails_still_narrows_the_pool_file() {
    // Goal: the superblocks are printed after the narrowing, so a failed print (a full disk, a
    // closed pipe) cannot skip it: the pool is written either way, and was left 0644, untold.
    use std::os::unix::fs::PermissionsExt;
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("pool.img");
    std::fs::File::create(&path).unwrap().set_len(64 << 20).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_tutti"))
        .env_remove("TUTTI_LOG")
        .args(["pool", "format", "--device", &device(&path), "--model", "llama3-8b"])
        .stdout(full)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let note = format!("warning: pool file {} was mode 0644", path.display());
    assert_status(&output, 1, &[&note]);
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777, 0o600);
}

#[test]
fn a_file_the_pool_commands_refuse_keeps_its_mode() {
    // Goal: `tutti pool format` and `inspect` narrowed a pool file others could open to 0600
    // when they locked it, before refusing it: a disk image holding a file system (format
    // without --overwrite, inspect finding no pool) lost its group and others' access though
    // nothing was done to it. A refused command changes no mode, and says one thing.
    use std::os::unix::fs::PermissionsExt;
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("vm.img");
    let mut bytes = vec![0u8; 8 << 20];
    bytes[1080..1082].copy_from_slice(&[0x53, 0xef]);
    std::fs::write(&path, &bytes).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mode = || std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
    let output = format(&path, &["--model", "llama3-8b"]);
    assert_status(&output, 2, &["ext2/3/4"]);
    assert!(!stderr(&output).contains("warning"), "{}", stderr(&output));
    assert_eq!(mode(), 0o644, "a refused format changed the mode");
    for command in ["inspect", "check"] {
        let output = tutti(&["pool", command, "--device", &device(&path)]);
        assert_ne!(output.status.code(), Some(0), "{command}: {}", stderr(&output));
        assert!(!stderr(&output).contains("warning"), "{command}: {}", stderr(&output));
        assert_eq!(mode(), 0o644, "a refused {command} changed the mode");
    }
    assert!(std::fs::read(&path).unwrap() == bytes, "a refused command wrote to the file");
}

#[test]
fn a_closed_standard_error_does_not_turn_a_note_into_a_panic() {
    // Goal: `tutti devices` noting a function it skips (an unreadable vendor) wrote the note
    // with eprintln!, which panics (exit 101) when standard error is closed (`2>&-`, a pipe
    // whose reader exited); a note is best effort: the listing still exits 0.
    let directory = tempfile::tempdir().unwrap();
    let roots = fake_host(directory.path(), "QEMU NVMe Ctrl\n");
    let odd = directory.path().join("sys/bus/pci/devices/0000:00:05.0");
    std::fs::create_dir_all(&odd).unwrap();
    std::fs::write(odd.join("class"), "0x010802\n").unwrap();
    std::fs::write(odd.join("vendor"), "not hex\n").unwrap();
    let roots: Vec<&str> = roots.iter().map(String::as_str).collect();
    let noted = tutti(&[&roots[..], &["devices"]].concat());
    assert_status(&noted, 0, &["0000:00:05.0 skipped"]);
    // The pipe's read end is closed before the program starts: every write to it fails.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let output = Command::new(env!("CARGO_BIN_EXE_tutti"))
        .args([&roots[..], &["devices"]].concat())
        .stdout(Stdio::piped())
        .stderr(writer)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "stdout: {}", stdout(&output));
    assert!(stdout(&output).contains("0000:00:04.0"), "{}", stdout(&output));
}

#[test]
fn a_key_secret_file_keys_the_pool_and_is_never_printed() {
    // Goal: `--key-secret-file` formats the pool with that secret: two pools formatted from one
    // file show one key secret tag, a pool formatted without it another (a fresh random
    // secret); the secret itself appears in no output. A malformed file is unusable input
    // (status 2, nothing created) whose message does not echo the file; one that group or
    // others may read, or write, is used, with a warning.
    use std::os::unix::fs::PermissionsExt;
    let directory = tempfile::tempdir().unwrap();
    let secret = "0123456789abcdef".repeat(4);
    let secret_path = directory.path().join("secret");
    std::fs::write(&secret_path, format!("{secret}\n")).unwrap();
    std::fs::set_permissions(&secret_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let secret_arg = secret_path.to_str().unwrap();
    let tag_of = |output: &Output| {
        let text = stdout(output);
        assert!(!text.contains(&secret[..16]) && !stderr(output).contains(&secret[..16]), "the secret printed: {text}");
        let at = text.find("key secret tag ").unwrap_or_else(|| panic!("no tag in: {text}")) + "key secret tag ".len();
        text[at..at + 8].to_string()
    };
    let (first, second, third) = (directory.path().join("a.img"), directory.path().join("b.img"), directory.path().join("c.img"));
    let formatted = format(&first, &["--model", "llama3-8b", "--key-secret-file", secret_arg]);
    assert_status(&formatted, 0, &[]);
    assert!(!stderr(&formatted).contains("warning"), "{}", stderr(&formatted));
    let tag = tag_of(&formatted);
    let again = format(&second, &["--model", "llama3-8b", "--key-secret-file", secret_arg]);
    assert_eq!(tag_of(&again), tag, "one secret file, one tag");
    let inspected = tutti(&["pool", "inspect", "--device", &device(&first)]);
    assert_status(&inspected, 0, &[]);
    assert_eq!(tag_of(&inspected), tag);
    let random = format(&third, &["--model", "llama3-8b"]);
    assert_status(&random, 0, &[]);
    assert_ne!(tag_of(&random), tag, "without a file, a fresh secret");
    // Readable by others: used, with a warning.
    std::fs::set_permissions(&secret_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let exposed = format(&third, &["--model", "llama3-8b", "--key-secret-file", secret_arg]);
    assert_status(&exposed, 0, &["warning", "readable by group or others (mode 644)"]);
    assert_eq!(tag_of(&exposed), tag);
    // Writable by others (who could plant a secret they know): used, with a warning.
    std::fs::set_permissions(&secret_path, std::fs::Permissions::from_mode(0o622)).unwrap();
    let planted = format(&third, &["--model", "llama3-8b", "--key-secret-file", secret_arg]);
    assert_status(&planted, 0, &["warning", "writable by group or others (mode 622)", "plant a secret"]);
    assert!(!stderr(&planted).contains("readable by"), "{}", stderr(&planted));
    std::fs::set_permissions(&secret_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    // A typo (one non-hex digit), a short file: refused, the file's text not echoed, no pool file made.
    let fourth = directory.path().join("d.img");
    for bad in [format!("{}x{}\n", &secret[..20], &secret[21..]), secret[..40].to_string()] {
        std::fs::write(&secret_path, &bad).unwrap();
        let refused = format(&fourth, &["--model", "llama3-8b", "--key-secret-file", secret_arg]);
        assert_status(&refused, 2, &["key secret"]);
        assert!(!stderr(&refused).contains(&secret[..16]), "{}", stderr(&refused));
        assert!(!fourth.exists(), "a refused format created the pool file");
    }
    let missing = directory.path().join("no-such-secret");
    assert_status(&format(&fourth, &["--model", "llama3-8b", "--key-secret-file", missing.to_str().unwrap()]), 2, &["no-such-secret"]);
}
