//! The object store under controller limits and faults found by review (issue 17): small
//! CAP.MQES, shallow lent queues, metadata commands that time out, verified retrieves that
//! fail, stores dropped with queue pairs that could not be deleted.

use std::time::Duration;

use nvme_driver::DataPointerMode;
use nvme_emu::NamespaceConfig;
use objstore::StoreConfig;
use tutti_tests::*;

#[test]
fn a_controller_with_a_small_mqes_is_served() {
    // Goal: on a controller whose CAP.MQES allows 16 entries per queue, format, open (metadata
    // queues of 64 asked for), the CPU executor (256 asked for) and a store/retrieve round trip
    // all work at the depth the controller allows; they used to fail with InvalidQueueDepth.
    let device = nvme_emu::EmuDevice::start(device_config(vec![NamespaceConfig::new(512, None)], 8 << 20, true).with_max_queue_entries(16))
        .expect("software controller");
    let controller = bring_up(&device, Duration::from_secs(5));
    assert_eq!(controller.max_queue_depth(), 16);
    format(&targets(&controller, &[1]), 1, Some(16));
    let engine = separate_kv(controller.dma(), 8, DataPointerMode::Sgl);
    let mut kv = open_store(targets(&controller, &[1]), &engine, StoreConfig::default());
    let tokens = Rng(20).tokens(32);
    store(&mut kv, &engine, &tokens, &[0, 1]);
    retrieve(&mut kv, &engine, &tokens, &[2, 3]);
    let keys = keys_of(&tokens);
    assert!(engine.holds(2, keys[0], 4) && engine.holds(3, keys[1], 4));
}
