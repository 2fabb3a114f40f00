//! `tuttid --format` refused (exit status 2, "nothing was changed"): the `emu:` files are left as
//! they were, neither created nor grown, also for refusals that come after the files were made
//! (a set mixing emu: and vfio: devices, a character device among the files, a size no file can
//! have) and for an existing file smaller than the size asked for.
//! And a pool recording another LBA size than the namespace's: refused as unusable input (2).
//! And a malformed `--key-secret-file`: refused the same way, its text never echoed. And a
//! cluster node formatted without one: warned that it will share nothing.

use std::path::Path;
use std::process::Command;

mod common;
use common::TUTTID;

/// Runs tuttid with `arguments` to its end (killed and failed past `common::WAIT`): its exit code and
/// stderr.
fn tuttid(directory: &Path, arguments: &[&str]) -> (Option<i32>, String) {
    let mut command = Command::new(TUTTID);
    command.args(arguments).arg("--socket").arg(directory.join("sockets").join("tuttid.sock"));
    command.arg("--lock-dir").arg(directory.join("locks")).args(["--metrics", "off"]);
    common::run_bounded(&mut command)
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
fn a_refused_format_leaves_the_files_as_they_were() {
    let scratch = tempfile::tempdir().unwrap();
    let directory = scratch.path().join("pool");
    std::fs::create_dir(&directory).unwrap();
    std::fs::create_dir(scratch.path().join("sockets")).unwrap();
    let device = |name: &str| format!("emu:{}", directory.join(name).display());
    let (new, other, small) = (device("new.img"), device("other.img"), device("small.img"));
    std::fs::File::create(directory.join("small.img")).unwrap().set_len(512 << 10).unwrap();
    let before = listing(&directory);
    let runs: [(Vec<&str>, &str); 4] = [
        // An existing file smaller than asked, the format refusing the size: not grown.
        (vec!["--device", &small, "--emu-create-bytes", "1m"], "too small"),
        (vec!["--device", &new, "--device", "vfio:0000:00:04.0", "--emu-create-bytes", "64m"], "share one DMA space"),
        (vec!["--device", &new, "--device", &small, "--device", "emu:/dev/null", "--emu-create-bytes", "64m"], "emu:/dev/null"),
        (vec!["--device", &new, "--device", &other, "--emu-create-bytes", "9000000t", "--slots", "4"], "backing store"),
    ];
    for (devices, needle) in runs {
        let mut arguments = devices.clone();
        arguments.extend_from_slice(&["--format", "--model", "llama3-8b"]);
        let (code, stderr) = tuttid(scratch.path(), &arguments);
        assert_eq!(code, Some(2), "{arguments:?}: {stderr}");
        assert!(stderr.contains(needle), "{arguments:?}: {stderr}");
        assert_eq!(listing(&directory), before, "{arguments:?} left the files changed: {stderr}");
    }
}

#[test]
fn a_pool_recording_another_lba_size_is_unusable_input_not_a_failure() {
    // Goal: a pool whose superblock records another LBA size than the namespace's (one formatted
    // by `tutti pool format --emu-lba-bytes 512`; tuttid's software controller runs 4096-byte
    // LBAs) is refused with exit status 2 (the same command fails the same way until someone
    // changes it), not 1 (a device failure a supervisor may retry). Before, tuttid exited 1.
    let scratch = tempfile::tempdir().unwrap();
    let image = scratch.path().join("pool.img");
    let device = format!("emu:{}", image.display());
    let daemon = common::Daemon::start(scratch.path(), &device, &["--format", "--emu-create-bytes", "64m"]);
    let (status, stderr) = daemon.terminate();
    assert!(status.success(), "{stderr}");
    // The superblock (LBA 0) records 512-byte LBAs, its CRC (bytes 252..256 over 0..252) resealed.
    let mut bytes = std::fs::read(&image).unwrap();
    bytes[64..68].copy_from_slice(&512u32.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..252]);
    bytes[252..256].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&image, &bytes).unwrap();
    std::fs::create_dir_all(scratch.path().join("sockets")).unwrap();
    let (code, stderr) = tuttid(scratch.path(), &["--device", &device]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("512"), "{stderr}");
}

#[test]
fn a_malformed_key_secret_file_is_refused_before_anything_is_made() {
    // Goal: `--format --key-secret-file` with a file that is not 64 hex digits, or that is
    // missing, is unusable input (2) refused before any pool file is created, and the message
    // names what is wrong without echoing the file (a secret with one typo is still a secret);
    // without --format the option is refused (it only means something to a format).
    let scratch = tempfile::tempdir().unwrap();
    let directory = scratch.path().join("pool");
    std::fs::create_dir(&directory).unwrap();
    std::fs::create_dir(scratch.path().join("sockets")).unwrap();
    let device = format!("emu:{}", directory.join("new.img").display());
    let secret = scratch.path().join("secret");
    let almost = format!("{}z", "ab".repeat(31) + "c");
    std::fs::write(&secret, &almost).unwrap();
    let secret_arg = secret.to_str().unwrap();
    let missing = scratch.path().join("no-such-secret");
    for (file, needle) in [(secret_arg, "key secret"), (missing.to_str().unwrap(), "no-such-secret")] {
        let arguments = ["--device", &device, "--emu-create-bytes", "64m", "--format", "--model", "llama3-8b", "--key-secret-file", file];
        let (code, stderr) = tuttid(scratch.path(), &arguments);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(stderr.contains(needle) && !stderr.contains("abababab"), "{stderr}");
        assert!(listing(&directory).is_empty(), "a refused format made files: {stderr}");
    }
    let (code, stderr) = tuttid(scratch.path(), &["--device", &device, "--key-secret-file", secret_arg]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--format"), "{stderr}");
}

#[test]
fn a_cluster_node_formatted_without_a_secret_file_is_warned_that_it_shares_nothing() {
    // Goal: `--format` with cluster settings and no `--key-secret-file` gives the node's pool a
    // random key secret, so it would silently share no segments with the other nodes (start
    // scripts from before key secrets format this way): stderr says so. With a secret file, or
    // without cluster settings, no such warning. Each run is then refused by an over-large
    // --clients-max (checked after the format's options, before anything is made), so no etcd
    // is needed.
    use std::os::unix::fs::PermissionsExt;
    let scratch = tempfile::tempdir().unwrap();
    let directory = scratch.path().join("pool");
    std::fs::create_dir(&directory).unwrap();
    std::fs::create_dir(scratch.path().join("sockets")).unwrap();
    let device = format!("emu:{}", directory.join("new.img").display());
    let secret = scratch.path().join("secret");
    std::fs::write(&secret, format!("{}\n", "0123456789abcdef".repeat(4))).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let manifest = scratch.path().join("manifest");
    let format = ["--device", &device, "--emu-create-bytes", "64m", "--format", "--model", "llama3-8b", "--clients-max", "100000000"];
    let cluster = [
        "--cluster-etcd",
        "http://127.0.0.1:9",
        "--cluster-id",
        "refusals",
        "--node-id",
        "node-a",
        "--data-address",
        "127.0.0.1:9",
        "--cluster-state",
        manifest.to_str().unwrap(),
    ];
    let warning = "will share no segments with other nodes";
    let with_secret = ["--key-secret-file", secret.to_str().unwrap()];
    for (arguments, warned) in [
        ([&format[..], &cluster[..]].concat(), true),
        ([&format[..], &cluster[..], &with_secret[..]].concat(), false),
        (format.to_vec(), false),
    ] {
        let (code, stderr) = tuttid(scratch.path(), &arguments);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(stderr.contains("--clients-max"), "{stderr}");
        assert_eq!(stderr.contains(warning), warned, "{arguments:?}: {stderr}");
        assert!(listing(&directory).is_empty(), "{stderr}");
    }
}
