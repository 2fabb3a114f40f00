//! The `nvme-conformance` binary's exit statuses: 0 passed, 2 unusable input (including a memory
//! device larger than the machine can spare, a filter that selects no check, an integrity run
//! larger than the namespace, a timeout past a day), 141 standard output closed by its reader.

use std::process::{Command, Stdio};

fn conformance(arguments: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_nvme-conformance")).args(arguments).output().expect("the built binary runs")
}

#[test]
fn passes_refuses_and_stops_quietly_on_a_closed_pipe() {
    let passed = conformance(&["--device", "emu:mem:16M", "--quick", "--filter", "bring_up"]);
    assert_eq!(passed.status.code(), Some(0), "{}", String::from_utf8_lossy(&passed.stderr));
    assert!(String::from_utf8_lossy(&passed.stdout).contains("CONFORMANCE_OK"));

    // Goal (issue 17 items 6 and 9): a memory device the machine cannot hold is refused in words
    // (it used to abort the process, exit 134).
    let huge = conformance(&["--device", "emu:mem:1T"]);
    let text = String::from_utf8_lossy(&huge.stderr);
    assert_eq!(huge.status.code(), Some(2), "{text}");
    assert!(text.contains("1TiB of memory asked") && text.contains("use emu:PATH"), "{text}");
    let bad = conformance(&["--device", "uring:/dev/nvme0n1"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("cannot be used here"));

    // Goal (issue 17 item 9): standard output closed before the report: 141, no panic.
    // The pipe's read end is closed before the program starts: its first write fails, always.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let output = Command::new(env!("CARGO_BIN_EXE_nvme-conformance"))
        .args(["--device", "emu:mem:16M", "--quick", "--filter", "bring_up"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(141), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}

/// Asserts exit status 2 with every needle on standard error, no panic and no verdict printed.
fn assert_bad_usage(arguments: &[&str], needles: &[&str]) {
    let output = conformance(arguments);
    let text = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{arguments:?}: {text}");
    for needle in needles {
        assert!(text.contains(needle), "{arguments:?}: '{needle}' missing from: {text}");
    }
    assert!(!text.contains("panicked"), "{arguments:?}: {text}");
    assert!(!String::from_utf8_lossy(&output.stdout).contains("CONFORMANCE_"), "{arguments:?}: a verdict was printed");
}

#[test]
fn options_that_select_nothing_or_overflow_are_bad_usage() {
    // Goal: a filter that runs no check, an integrity run that needs --integrity-mib, one past
    // 2^64 bytes or past the namespace, and a timeout that would overflow a deadline are exit 2
    // before any check runs (they were CONFORMANCE_FAILED, exit 1, or a panic).
    assert_bad_usage(&["--device", "emu:mem:16M", "--filter", "no_such_check"], &["matches no check", "bring_up_and_identify"]);
    assert_bad_usage(&["--device", "emu:mem:16M", "--filter", "data_integrity"], &["--integrity-mib 1 or more"]);
    assert_bad_usage(
        &["--device", "emu:mem:16M", "--filter", "data_integrity", "--integrity-mib", "18446744073709551615"],
        &["larger than any namespace"],
    );
    assert_bad_usage(
        &["--device", "emu:mem:16M", "--filter", "data_integrity", "--integrity-mib", "64"],
        &["larger than the namespace (16 MiB)"],
    );
    assert_bad_usage(
        &["--device", "emu:mem:16M", "--quick", "--filter", "reset_and_continue", "--timeout-s", "18446744073709551615"],
        &["--timeout-s", "accepted: whole seconds from 1 to 86400"],
    );
    // What fits runs: an integrity run of the namespace's size.
    let fits = conformance(&["--device", "emu:mem:16M", "--filter", "data_integrity", "--integrity-mib", "16"]);
    assert_eq!(fits.status.code(), Some(0), "{}", String::from_utf8_lossy(&fits.stdout));
}

/// A file of `bytes` under the test target's scratch directory, named for the test and this
/// process (removed by the caller).
fn scratch_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nvme-conformance-{name}-{}.img", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Takes the lock on the `emu:` file at `path` that tuttid and `tutti pool` hold, in this test
/// process, until the result is dropped: their own code, so that the test pins the protocol
/// (and not `File::lock`, newer than the workspace's rust-version). A function of its own, not
/// code inside a `#[test]` one, which clippy's `incompatible_msrv` does not check.
fn hold_as_tuttid_does(path: &std::path::Path) -> tutti_devices::DeviceLocks {
    let spec = tutti_devices::DeviceSpec::EmuFile(path.to_path_buf());
    // The lock directory holds only vfio: functions' lock files: unused for an emu: file.
    tutti_devices::DeviceLocks::acquire(&[spec], std::path::Path::new(env!("CARGO_TARGET_TMPDIR")), false).expect("lock the file")
}

#[test]
fn a_file_another_process_holds_is_refused_and_left_as_it_was() {
    // Goal (finding 1): the lock tuttid and `tutti pool` take on an emu: file is honoured: with
    // it held elsewhere (here by this test process), the suite refuses the device with exit 2,
    // naming the holder, and writes nothing (it used to overwrite the file from LBA 0 on).
    // Without --overwrite too (rc-driver finding 3): a live daemon's pool holds data, and the
    // refusal is still the lock's, naming the holder; it said "pass --overwrite", advice that
    // only led to this refusal, because the file was looked at before it was locked.
    let contents: Vec<u8> = (0..64usize << 20).map(|index| (index % 251) as u8).collect();
    let path = scratch_file("locked", &contents);
    let holder = hold_as_tuttid_does(&path);
    let device = format!("emu:{}", path.display());
    let mut refusals = Vec::new();
    for overwrite in [true, false] {
        let mut arguments = vec!["--device", &device, "--quick", "--filter", "read_write_sizes_prp"];
        if overwrite {
            arguments.push("--overwrite");
        }
        let output = conformance(&arguments);
        refusals.push((arguments.join(" "), output, std::fs::read(&path).unwrap() == contents));
    }
    drop(holder);
    std::fs::remove_file(&path).unwrap();
    for (arguments, output, unchanged) in refusals {
        let text = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{arguments}: {text}");
        assert!(text.contains("in use by another process") && text.contains(&std::process::id().to_string()), "{arguments}: {text}");
        assert!(unchanged, "{arguments}: the locked file was written");
    }
}

#[test]
fn a_file_holding_data_needs_overwrite() {
    // Goal (finding 1): the suite writes from LBA 0 on, so an emu: file that already holds
    // data is refused (exit 2, nothing written) unless --overwrite says so; with it the suite
    // runs. A file named by mistake is not grown and overwritten.
    let contents = b"#!/bin/sh\necho a file named by mistake\n".repeat(1000);
    let path = scratch_file("foreign", &contents);
    let device = format!("emu:{}", path.display());
    let refused = conformance(&["--device", &device, "--quick", "--filter", "read_write_sizes_prp"]);
    let text = String::from_utf8_lossy(&refused.stderr).into_owned();
    let unchanged = std::fs::read(&path).unwrap() == contents;
    let overwritten = conformance(&["--device", &device, "--overwrite", "--quick", "--filter", "read_write_sizes_prp"]);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(refused.status.code(), Some(2), "{text}");
    assert!(text.contains("--overwrite") && !text.contains("panicked"), "{text}");
    assert!(unchanged, "a file holding data was written without --overwrite");
    assert!(!String::from_utf8_lossy(&refused.stdout).contains("CONFORMANCE_"), "a verdict was printed");
    assert_eq!(overwritten.status.code(), Some(0), "{}", String::from_utf8_lossy(&overwritten.stderr));
}

#[test]
fn a_refusal_for_data_held_leaves_no_file_created() {
    // Goal (rc2-a finding 2): exit 2 means nothing was changed. The data check runs under the
    // lock, and the lock creates a missing emu: file (so that it is locked before the software
    // controller grows it): a later device refused for the data it holds must not leave that
    // new, empty file behind.
    let missing = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nvme-conformance-undone-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&missing);
    let contents = b"data the suite would overwrite\n".repeat(100);
    let held = scratch_file("held-data", &contents);
    let lock_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nvme-conformance-undone-locks-{}", std::process::id()));
    let lock_dir_text = lock_dir.to_str().expect("a UTF-8 target directory");
    let (first, second) = (format!("emu:{}", missing.display()), format!("emu:{}", held.display()));
    let output = conformance(&["--device", &first, "--device", &second, "--quick", "--lock-dir", lock_dir_text]);
    let created = missing.exists();
    let unchanged = std::fs::read(&held).unwrap() == contents;
    let _ = std::fs::remove_file(&missing);
    std::fs::remove_file(&held).unwrap();
    let _ = std::fs::remove_dir_all(&lock_dir);
    let text = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("pass --overwrite"), "{text}");
    assert!(!created, "the refusal left the file the lock created");
    assert!(unchanged, "the file holding data was written");
}

#[test]
fn a_vfio_device_needs_overwrite() {
    // Goal: the suite never looks at what a vfio: SSD holds (a stopped tuttid's pool, a
    // filesystem) before it writes every namespace from LBA 0 on, so it is refused without
    // --overwrite (exit 2, before anything is opened). With it, this machine's missing function
    // is refused as unusable, not as needing --overwrite. The lock directory is the test's own
    // (rc-driver finding 6): with the default /run/tutti, a non-root run was refused for that
    // directory before the function was looked at, and a root run left lock files in the host's
    // tuttid directory.
    let device = "vfio:0000:ff:1f.7";
    let lock_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nvme-conformance-locks-{}", std::process::id()));
    let lock_dir_text = lock_dir.to_str().expect("a UTF-8 target directory");
    let refused = conformance(&["--device", device, "--quick", "--lock-dir", lock_dir_text]);
    let opened = conformance(&["--device", device, "--overwrite", "--quick", "--lock-dir", lock_dir_text]);
    let _ = std::fs::remove_dir_all(&lock_dir);
    let text = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert_eq!(refused.status.code(), Some(2), "{text}");
    assert!(text.contains("--overwrite") && text.contains(device) && !text.contains("panicked"), "{text}");
    let text = String::from_utf8_lossy(&opened.stderr).into_owned();
    assert_eq!(opened.status.code(), Some(2), "{text}");
    assert!(!text.contains("pass --overwrite"), "{text}");
    assert!(text.contains("no PCI function 0000:ff:1f.7"), "refused for another reason than the missing function: {text}");
}

#[test]
fn a_fault_injection_only_selection_is_refused_before_any_device_is_tested() {
    // Goal (rc-driver finding 7): bad usage is refused before any check runs. A filter that
    // selects only checks needing fault injection, with a vfio: device among the devices
    // (which has none), used to be refused only when that device's turn came: the devices
    // before it were tested and their reports printed, then exit 2.
    let lock_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nvme-conformance-fault-locks-{}", std::process::id()));
    let lock_dir_text = lock_dir.to_str().expect("a UTF-8 target directory");
    let arguments = [
        "--device",
        "emu:mem:16M",
        "--device",
        "vfio:0000:ff:1f.7",
        "--overwrite",
        "--quick",
        "--filter",
        "bounded",
        "--lock-dir",
        lock_dir_text,
    ];
    let output = conformance(&arguments);
    let _ = std::fs::remove_dir_all(&lock_dir);
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("need fault injection") && stderr.contains("bounded_timeout"), "{stderr}");
    assert!(stdout.is_empty(), "a device was tested before the refusal: {stdout}");
}

#[test]
fn an_integrity_run_past_a_later_devices_namespace_is_refused_before_any_device_is_tested() {
    // Goal (rc2-a finding 3, the other half of rc-driver finding 7): an --integrity-mib larger
    // than a device's namespace is bad usage, refused before any check runs. With that device
    // second, the first used to be tested and its report printed, then exit 2. A missing emu:
    // file, created and grown to look at its namespace, is removed by the refusal.
    let missing = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nvme-conformance-integrity-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&missing);
    let first = format!("emu:{}", missing.display());
    let arguments = ["--device", &first, "--device", "emu:mem:16M", "--overwrite", "--filter", "data_integrity", "--integrity-mib", "32"];
    let output = conformance(&arguments);
    let created = missing.exists();
    let _ = std::fs::remove_file(&missing);
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--integrity-mib 32") && stderr.contains("emu:mem:16M"), "{stderr}");
    assert!(stdout.is_empty(), "a device was tested before the refusal: {stdout}");
    assert!(!created, "the refusal left the file it created");

    // An existing empty file holds nothing (no --overwrite needed) and is grown to be looked
    // at: the refusal shrinks it back to empty rather than leaving it 256 MiB.
    let empty = scratch_file("integrity-empty", &[]);
    let first = format!("emu:{}", empty.display());
    let arguments = ["--device", &first, "--device", "emu:mem:16M", "--filter", "data_integrity", "--integrity-mib", "32"];
    let output = conformance(&arguments);
    let length = std::fs::metadata(&empty).map(|metadata| metadata.len());
    let _ = std::fs::remove_file(&empty);
    assert_eq!(output.status.code(), Some(2), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(length.ok(), Some(0), "the refusal left the empty file grown (or removed it)");
}

#[test]
fn a_new_file_is_created_and_tested_without_overwrite() {
    // Goal: a missing emu: file holds nothing: it is created (locked meanwhile) and tested.
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nvme-conformance-new-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let device = format!("emu:{}", path.display());
    let output = conformance(&["--device", &device, "--quick", "--filter", "read_write_sizes_prp"]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
}
