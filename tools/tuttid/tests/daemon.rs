//! tuttid as a process: bad frames, a second daemon, concurrent client processes, SIGTERM, a
//! killed client, an expired lease. Each test starts the `tuttid` binary on a socket in its own
//! temporary directory, over a software controller running inside the daemon, and bounds every
//! wait. Client processes are this test binary run again with `TUTTID_TEST_CHILD` set (see
//! `child_process_entry`), so they are separate processes with their own pids and credentials.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use objstore::{Direction, LayerKvStore, Transferred};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::{encode_frame, Commit, FrameHeader, Kind, Prepare, Reply, Request, BODY_BYTES_MAX, HEADER_BYTES};
use tutti_daemon::{Client, DaemonError, ErrorCode};

mod common;
use common::{hello, output_bounded, prompt, retrieve_prompt, store_prompt, Daemon, TUTTID, WAIT};

const CHILD_ENV: &str = "TUTTID_TEST_CHILD";
/// Blocks of each prompt an `io` client stores and retrieves.
const IO_BLOCKS: usize = 4;
/// Prompts each `io` client stores, looks up and retrieves.
const IO_ROUNDS: u32 = 10;

fn remote_store(socket: &Path, name: &str) -> RemoteKvStore {
    let config = RemoteConfig { kv_blocks: 2 * IO_BLOCKS as u32, ..RemoteConfig::default() };
    RemoteKvStore::connect(socket, &hello(0, 1, name), &config).expect("attach a remote store")
}

/// Sends raw bytes and reads the daemon's answer: the error frame's code, then whether the
/// daemon closed the connection after it.
fn raw_exchange(socket: &Path, bytes: &[u8], close_after_send: bool) -> (Option<(ErrorCode, String)>, bool) {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(bytes).unwrap();
    if close_after_send {
        stream.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let mut header = [0u8; HEADER_BYTES];
    if stream.read_exact(&mut header).is_err() {
        return (None, true);
    }
    let header = FrameHeader::decode(&header).unwrap();
    let mut body = vec![0u8; header.body_bytes as usize];
    stream.read_exact(&mut body).unwrap();
    let Reply::Error { code, message } = Reply::decode(header.kind, &body).unwrap() else { panic!("not an error reply") };
    let mut rest = [0u8; 1];
    // Closed: end of file, or a reset when the daemon closed with our extra bytes unread.
    let closed = match stream.read(&mut rest) {
        Ok(count) => count == 0,
        Err(error) => error.kind() == std::io::ErrorKind::ConnectionReset,
    };
    (Some((code, message)), closed)
}

/// Reads `count` whole reply frames: (request id, reply).
fn read_replies(stream: &mut UnixStream, count: usize) -> Vec<(u32, Reply)> {
    (0..count)
        .map(|_| {
            let mut header = [0u8; HEADER_BYTES];
            stream.read_exact(&mut header).unwrap();
            let header = FrameHeader::decode(&header).unwrap();
            let mut body = vec![0u8; header.body_bytes as usize];
            stream.read_exact(&mut body).unwrap();
            (header.request_id, Reply::decode(header.kind, &body).unwrap())
        })
        .collect()
}

fn memory_daemon(directory: &Path, extra: &[&str]) -> Daemon {
    let mut args = vec!["--format"];
    args.extend_from_slice(extra);
    Daemon::start(directory, "emu:mem:64m", &args)
}

#[test]
fn bad_frames_get_typed_errors_and_the_daemon_serves_others() {
    // Goal: garbage, a frame of another version, an oversized frame, a truncated frame and a
    // stalled frame each get their typed error (and the connection closed), a malformed body
    // gets its error with the connection still usable, and an attached client is served
    // throughout.
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path(), &["--frame-timeout", "300ms"]);
    let mut attached = daemon.client();
    attached.hello(&hello(0, 1, "steady")).unwrap();
    assert_eq!(attached.lookup(&[1; 64]).unwrap(), 0);

    let (answer, closed) = raw_exchange(&daemon.socket, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", false);
    assert_eq!(answer.as_ref().map(|a| a.0), Some(ErrorCode::BadMagic), "{answer:?}");
    assert!(closed);

    let mut frame = Vec::new();
    encode_frame(&mut frame, Kind::Ping, 1, |_| {}).unwrap();
    let mut version = frame.clone();
    // A newer client's frame: the version after this build's.
    let newer = tutti_daemon::protocol::PROTOCOL_VERSION + 1;
    version[4..6].copy_from_slice(&newer.to_le_bytes());
    let (answer, closed) = raw_exchange(&daemon.socket, &version, false);
    let (code, message) = answer.unwrap();
    assert_eq!(code, ErrorCode::UnsupportedVersion);
    assert!(
        message.contains(&format!("protocol version {newer}; this build speaks version {}", tutti_daemon::protocol::PROTOCOL_VERSION)),
        "{message}"
    );
    assert!(closed);

    let mut oversized = frame.clone();
    oversized[12..16].copy_from_slice(&(BODY_BYTES_MAX + 1).to_le_bytes());
    let (answer, closed) = raw_exchange(&daemon.socket, &oversized, false);
    assert_eq!(answer.map(|a| a.0), Some(ErrorCode::FrameTooLarge));
    assert!(closed);

    // Truncated: half a header, then the client closes. No answer is owed; nothing breaks.
    let (answer, _) = raw_exchange(&daemon.socket, &frame[..7], true);
    assert!(answer.is_none(), "{answer:?}");

    // Stalled: a header that promises a body that never comes.
    let mut lookup = Vec::new();
    encode_frame(&mut lookup, Kind::Lookup, 2, |out| tutti_daemon::protocol::encode_lookup_body(&[1, 2, 3], out)).unwrap();
    let started = Instant::now();
    let (answer, closed) = raw_exchange(&daemon.socket, &lookup[..HEADER_BYTES + 2], false);
    assert_eq!(answer.map(|a| a.0), Some(ErrorCode::FrameTimeout));
    assert!(closed && started.elapsed() < Duration::from_secs(5));

    // Malformed body, read whole: an error, and the same connection still answers.
    let mut stream = UnixStream::connect(&daemon.socket).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut lying = Vec::new();
    encode_frame(&mut lying, Kind::Lookup, 3, |out| out.extend_from_slice(&[0xff, 0xff, 0xff, 0x7f, 0, 0])).unwrap();
    stream.write_all(&lying).unwrap();
    stream.write_all(&frame).unwrap();
    let replies = read_replies(&mut stream, 2);
    assert!(matches!(&replies[0], (3, Reply::Error { code: ErrorCode::MalformedBody, .. })), "{replies:?}");
    assert_eq!(replies[1], (1, Reply::Pong));

    // Descriptors sent with a request that takes none: refused, closed by the daemon (the
    // receiving end of our pipe sees end of file once the daemon's copy is gone), and the
    // connection serves on.
    let (mut pipe_read, pipe_write) = std::io::pipe().unwrap();
    tutti_daemon::frame_io::write_frame_with_fds(&stream, &frame, &[pipe_write.as_fd()]).unwrap();
    drop(pipe_write);
    stream.write_all(&frame).unwrap();
    let replies: Vec<Reply> = read_replies(&mut stream, 2).into_iter().map(|(_, reply)| reply).collect();
    assert!(
        matches!(&replies[0], Reply::Error { code: ErrorCode::BadRequest, message } if message.contains("1 descriptor(s) sent with a Ping")),
        "{replies:?}"
    );
    assert_eq!(replies[1], Reply::Pong);
    let (eof_sender, eof) = std::sync::mpsc::channel();
    std::thread::spawn(move || eof_sender.send(pipe_read.read(&mut [0u8; 1]).ok()));
    // Bounded: a daemon that kept the descriptor would leave this read blocked for good.
    assert_eq!(eof.recv_timeout(Duration::from_secs(10)), Ok(Some(0)), "the daemon kept a descriptor it refused");

    // The attached client never noticed, and the daemon lists it.
    assert_eq!(attached.lookup(&[1; 64]).unwrap(), 0);
    let status = daemon.client().status().unwrap();
    assert_eq!(status.clients.len(), 1);
    assert_eq!(status.clients[0].name, "steady");
}

#[test]
fn a_status_query_is_answered_while_every_connection_is_taken() {
    // Goal: with --clients-max connections held, one more connection is still let in for status
    // queries only (it was answered Busy, so `tuttid --status` failed when the daemon was at its
    // busiest); it refuses anything else with Busy, and a second one past it is refused.
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path(), &["--clients-max", "1"]);
    // The start-up probe's connection takes a tick to end: until it has, the engine would be
    // the status-only one.
    let deadline = Instant::now() + Duration::from_secs(10);
    let _engine = loop {
        let mut engine = daemon.client();
        match engine.hello(&hello(0, 1, "engine")) {
            Ok(_) => break engine,
            Err(DaemonError::Remote { code: ErrorCode::Busy, .. }) if Instant::now() < deadline => {
                // Closed before the wait, so its thread can end meanwhile.
                drop(engine);
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(error) => panic!("the engine's hello: {error}"),
        }
    };
    // A refused engine's connection thread may not have ended yet: until it has, it holds the
    // status-only place, and a status query is refused too.
    let (mut status, reply) = loop {
        let mut status = daemon.client();
        match status.status() {
            Ok(reply) => break (status, reply),
            Err(DaemonError::Remote { code: ErrorCode::Busy, .. }) if Instant::now() < deadline => {
                drop(status);
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(error) => panic!("a status query past clients_max: {error}"),
        }
    };
    assert_eq!(reply.clients.len(), 1, "{reply:?}");
    let mut second = daemon.client();
    let error = second.status().unwrap_err();
    assert!(matches!(error, DaemonError::Remote { code: ErrorCode::Busy, .. }), "a second status-only connection: {error}");
    let error = status.hello(&hello(0, 1, "late")).unwrap_err();
    assert!(matches!(&error, DaemonError::Remote { code: ErrorCode::Busy, message } if message.contains("status queries only")), "{error}");
    let printed = output_bounded(Command::new(TUTTID).arg("--status").arg(&daemon.socket));
    assert!(!printed.status.success(), "the status-only connection is taken: the command is refused");
    drop(status);
    drop(second);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let printed = output_bounded(Command::new(TUTTID).arg("--status").arg(&daemon.socket));
        if printed.status.success() {
            assert!(String::from_utf8_lossy(&printed.stdout).contains("engine"), "{printed:?}");
            break;
        }
        assert!(Instant::now() < deadline, "tuttid --status kept failing once the status-only connection was free: {printed:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn requests_out_of_order_and_bad_identities_are_refused() {
    // Goal: lookup before hello, a second hello, and an impossible TP rank are typed refusals.
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path(), &[]);
    let mut client = daemon.client();
    let error = client.lookup(&[1; 16]).unwrap_err();
    assert!(matches!(error, DaemonError::Remote { code: ErrorCode::NotAttached, .. }), "{error}");
    let error = client.lookup_all_ranks(&[1; 16]).unwrap_err();
    assert!(matches!(error, DaemonError::Remote { code: ErrorCode::NotAttached, .. }), "{error}");
    let error = client.hello(&hello(2, 2, "x")).unwrap_err();
    assert!(matches!(&error, DaemonError::Remote { code: ErrorCode::BadRequest, message } if message.contains("rank 2")), "{error}");
    let attached = client.hello(&hello(1, 2, "x")).unwrap();
    assert_eq!((attached.shape.layers, attached.shape.block_tokens), (2, 16));
    let error = client.hello(&hello(1, 2, "x")).unwrap_err();
    assert!(matches!(error, DaemonError::Remote { code: ErrorCode::AlreadyAttached, .. }), "{error}");
    // Once attached, the all-ranks lookup is served (nothing is stored through the daemon yet,
    // so 0; the minimum over ranks is covered by tutti-daemon's keys tests).
    assert_eq!(client.lookup_all_ranks(&[1; 64]).unwrap(), 0);
}

/// A `tuttid` command that would format `device` (a small model) and serve on `socket`.
fn formatting_daemon(device: &str, socket: &Path) -> Command {
    let mut command = Command::new(TUTTID);
    command.args(["--device", device, "--socket"]).arg(socket);
    command.args(["--format", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"]);
    command
}

#[test]
fn out_of_range_lease_and_frame_timeout_are_refused_before_the_pool_is_touched() {
    // Goal: a lease or frame timeout the server cannot run with (a deadline past what an
    // Instant holds used to panic every connection thread; zero fails every socket timeout)
    // exits with status 2 naming the option's range, and neither creates nor formats the image.
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("pool.img");
    let device = format!("emu:{}", image.display());
    for (flag, value) in [("--lease", "18446744073709551615s"), ("--lease", "0s"), ("--frame-timeout", "0s"), ("--frame-timeout", "2h")] {
        let mut daemon = formatting_daemon(&device, &directory.path().join("tuttid.sock"));
        let output = output_bounded(daemon.args(["--emu-create-bytes", "64m", flag, value]));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(stderr.contains("is outside"), "{flag} {value}: {stderr}");
        assert!(!image.exists(), "{flag} {value}: the refused daemon created the pool image");
    }
}

#[test]
fn a_second_daemon_on_the_same_pool_is_refused_naming_the_holder() {
    // Goal: the pool file is locked by the first daemon; a second one exits with status 2 and
    // names the first's pid, writes nothing, and the first keeps serving.
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("pool.img");
    let device = format!("emu:{}", image.display());
    let first = Daemon::start(directory.path(), &device, &["--format", "--emu-create-bytes", "64m"]);
    let other = directory.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let before = std::fs::read(&image).unwrap();
    let output = output_bounded(&mut formatting_daemon(&device, &other.join("tuttid.sock")));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    // Named when /proc/locks lists the first daemon's lock on the file's own device (see
    // `lists_flock_exactly`); said to be unknown otherwise.
    if tutti_daemon::lock::lists_flock_exactly(&image, first.pid()) {
        assert!(stderr.contains(&format!("is held by pid {} (", first.pid())), "{stderr}");
    } else {
        assert!(stderr.contains("is held by"), "{stderr}");
    }
    assert!(stderr.contains(&image.display().to_string()), "{stderr}");
    assert!(std::fs::read(&image).unwrap() == before, "the refused daemon wrote to the pool");
    assert!(!other.join("tuttid.sock").exists());
    first.client().status().unwrap();
}

#[test]
fn format_refuses_a_device_holding_something_else_unless_told_to_overwrite() {
    // Goal: `tuttid --format` over an emu: file that holds other bytes (here an ext4 signature)
    // exits with status 2 naming what it found and writes nothing; with --overwrite it formats
    // and serves; a tutti pool is reformatted without it, and so is one whose format was
    // interrupted (superblock zeroed, slot headers behind it); --overwrite needs --format.
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("pool.img");
    let mut foreign = vec![0u8; 1 << 20];
    foreign[1080..1082].copy_from_slice(&[0x53, 0xef]);
    std::fs::write(&image, &foreign).unwrap();
    let device = format!("emu:{}", image.display());
    let socket = directory.path().join("tuttid.sock");
    let output = output_bounded(formatting_daemon(&device, &socket).args(["--emu-create-bytes", "64m"]));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("holds an ext2/3/4 file system") && stderr.contains("--overwrite"), "{stderr}");
    assert!(std::fs::read(&image).unwrap() == foreign, "the refused daemon wrote to (or grew) the device");
    let output = output_bounded(Command::new(TUTTID).args(["--device", &device, "--overwrite", "--socket"]).arg(&socket));
    assert_eq!(output.status.code(), Some(2), "--overwrite without --format: {}", String::from_utf8_lossy(&output.stderr));
    let first = Daemon::start(directory.path(), &device, &["--format", "--overwrite", "--emu-create-bytes", "64m"]);
    first.client().status().unwrap();
    drop(first);
    let again = Daemon::start(directory.path(), &device, &["--format", "--emu-create-bytes", "64m"]);
    again.client().status().unwrap();
    drop(again);
    // What a format stopped before writing its superblock leaves: formatting again recovers it.
    let mut interrupted = std::fs::read(&image).unwrap();
    interrupted[..4096].fill(0);
    std::fs::write(&image, &interrupted).unwrap();
    let recovered = Daemon::start(directory.path(), &device, &["--format", "--emu-create-bytes", "64m"]);
    recovered.client().status().unwrap();
}

#[test]
fn emu_create_bytes_without_format_neither_grows_nor_creates_a_file() {
    // Goal: without --format, --emu-create-bytes changes no file: a mistyped path to a 1 MiB
    // file of other bytes is refused (exit 2: no pool there) and left at 1 MiB, not grown by
    // 63 MiB of zeroes first; a missing file is refused as missing, not created.
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("archive.zip");
    let foreign: Vec<u8> = (0..1u32 << 20).map(|index| (index % 251) as u8 | 1).collect();
    std::fs::write(&image, &foreign).unwrap();
    let socket = directory.path().join("tuttid.sock");
    let daemon = |device: &str| {
        let mut command = Command::new(TUTTID);
        command.args(["--device", device, "--emu-create-bytes", "64m", "--metrics", "off", "--socket"]).arg(&socket);
        command.arg("--lock-dir").arg(directory.path().join("locks"));
        output_bounded(&mut command)
    };
    let output = daemon(&format!("emu:{}", image.display()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 1 << 20, "the file was grown: {stderr}");
    assert!(std::fs::read(&image).unwrap() == foreign, "the file was changed: {stderr}");
    let missing = directory.path().join("missing.img");
    let output = daemon(&format!("emu:{}", missing.display()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no such file"), "{stderr}");
    assert!(!missing.exists(), "a missing file was created without --format: {stderr}");
}

#[test]
fn one_file_given_twice_is_refused_as_such_not_as_held_by_another_daemon() {
    // Goal: the same file as two devices (here through a hard link) exits 2 saying the two
    // name the same file; it used to say the file was in use by another daemon, naming
    // tuttid's own pid (its second lock on the file was refused by its first).
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("pool.img");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let link = directory.path().join("link.img");
    std::fs::hard_link(&image, &link).unwrap();
    let (first, second) = (format!("emu:{}", image.display()), format!("emu:{}", link.display()));
    let mut command = Command::new(TUTTID);
    command.args(["--device", &first, "--device", &second, "--metrics", "off", "--socket"]).arg(directory.path().join("tuttid.sock"));
    command.arg("--lock-dir").arg(directory.path().join("locks"));
    let output = output_bounded(&mut command);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(&format!("{first} and {second} name the same file")), "{stderr}");
    assert!(!stderr.contains("another daemon"), "{stderr}");
}

#[test]
fn a_refused_format_creates_no_file() {
    // Goal: --format --emu-create-bytes over a new file and a file holding a file system exits 2
    // and leaves no new file behind: the new one used to be created (empty) when it was locked,
    // before the other was read and refused.
    let directory = tempfile::tempdir().unwrap();
    let new = directory.path().join("new.img");
    let file_system = directory.path().join("fs.img");
    let mut foreign = vec![0u8; 1 << 20];
    foreign[1080..1082].copy_from_slice(&[0x53, 0xef]);
    std::fs::write(&file_system, &foreign).unwrap();
    let (new_device, file_system_device) = (format!("emu:{}", new.display()), format!("emu:{}", file_system.display()));
    let mut command = formatting_daemon(&new_device, &directory.path().join("tuttid.sock"));
    command.args(["--device", &file_system_device, "--emu-create-bytes", "1g", "--metrics", "off"]);
    command.arg("--lock-dir").arg(directory.path().join("locks"));
    let output = output_bounded(&mut command);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("holds an ext2/3/4 file system"), "{stderr}");
    assert!(!new.exists(), "the refused format left {} behind", new.display());
    assert!(std::fs::read(&file_system).unwrap() == foreign, "the refused format wrote to the file system");
}

/// Runs as a client process when `TUTTID_TEST_CHILD` is set (`lookup SOCKET RANK COUNT`,
/// `io SOCKET RANK` or `attach SOCKET`); as an ordinary test it does nothing. The parent tests
/// check its exit status and output.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(CHILD_ENV) else { return };
    let words: Vec<&str> = role.split(' ').collect();
    let socket = Path::new(words[1]);
    if words[0] == "io" {
        // Stores, looks up and retrieves (byte-exact) IO_ROUNDS prompts through its own queue
        // pair, then prints what it reported moving: retrieve bytes, commands, store bytes,
        // commands.
        let rank: u32 = words[2].parse().unwrap();
        let mut store = remote_store(socket, &format!("io-{rank}"));
        let block_tokens = store.hello_reply().shape.block_tokens;
        for round in 0..IO_ROUNDS {
            let seed = 1000 * (rank + 1) + round;
            assert_eq!(store_prompt(&mut store, seed, 0, IO_BLOCKS).unwrap(), IO_BLOCKS);
            assert_eq!(store.lookup(&prompt(seed, IO_BLOCKS, block_tokens)), IO_BLOCKS);
            assert_eq!(retrieve_prompt(&mut store, seed, 0, IO_BLOCKS).unwrap(), 0, "wrong bytes retrieved");
        }
        let (read, write) = (store.reported(Direction::Retrieve), store.reported(Direction::Store));
        println!("CHILD-IO {} {} {} {}", read.bytes, read.commands, write.bytes, write.commands);
        return;
    }
    let mut client = Client::connect(socket, Duration::from_secs(10)).unwrap();
    match words[0] {
        "lookup" => {
            let rank: u32 = words[2].parse().unwrap();
            let count: usize = words[3].parse().unwrap();
            client.hello(&hello(rank, 2, &format!("child-{rank}"))).unwrap();
            let tokens: Vec<u32> = (0..4096).collect();
            for _ in 0..count {
                assert_eq!(client.lookup(&tokens).unwrap(), 0);
            }
            println!("CHILD-DONE {count}");
        }
        "attach" => {
            client.hello(&hello(0, 1, "doomed")).unwrap();
            println!("CHILD-ATTACHED");
            std::io::stdout().flush().unwrap();
            // Parked until the parent kills it; bounded so a lost parent cannot leave it behind.
            std::thread::sleep(WAIT);
        }
        other => panic!("unknown child role {other}"),
    }
}

fn spawn_child(role: &str) -> Child {
    common::spawn_child("child_process_entry", CHILD_ENV, role)
}

#[test]
fn client_processes_look_up_and_move_kv_concurrently_and_metrics_count_them() {
    // Goal: two processes (TP ranks 0 and 1) run 300 lookups each while two more store, look
    // up and retrieve 10 prompts each through their own queue pairs, all at the same time;
    // every answer is right (lookups of an empty key space: 0 blocks; retrieves byte-exact)
    // and the sessions are gone after they exit. A real HTTP client scrapes /metrics while
    // they run (the data-path counters only grow, never past their final value) and after:
    // the counts are exact — bytes and commands per direction are what the clients reported
    // moving (bytes: every block's every layer once, 2 × 10 × 4 blocks each way), lookups
    // (600 × 256 misses, 2 × 10 × 4 hits), requests per phase, no pin left. Then a client that
    // reports moving more than its request's blocks cover is refused (BadReport, counted under
    // errors) and nothing of its report is counted.
    let directory = tempfile::tempdir().unwrap();
    let mut daemon = memory_daemon(directory.path(), &["--metrics", "127.0.0.1:0"]);
    let metrics = daemon.metrics_url();
    let socket = daemon.socket.display().to_string();
    let lookups: Vec<Child> = (0..2).map(|rank| spawn_child(&format!("lookup {socket} {rank} 300"))).collect();
    let mut movers: Vec<Child> = (0..2).map(|rank| spawn_child(&format!("io {socket} {rank}"))).collect();
    let mut during = Vec::new();
    // try_wait keeps the status for wait_with_output below.
    while !movers.iter_mut().all(|child| child.try_wait().unwrap().is_some()) && during.len() < 1000 {
        let text = common::scrape(&metrics);
        assert!(text.contains("tuttid_pool_slots{state=\"Free\"}"), "{text}");
        during.push(counter(&text, "tuttid_bytes_total{direction=\"Store\"}"));
    }
    for child in lookups {
        let output = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success() && stdout.contains("CHILD-DONE 300"), "{stdout}");
    }
    let mut reported = [Transferred::default(); 2];
    for child in movers {
        let output = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{stdout}");
        let line = stdout.lines().find_map(|line| line.split("CHILD-IO ").nth(1)).unwrap_or_else(|| panic!("no CHILD-IO in {stdout}"));
        let numbers: Vec<u64> = line.split(' ').map(|word| word.trim().parse().unwrap()).collect();
        for (direction, total) in reported.iter_mut().enumerate() {
            total.bytes += numbers[2 * direction];
            total.commands += numbers[2 * direction + 1];
        }
    }
    assert!(wait_for_clients(&daemon, 0).is_empty());
    let after = common::scrape(&metrics);
    let block_bytes = 2 * 2 * 16 * 2 * 64 * 2; // 2 layers × K, V × 16 tokens × 2 heads × 64 dims × bf16
    let moved = 2 * u64::from(IO_ROUNDS) * IO_BLOCKS as u64 * block_bytes;
    assert_eq!((reported[0].bytes, reported[1].bytes), (moved, moved), "every block's every layer once, each way");
    assert!(reported[0].commands > 0 && reported[1].commands > 0, "{reported:?}");
    assert!(during.windows(2).all(|pair| pair[0] <= pair[1]), "the counter went back: {during:?}");
    assert!(during.iter().all(|&bytes| bytes <= moved), "{during:?}");
    let prepared = 2 * IO_ROUNDS;
    for line in [
        "tuttid_requests_total{request=\"Lookup\"} 620".to_string(),
        "tuttid_requests_total{request=\"Hello\"} 4".to_string(),
        format!("tuttid_bytes_total{{direction=\"Retrieve\"}} {}", reported[0].bytes),
        format!("tuttid_commands_total{{direction=\"Retrieve\"}} {}", reported[0].commands),
        format!("tuttid_bytes_total{{direction=\"Store\"}} {}", reported[1].bytes),
        format!("tuttid_commands_total{{direction=\"Store\"}} {}", reported[1].commands),
        "tuttid_lookup_blocks_total{result=\"Miss\"} 153600".to_string(),
        format!("tuttid_lookup_blocks_total{{result=\"Hit\"}} {}", prepared as usize * IO_BLOCKS),
        "tuttid_request_seconds_count{request=\"Lookup\"} 620".to_string(),
        format!("tuttid_request_seconds_count{{request=\"PrepareStore\"}} {prepared}"),
        format!("tuttid_request_seconds_count{{request=\"Commit\"}} {prepared}"),
        format!("tuttid_request_seconds_count{{request=\"PrepareRetrieve\"}} {prepared}"),
        format!("tuttid_request_seconds_count{{request=\"Release\"}} {prepared}"),
        format!("tuttid_pool_cached_blocks {}", prepared as usize * IO_BLOCKS),
        "tuttid_pool_slots{state=\"Pinned\"} 0".to_string(),
        "tuttid_pool_slots{state=\"Writing\"} 0".to_string(),
        "tuttid_clients 0".to_string(),
        "tuttid_leaked_queue_pairs 0".to_string(),
    ] {
        assert!(after.contains(&line), "missing {line:?} in\n{after}");
    }
    assert!(!after.contains("tuttid_errors_total{"), "{after}");

    // A report over the request's grant: refused, counted as an error, not as bytes.
    let mut liar = remote_store(&daemon.socket, "liar");
    let block_tokens = liar.hello_reply().shape.block_tokens;
    let tokens = prompt(1000, IO_BLOCKS, block_tokens);
    let prepare = Prepare { registration: liar.registration(), tokens, block_ids: (0..IO_BLOCKS as u32).collect(), first_block: 0 };
    let Reply::RetrievePrepared(prepared) = liar.client().call(&Request::PrepareRetrieve(prepare)).unwrap() else { panic!("prepare") };
    for lie in [Transferred { bytes: IO_BLOCKS as u64 * block_bytes + 4096, commands: 64 }, Transferred { bytes: 4096, commands: 0 }] {
        let release = Request::Release { handle: prepared.handle, transferred: lie, corrupt_blocks: Vec::new() };
        match liar.client().call(&release) {
            Err(DaemonError::Remote { code: ErrorCode::BadReport, message }) => assert!(message.contains("placements cover"), "{message}"),
            other => panic!("{lie:?} was not refused: {other:?}"),
        }
    }
    let release = Request::Release { handle: prepared.handle, transferred: Transferred::default(), corrupt_blocks: Vec::new() };
    assert!(matches!(liar.client().call(&release), Ok(Reply::Released)), "the request stayed the liar's, released honestly");
    // A commit of a store that reports moving less than every layer of its new blocks: refused
    // (the blocks would become visible unwritten), the reservation kept for an honest release.
    let tokens = prompt(77_001, IO_BLOCKS, block_tokens);
    let prepare = Prepare { registration: liar.registration(), tokens, block_ids: (0..IO_BLOCKS as u32).collect(), first_block: 0 };
    let Reply::StorePrepared(prepared) = liar.client().call(&Request::PrepareStore(prepare)).unwrap() else { panic!("prepare store") };
    assert_eq!(prepared.new_blocks as usize, IO_BLOCKS);
    let half = Transferred { bytes: IO_BLOCKS as u64 * block_bytes / 2, commands: 8 };
    for lie in [Transferred::default(), half] {
        let commit = Request::Commit(Commit { handle: prepared.handle, payload_crcs: None, transferred: lie });
        match liar.client().call(&commit) {
            Err(DaemonError::Remote { code: ErrorCode::BadReport, message }) => assert!(message.contains("every layer"), "{message}"),
            other => panic!("a commit reporting {lie:?} was not refused: {other:?}"),
        }
    }
    let release = Request::Release { handle: prepared.handle, transferred: Transferred::default(), corrupt_blocks: Vec::new() };
    assert!(matches!(liar.client().call(&release), Ok(Reply::Released)), "the store stayed the liar's, released");
    assert_eq!(liar.lookup(&prompt(77_001, IO_BLOCKS, block_tokens)), 0, "nothing of the unwritten store is visible");
    let after_lies = common::scrape(&metrics);
    for line in [
        "tuttid_errors_total{code=\"18\"} 4".to_string(),
        format!("tuttid_bytes_total{{direction=\"Retrieve\"}} {}", reported[0].bytes),
        "tuttid_pool_slots{state=\"Pinned\"} 0".to_string(),
    ] {
        assert!(after_lies.contains(&line), "missing {line:?} in\n{after_lies}");
    }
    let not_found = ureq::get(metrics.replace("/metrics", "/other")).call();
    assert!(matches!(not_found, Err(ureq::Error::StatusCode(404))), "{not_found:?}");
}

/// The value of the sample line starting with `name` (0 when absent).
fn counter(text: &str, name: &str) -> u64 {
    text.lines().find_map(|line| line.strip_prefix(name)).map_or(0, |value| value.trim().parse().unwrap())
}

/// Polls `status` until it lists `count` clients (bounded); returns their pids.
fn wait_for_clients(daemon: &Daemon, count: usize) -> Vec<u32> {
    let deadline = Instant::now() + WAIT;
    loop {
        let status = daemon.client().status().unwrap();
        if status.clients.len() == count {
            return status.clients.iter().map(|client| client.pid).collect();
        }
        assert!(Instant::now() < deadline, "expected {count} clients, status lists {:?}", status.clients);
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_client_killed_mid_session_leaves_nothing_behind() {
    // Goal: a client process attached and then killed with SIGKILL: its session (and, from the
    // next slice on, its pins and allocations) is released; the daemon keeps serving.
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path(), &[]);
    let mut child = spawn_child(&format!("attach {}", daemon.socket.display()));
    // The harness prints its own lines first; wait for the child's.
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    assert!(lines.any(|line| line.unwrap().contains("CHILD-ATTACHED")), "the child did not attach");
    assert_eq!(wait_for_clients(&daemon, 1), [child.id()], "the daemon names the client's pid (SO_PEERCRED)");
    child.kill().unwrap();
    child.wait().unwrap();
    wait_for_clients(&daemon, 0);
    // Earlier status connections end within a tick of their close: wait for them too.
    let deadline = Instant::now() + WAIT;
    loop {
        let status = daemon.client().status().unwrap();
        assert_eq!(status.pool.pinned_slots, 0);
        if status.connections == 1 {
            break; // only this status query
        }
        assert!(Instant::now() < deadline, "connections left behind: {}", status.connections);
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_idle_session_loses_its_lease() {
    // Goal: a client that sends nothing for the lease is ended: status drops it, and its next
    // call is refused with LeaseExpired (or finds the connection closed).
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path(), &["--lease", "400ms"]);
    let mut idle = daemon.client();
    idle.hello(&hello(0, 1, "idle")).unwrap();
    let mut busy = daemon.client();
    busy.hello(&hello(0, 1, "busy")).unwrap();
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1200) {
        busy.ping().unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let pids = wait_for_clients(&daemon, 1);
    assert_eq!(pids, [std::process::id()]);
    let error = idle.ping().unwrap_err();
    assert!(matches!(error, DaemonError::Remote { code: ErrorCode::LeaseExpired, .. } | DaemonError::Closed), "{error}");
}

#[test]
fn sigterm_drains_and_the_pool_reopens_clean() {
    // Goal: SIGTERM ends the daemon with status 0, its socket removed and its lock released;
    // an attached client is told ShuttingDown (or sees the connection closed), and a new daemon
    // opens the same pool without formatting, finding no damaged header.
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("pool.img");
    let device = format!("emu:{}", image.display());
    let daemon = Daemon::start(directory.path(), &device, &["--format", "--emu-create-bytes", "64m"]);
    let socket = daemon.socket.clone();
    let mut client = daemon.client();
    client.hello(&hello(0, 1, "engine")).unwrap();
    let (status, stderr) = daemon.terminate();
    assert!(status.success(), "{status}: {stderr}");
    assert!(stderr.contains("SIGTERM, draining") && stderr.contains("stopped after"), "{stderr}");
    assert!(!socket.exists(), "the socket file is removed");
    let error = client.ping().unwrap_err();
    assert!(matches!(error, DaemonError::Remote { code: ErrorCode::ShuttingDown, .. } | DaemonError::Closed), "{error}");

    let mut again = Daemon::start(directory.path(), &device, &[]);
    let status = again.client().status().unwrap();
    assert_eq!(status.pool.slots, status.pool.free_slots);
    let (exit, stderr) = std::mem::replace(&mut again, Daemon { child: None, socket: PathBuf::new() }).terminate();
    assert!(exit.success(), "{stderr}");
    assert!(stderr.contains("0 corrupt headers"), "{stderr}");
}

#[test]
fn status_prints_devices_pool_fill_and_clients() {
    // Goal: `tuttid --status SOCKET` names the device, the pool's slots and the attached client.
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path(), &[]);
    let mut client = daemon.client();
    client.hello(&hello(1, 2, "worker-1")).unwrap();
    let output = output_bounded(Command::new(TUTTID).arg("--status").arg(&daemon.socket));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("emu:mem:64MiB: software NVMe controller"), "{stdout}");
    assert!(stdout.contains("pool: 0 of ") && stdout.contains("slots used (0.0%)"), "{stdout}");
    assert!(stdout.contains("'worker-1': TP rank 1/2"), "{stdout}");
    assert!(stdout.contains("0 window(s), 0 queue pair(s), 0 request(s) in flight"), "{stdout}");
    assert!(stdout.contains("(0 commands refused by queue restrictions)"), "{stdout}");
    let missing = output_bounded(Command::new(TUTTID).arg("--status").arg(directory.path().join("none.sock")));
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("connecting to tuttid"));
}

#[test]
fn sigterm_drains_while_a_client_pings_without_pause() {
    // Goal: the drain does not wait on a busy client: one sending its next Ping as soon as it
    // has the answer (well within the daemon's 50 ms read tick) is answered ShuttingDown (or
    // closed) after SIGTERM, and the daemon exits 0 within a few seconds (it used to serve such
    // a client for as long as it pinged, and never finish draining).
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path(), "emu:mem:64m", &["--format"]);
    let mut client = daemon.client();
    client.hello(&hello(0, 1, "pinger")).unwrap();
    let pinger = std::thread::spawn(move || {
        let started = Instant::now();
        let mut pings = 0u64;
        // Bounded: the daemon ends the connection, or WAIT runs out.
        while started.elapsed() < WAIT {
            match client.ping() {
                Ok(()) => pings += 1,
                Err(error) => return (pings, Some(error)),
            }
        }
        (pings, None)
    });
    std::thread::sleep(Duration::from_millis(300));
    let stopping = Instant::now();
    let (status, stderr) = daemon.terminate();
    let took = stopping.elapsed();
    let (pings, ended) = pinger.join().unwrap();
    assert!(status.success(), "{status}: {stderr}");
    assert!(pings > 10, "the client pinged only {pings} times");
    assert!(took < Duration::from_secs(5), "tuttid exited {took:?} after SIGTERM");
    match ended {
        Some(DaemonError::Remote { code: ErrorCode::ShuttingDown, .. } | DaemonError::Closed | DaemonError::Truncated { .. }) => {}
        Some(DaemonError::Io { .. }) => {}
        other => panic!("the client's pings ended with {other:?}"),
    }
}
