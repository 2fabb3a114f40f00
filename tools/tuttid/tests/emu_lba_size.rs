//! tuttid on an `emu:` pool formatted with another LBA size than the 4096 bytes its software
//! controllers run with (it has no `--emu-lba-bytes`): refused at start, exit 2, saying that
//! tuttid serves only 4096-byte `emu:` pools and how to make one.

use std::process::Command;

use objstore::{FormatParams, ModelGeometry};
use tutti_daemon::pool_open::{open_pool, PoolOptions};
use tutti_devices::{DeviceKind, DeviceSpec};

mod common;
use common::{run_bounded, TUTTID};

#[test]
fn an_emu_pool_of_512_byte_lbas_is_refused_saying_tuttid_serves_4096_byte_ones() {
    // Goal: a pool made by `tutti pool format --emu-lba-bytes 512` (formatted here through the
    // same library, as a file of 512-byte LBAs) is refused by tuttid with exit 2 and a message
    // that names the cause: tuttid runs emu: devices with 4096-byte LBAs only. It used to say
    // only that the superblock records 512-byte LBAs and the namespace has 4096-byte ones, as
    // if the device were at fault.
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("pool.img");
    let device = format!("emu:{}", image.display());
    let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
    let options = PoolOptions {
        specs: vec![DeviceSpec::parse(&device, &DeviceKind::ALL).unwrap()],
        namespace: 1,
        emu_lba_bytes: 512,
        emu_create_bytes: Some(64 << 20),
        format: Some(FormatParams::new(geometry)),
        overwrite: false,
        lock_dir: directory.path().join("locks"),
        client_queue_pairs: 1,
        emu_doorbell_relay: false,
    };
    drop(open_pool(&options).expect("format a pool of 512-byte LBAs"));
    let socket = directory.path().join("tuttid.sock");
    let mut command = Command::new(TUTTID);
    command.args(["--device", &device, "--socket"]).arg(&socket);
    command.arg("--lock-dir").arg(directory.path().join("locks"));
    command.args(["--metrics", "off"]);
    let (code, stderr) = run_bounded(&mut command);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("the superblock records 512-byte LBAs"), "{stderr}");
    assert!(stderr.contains("tuttid serves only emu: pools of 4096-byte LBAs"), "{stderr}");
    assert!(stderr.contains("--emu-lba-bytes 4096"), "{stderr}");
    assert!(!socket.exists(), "the refused daemon left its socket file: {stderr}");
}
