//! A pool's devices given to a restarted tuttid in another order than at format (as
//! `/dev/nvmeXn1` names swap across boots): the pool puts them in the order its superblocks
//! record, and the daemon's per-device state (each software controller's register page and queue
//! restrictions, the status it reports) must follow that order, not the command line's. The
//! daemon is the `tuttid` binary over two `emu:PATH` files; this test process is its client.

mod common;
use common::{hello, retrieve_prompt, store_prompt, Daemon};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};

const BLOCKS: usize = 4;

fn attach(daemon: &Daemon, name: &str) -> RemoteKvStore {
    let config = RemoteConfig { kv_blocks: 2 * BLOCKS as u32, ..RemoteConfig::default() };
    RemoteKvStore::connect(&daemon.socket, &hello(0, 1, name), &config).expect("attach a remote store")
}

#[test]
fn devices_given_in_another_order_after_a_restart_serve_the_pool() {
    // Goal: after a pool formatted on `emu:A --device emu:B` is reopened with the devices given
    // as `emu:B --device emu:A`, a client attaches (its queue pair on pool device i is restricted
    // on device i's controller), the prompt stored before the restart and a new one are
    // retrieved byte-exact, and status lists the devices in pool order: device 0 is A.
    let directory = tempfile::tempdir().unwrap();
    let a = format!("emu:{}", directory.path().join("a.img").display());
    let b = format!("emu:{}", directory.path().join("b.img").display());

    let daemon = Daemon::start(directory.path(), &a, &["--device", &b, "--format", "--emu-create-bytes", "64m"]);
    let mut writer = attach(&daemon, "before");
    assert_eq!(store_prompt(&mut writer, 1, 0, BLOCKS).unwrap(), BLOCKS);
    drop(writer);
    let (status, stderr) = daemon.terminate();
    assert!(status.success(), "{status}: {stderr}");

    let daemon = Daemon::start(directory.path(), &b, &["--device", &a]);
    let mut client = attach(&daemon, "after");
    assert_eq!(retrieve_prompt(&mut client, 1, 0, BLOCKS).unwrap(), 0, "the prompt stored before the restart");
    assert_eq!(store_prompt(&mut client, 2, 0, BLOCKS).unwrap(), BLOCKS);
    assert_eq!(retrieve_prompt(&mut client, 2, 0, BLOCKS).unwrap(), 0, "the prompt stored after the restart");
    let devices: Vec<String> = daemon.client().status().unwrap().devices.into_iter().map(|device| device.spec).collect();
    assert_eq!(devices, [a, b], "status lists the devices in the pool's order");
}
