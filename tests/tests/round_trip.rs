//! Round trip on the software controller with the CPU executor: store random KV for many
//! requests layer by layer, reopen the pool, retrieve (verified against the payload CRCs) into
//! different engine blocks, compare.

use std::time::Duration;

use nvme_driver::DataPointerMode;
use nvme_emu::NamespaceConfig;
use objstore::StoreConfig;
use tutti_tests::*;

/// How the engine's KV memory is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    SeparateKv,
    BlockMajor,
    /// One tensor per layer, K and V of a block in one run; irregular or equally spaced bases.
    PagedPerLayer {
        equal_spacing: bool,
    },
}

fn round_trip(k: u32, sgl: bool, layout: Layout, namespaces: &[u32]) {
    round_trip_with(k, sgl, layout, namespaces, false, namespaces);
}

/// `reopen_order`: the same namespaces, in the order the pool is given them when it is reopened
/// for the retrieves (formatted and stored in the order of `namespaces`).
fn round_trip_with(k: u32, sgl: bool, layout: Layout, namespaces: &[u32], workers: bool, reopen_order: &[u32]) {
    let ns_configs = namespaces.iter().map(|_| NamespaceConfig::new(512, Some(8 << 20))).collect();
    let device = start_device(ns_configs, (8 << 20) * namespaces.len() as u64, sgl);
    let controller = bring_up(&device, Duration::from_secs(5));
    format(&targets(&controller, namespaces), k, None);
    let mode = if sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp };
    let engine = match layout {
        Layout::SeparateKv => separate_kv(controller.dma(), 64, mode),
        Layout::BlockMajor => block_major(controller.dma(), 64, mode),
        Layout::PagedPerLayer { equal_spacing } => paged_per_layer(controller.dma(), 64, mode, equal_spacing),
    };
    let major = layout != Layout::SeparateKv;
    let mut rng = Rng(u64::from(k) * 7 + u64::from(sgl) + 31 * u64::from(major));
    let requests: Vec<Vec<u32>> = (0..12).map(|r| rng.tokens(16 * (1 + r % 5) + 5)).collect();
    {
        // Stored with one executor, read back after the reopen with the other.
        let mut kv = open_store(targets(&controller, namespaces), &engine, StoreConfig::default());
        if workers {
            drop(kv);
            let mut threaded = open_store_workers(targets(&controller, namespaces), &engine, StoreConfig::default());
            for (r, tokens) in requests.iter().enumerate() {
                let n = tokens.len() / 16;
                let blocks: Vec<u32> = (0..n as u32).map(|i| if r % 2 == 0 { i } else { 63 - 3 * i }).collect();
                store(&mut threaded, &engine, tokens, &blocks);
            }
            drop(threaded);
            kv = open_store(targets(&controller, namespaces), &engine, StoreConfig::default());
        }
        for (r, tokens) in requests.iter().enumerate().filter(|_| !workers) {
            let n = tokens.len() / 16;
            // Consecutive engine blocks for some requests (exercises merged runs), scattered for others.
            let blocks: Vec<u32> = (0..n as u32).map(|i| if r % 2 == 0 { i } else { 63 - 3 * i }).collect();
            let plan = store(&mut kv, &engine, tokens, &blocks);
            assert_eq!(plan.new_blocks, n, "request {r}: {plan:?}");
        }
        assert_eq!(kv.counts().cached_blocks, requests.iter().map(|t| (t.len() / 16) as u64).sum::<u64>());
    }
    // Reopen: the index comes back from the slot headers alone. Every retrieve is verified
    // against the per-block payload CRCs recorded at commit.
    let verified = StoreConfig { verify_retrieves: true, ..StoreConfig::default() };
    let mut kv = open_store(targets(&controller, reopen_order), &engine, verified);
    for tokens in &requests {
        let n = tokens.len() / 16;
        assert_eq!(kv.lookup(tokens), n);
        let blocks: Vec<u32> = (0..n as u32).map(|i| 10 + 5 * i).collect();
        retrieve(&mut kv, &engine, tokens, &blocks);
        let keys = keys_of(tokens);
        for (i, &block) in blocks.iter().enumerate() {
            assert!(engine.holds(block, keys[i], geometry().layers), "request block {i} (k={k}, sgl={sgl}, {layout:?}) differs");
        }
    }
    // Payload CRCs recorded at commit match what is on disk.
    let mut pool = kv.into_pool();
    let (verified, bad) = pool.check_payloads(deadline()).unwrap();
    assert!(verified > 0);
    assert!(bad.is_empty(), "payload CRC mismatches: {bad:?}");
}

#[test]
fn separate_kv_sgl_one_block_per_slot() {
    round_trip(1, true, Layout::SeparateKv, &[1]);
}

#[test]
fn separate_kv_sgl_four_blocks_per_slot() {
    round_trip(4, true, Layout::SeparateKv, &[1]);
}

#[test]
fn block_major_sgl_inline() {
    round_trip(1, true, Layout::BlockMajor, &[1]);
}

#[test]
fn block_major_prp_lists() {
    round_trip(2, false, Layout::BlockMajor, &[1]);
}

#[test]
fn paged_per_layer_sgl_table() {
    // Goal: vLLM 0.32's layout (a layer's block is one run holding K and V) round-trips with
    // layers allocated apart (irregular bases: one SGL descriptor per half-block).
    round_trip(1, true, Layout::PagedPerLayer { equal_spacing: false }, &[1]);
}

#[test]
fn paged_per_layer_collapsed() {
    // Goal: the same with the layers equally spaced in one allocation: the mapping collapses
    // to base + strides and one command moves a layer's K and V together (SGL, then PRP lists).
    round_trip(2, true, Layout::PagedPerLayer { equal_spacing: true }, &[1]);
    round_trip(1, false, Layout::PagedPerLayer { equal_spacing: true }, &[1]);
}

#[test]
fn several_devices_round_robin() {
    // Goal: three namespaces form one pool; blocks spread over all of them; order of the
    // targets at open does not matter (devices are ordered by their recorded index): reopened
    // in the order given at format, and in two other orders.
    for reopen_order in [[1, 2, 3], [3, 1, 2], [2, 3, 1]] {
        round_trip_with(1, true, Layout::SeparateKv, &[1, 2, 3], false, &reopen_order);
    }
}

#[test]
fn several_devices_with_worker_threads() {
    // Goal: the same pool format and API under the threaded CPU executor (one worker per device).
    round_trip_with(1, true, Layout::SeparateKv, &[1, 2], true, &[1, 2]);
}
