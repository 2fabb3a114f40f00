//! Crash safety: the software controller loses power (its volatile write cache is dropped, or
//! in every other iteration partly written back first, see `cut_power`) at
//! seeded random points during stores — at the Nth I/O command (data write, flush or header
//! write, by making the controller fail fatally there) or between API calls — and the pool is
//! reopened. Invariants after every crash:
//! - a reopened pool never returns a block whose bytes differ from what was stored for its key;
//! - every block visible before the crash (committed, not evicted) is still there;
//! - interrupted blocks are absent (they fail the first invariant otherwise);
//! - every Valid slot's payload matches the CRCs its header records (`check_payloads`).
//!
//! It runs on four pool layouts: k = 1 and k = 4 blocks per slot, each on one namespace and
//! striped over two controllers in one DMA space (a cut then takes both; a fault hits one).
//!
//! A second test cuts the power between the two header sectors one commit writes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::{Controller, DataPointerMode};
use nvme_emu::{EmuDevice, FaultAction, FaultPlan, FaultRule, NamespaceConfig, PowerLossMode};
use objstore::{cpu_executor_for, KvRequest, KvStore, Pool, StoreConfig};
use tutti_tests::*;

/// Iterations of the original layout (k = 1, one namespace), which this test ran alone before
/// the other three came: its fault points stay as many (and its seeds the same).
const ITERATIONS_FIRST_LAYOUT: u64 = 150;
/// Iterations of each of the other three layouts (the test runs in every CI).
const ITERATIONS: u64 = 30;
const ENGINE_BLOCKS: u32 = 16;
/// Short deadlines while the power may go: a wait on a dead controller ends quickly.
const CRASH_TIMEOUT: Duration = Duration::from_millis(40);

/// Brings the controller up with a short admin timeout (dropping queue pairs of a dead
/// controller waits it out once), retrying with a long one if the machine is too busy.
fn bring_up_fast(device: &Arc<EmuDevice>) -> Arc<Controller> {
    // Never fall back to a long timeout: a controller that dies later would make its drop wait
    // it out. Tries grow from 25 to 400 ms.
    for attempt in 0..5 {
        let backend: Arc<dyn nvme_driver::DeviceBackend> = device.clone();
        let config = nvme_driver::ControllerConfig { admin_timeout: Duration::from_millis(25 << attempt), ..Default::default() };
        if let Ok(controller) = Controller::init(backend, config) {
            return Arc::new(controller);
        }
    }
    panic!("the software controller did not come up with a 400 ms admin timeout");
}

/// The pool over namespace 1 of every controller, in order.
fn pool_targets(controllers: &[Arc<Controller>]) -> Vec<objstore::PoolTarget> {
    controllers.iter().flat_map(|controller| targets(controller, &[1])).collect()
}

fn open(controllers: &[Arc<Controller>], engine: &Engine, metadata_timeout: Duration) -> objstore::Result<KvStore<gio_uring::CpuExecutor>> {
    let (pool, _) = Pool::open(pool_targets(controllers), Some(&geometry()))?;
    store_over(pool, engine, metadata_timeout)
}

fn store_over(mut pool: Pool, engine: &Engine, metadata_timeout: Duration) -> objstore::Result<KvStore<gio_uring::CpuExecutor>> {
    pool.set_metadata_timeout(metadata_timeout);
    let config = StoreConfig { iocbs: 16, ioctx_per_iocb_max: 64, requests_max: 4, ..StoreConfig::default() };
    let executor = cpu_executor_for(&pool, 256, &config)?;
    KvStore::new(pool, engine.registration.clone(), engine.dma.clone(), executor, config)
}

/// One store, step by step; `budget` counts API steps down to a power cut between calls.
fn try_store(
    store: &mut KvStore<gio_uring::CpuExecutor>,
    engine: &Engine,
    tokens: &[u32],
    blocks: &[u32],
    steps: &mut u64,
) -> Result<(), String> {
    let keys = keys_of(tokens);
    for (i, &block) in blocks.iter().enumerate() {
        engine.fill(block, keys[i]);
    }
    let mut step = || -> Result<(), String> {
        if *steps == 0 {
            return Err("power cut between calls".into());
        }
        *steps -= 1;
        Ok(())
    };
    step()?;
    let plan = store.prepare_store(&KvRequest { tokens, block_ids: blocks }).map_err(|e| e.to_string())?;
    for layer in 0..geometry().layers {
        step()?;
        store.store_layer(plan.handle, layer, BUDGET).map_err(|e| e.to_string())?;
        step()?;
        store.wait(plan.handle, Instant::now() + CRASH_TIMEOUT).map_err(|e| e.to_string())?;
    }
    step()?;
    store.commit_store(plan.handle).map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn power_loss_during_stores_never_returns_wrong_bytes() {
    for (layout, (k, controllers)) in [(1, 1), (4, 1), (1, 2), (4, 2)].into_iter().enumerate() {
        let iterations = if layout == 0 { ITERATIONS_FIRST_LAYOUT } else { ITERATIONS };
        power_loss_during_stores(layout as u64, k, controllers, iterations);
    }
}

/// Cuts the power of every controller. In every other iteration each controller's volatile
/// write cache first writes back a pseudorandom subset of its dirty blocks (seeded per layout,
/// iteration and controller), as a real drive's may have in any order before the cut: a pool
/// that relies on the order of two writes with no Flush between them (a payload before the
/// header naming it, an Empty header before a slot's reuse) fails the checks then, where
/// losing the whole cache, as the other iterations do, cannot show it. Chosen from the
/// iteration, not drawn from its `Rng`, so every iteration's fault points stay as they were.
fn cut_power(devices: &[Arc<EmuDevice>], layout: u64, iteration: u64) {
    for (index, device) in devices.iter().enumerate() {
        if iteration.is_multiple_of(2) {
            device.power_loss();
        } else {
            device.power_loss_with(PowerLossMode::PartialWriteBack { seed: (layout << 56) ^ (iteration << 8) ^ index as u64 });
        }
    }
}

/// The crash loop on a pool of `k` blocks per slot over namespace 1 of `controllers` software
/// controllers (started in one DMA space), `iterations` crashes.
fn power_loss_during_stores(layout: u64, k: u32, controllers: usize, iterations: u64) {
    let started = Instant::now();
    let config = || device_config(vec![NamespaceConfig::new(512, None)], 4 << 20, true);
    let first = start_device(vec![NamespaceConfig::new(512, None)], 4 << 20, true);
    let mut devices = vec![first.clone()];
    for _ in 1..controllers {
        devices.push(EmuDevice::start_in(config(), &first.dma_pool()).expect("software controller"));
    }
    let bring_up_all = |fast: bool| -> Vec<Arc<Controller>> {
        devices.iter().map(|device| if fast { bring_up_fast(device) } else { bring_up(device, Duration::from_secs(5)) }).collect()
    };
    // Small, so evictions happen all the time. k = 1: 24 slots of 64-byte headers span three
    // 512-byte LBAs, so a commit or an eviction often writes several header sectors, and a
    // cut can fall between them; k = 4: 8 slots of 4 blocks.
    let slots = if k == 1 { 24 } else { 8 };
    format(&pool_targets(&bring_up_all(false)), k, Some(slots));
    let label = format!("k = {k}, {controllers} controller(s)");
    let mut known: Vec<Vec<u32>> = Vec::new();
    let mut phases = [Duration::ZERO; 3];
    let (mut crashes_by_fault, mut crashes_between_calls, mut verified_blocks, mut verified_slots, mut skipped) = (0, 0, 0, 0, 0);
    for iteration in 0..iterations {
        let mut rng = Rng(0xC0FFEE ^ iteration.wrapping_mul(0x9E37) ^ (layout << 56));
        let phase = Instant::now();
        // --- workload, until the power goes ---
        let controllers = bring_up_all(true);
        let engine = separate_kv(controllers[0].dma(), ENGINE_BLOCKS, DataPointerMode::Sgl);
        // With a 25 ms admin timeout a busy machine can fail the open: that iteration then
        // just cuts the power on an idle pool (the checks below still run).
        let Ok(mut store) = open(&controllers, &engine, CRASH_TIMEOUT) else {
            skipped += 1;
            cut_power(&devices, layout, iteration);
            drop(engine);
            drop(controllers);
            continue;
        };
        let by_fault = rng.below(2) == 0;
        let mut steps = if by_fault { u64::MAX } else { rng.below(30) };
        if by_fault {
            let nth = 1 + rng.below(60);
            let victim = rng.below(devices.len() as u64) as usize;
            devices[victim].set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(nth, FaultAction::ControllerFatal)));
        }
        for _ in 0..6 {
            let share = !known.is_empty() && rng.below(3) == 0;
            let mut tokens = if share { known[rng.below(known.len() as u64) as usize][..16].to_vec() } else { Vec::new() };
            let extra = 1 + rng.below(3) as usize;
            tokens.extend(rng.tokens(16 * extra));
            let n = tokens.len() / 16;
            let first = rng.below(u64::from(ENGINE_BLOCKS) - n as u64) as u32;
            let blocks: Vec<u32> = (first..first + n as u32).collect();
            known.push(tokens.clone());
            if try_store(&mut store, &engine, &tokens, &blocks, &mut steps).is_err() {
                break;
            }
        }
        if known.len() > 48 {
            known.drain(..known.len() - 48);
        }
        let visible_before: Vec<usize> = known.iter().map(|tokens| store.lookup(tokens)).collect();
        phases[0] += phase.elapsed();
        let phase = Instant::now();
        if by_fault {
            // The controllers are dead: dropping the store waits out one admin timeout per
            // controller (deleting queue pairs); the pool writes no staged header to a
            // controller that reads not ready or fatal.
            cut_power(&devices, layout, iteration);
            drop(store);
            crashes_by_fault += 1;
        } else {
            // Queue pairs go while the controllers still answer (I/O may still be in flight),
            // then the power.
            drop(store);
            cut_power(&devices, layout, iteration);
            crashes_between_calls += 1;
        }
        devices.iter().for_each(|device| device.set_faults(FaultPlan::none()));
        phases[1] += phase.elapsed();
        let phase = Instant::now();
        drop(engine);
        drop(controllers);
        // --- recovery and checks ---
        let controllers = bring_up_all(false);
        let engine = separate_kv(controllers[0].dma(), ENGINE_BLOCKS, DataPointerMode::Sgl);
        let (mut pool, _) = Pool::open(pool_targets(&controllers), Some(&geometry())).expect("open after the crash");
        let (slots_checked, bad) = pool.check_payloads(Instant::now() + Duration::from_secs(30)).expect("payload check");
        assert!(bad.is_empty(), "{label}, iteration {iteration}: slots whose payload differs from their recorded CRCs: {bad:?}");
        verified_slots += slots_checked;
        let mut store = store_over(pool, &engine, Duration::from_secs(5)).expect("a store over the reopened pool");
        for (r, tokens) in known.iter().enumerate() {
            let cached = store.lookup(tokens);
            assert!(
                cached >= visible_before[r],
                "{label}, iteration {iteration}: request {r} had {} blocks visible before the crash, {cached} after",
                visible_before[r]
            );
            if cached == 0 {
                continue;
            }
            let blocks: Vec<u32> = (0..cached as u32).map(|i| ENGINE_BLOCKS - 1 - i).collect();
            retrieve(&mut store, &engine, tokens, &blocks);
            let keys = keys_of(tokens);
            for (i, &block) in blocks.iter().enumerate() {
                assert!(
                    engine.holds(block, keys[i], geometry().layers),
                    "{label}, iteration {iteration}: request {r} block {i} came back with other bytes"
                );
                verified_blocks += 1;
            }
        }
        phases[2] += phase.elapsed();
    }
    eprintln!("{label}: workload {:?}, power cut and drop {:?}, recovery and checks {:?}", phases[0], phases[1], phases[2]);
    eprintln!(
        "{label}: {iterations} iterations ({crashes_by_fault} at a random I/O command, {crashes_between_calls} between calls, {skipped} \
         before any I/O), {verified_blocks} blocks verified, {verified_slots} slots' payload CRCs checked, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(crashes_by_fault > 0 && crashes_between_calls > 0 && verified_blocks > 0 && verified_slots > 0, "{label}");
    assert!(skipped < iterations / 4, "{label}: {skipped} iterations could not even open the pool");
}

#[test]
fn power_loss_between_the_header_sectors_of_one_commit() {
    // Goal: a commit whose two slots' headers lie in distant LBAs writes them as separate FUA
    // commands (only the dirty sectors); the power going after the first leaves that block
    // visible and the other absent (its slot reads Empty, made so before its data was
    // written), never a Valid header over other bytes; every other committed block survives.
    let device = start_device(vec![NamespaceConfig::new(512, None)], 2 << 20, true);
    {
        let controller = bring_up(&device, Duration::from_secs(5));
        format(&targets(&controller, &[1]), 1, Some(24)); // header LBAs: slots 0-7, 8-15, 16-23
    }
    let controller = bring_up_fast(&device);
    let engine = separate_kv(controller.dma(), ENGINE_BLOCKS, DataPointerMode::Sgl);
    // Three seconds, not CRASH_TIMEOUT: the 24 stores below must not time out on a loaded
    // machine (a 40 ms header write did once, and with 1 s a store failed at load average 8);
    // only the dying commit waits it out.
    let mut store = open(std::slice::from_ref(&controller), &engine, Duration::from_secs(3)).expect("open");
    let mut rng = Rng(0x5EC7_0125);
    let requests: Vec<Vec<u32>> = (0..24).map(|_| rng.tokens(16)).collect();
    for (r, tokens) in requests.iter().enumerate() {
        let mut steps = u64::MAX;
        try_store(&mut store, &engine, tokens, &[r as u32 % ENGINE_BLOCKS], &mut steps).expect("store");
    }
    // Every slot is full, in order. Use all but requests 1 and 20: their slots (header LBAs 0
    // and 2) become the least recently used, the two a new 2-block store evicts.
    for (r, tokens) in requests.iter().enumerate().filter(|(r, _)| *r != 1 && *r != 20) {
        assert_eq!(store.lookup(tokens), 1, "request {r}");
        retrieve(&mut store, &engine, tokens, &[ENGINE_BLOCKS - 1]);
    }
    let new = rng.tokens(32);
    let keys = keys_of(&new);
    engine.fill(0, keys[0]);
    engine.fill(1, keys[1]);
    let plan = store.prepare_store(&KvRequest { tokens: &new, block_ids: &[0, 1] }).expect("prepare_store");
    assert_eq!(plan.evicted_slots, 2);
    for layer in 0..geometry().layers {
        store.store_layer(plan.handle, layer, BUDGET).unwrap();
        store.wait(plan.handle, Instant::now() + Duration::from_secs(5)).unwrap();
    }
    // The commit flushes, then writes header LBA 0 (block 0, slot 1) and LBA 2 (block 1,
    // slot 20): the controller dies on the second header write.
    let second_write = FaultRule::on_nth_io(2, FaultAction::ControllerFatal).with_opcode(nvme_driver::spec::NvmOpcode::Write as u8);
    device.set_faults(FaultPlan::none().with_rule(second_write));
    assert!(store.commit_store(plan.handle).is_err(), "the controller died during the commit");
    device.power_loss();
    drop(store);
    device.set_faults(FaultPlan::none());
    drop(engine);
    drop(controller);
    let controller = bring_up(&device, Duration::from_secs(5));
    let engine = separate_kv(controller.dma(), ENGINE_BLOCKS, DataPointerMode::Sgl);
    let mut store = open(std::slice::from_ref(&controller), &engine, Duration::from_secs(5)).expect("open after the cut");
    assert_eq!(store.lookup(&new), 1, "block 0's header reached the disk, block 1's did not");
    retrieve(&mut store, &engine, &new, &[2]);
    assert!(engine.holds(2, keys[0], geometry().layers), "block 0 came back with other bytes");
    for (r, tokens) in requests.iter().enumerate() {
        let expected = usize::from(r != 1 && r != 20);
        assert_eq!(store.lookup(tokens), expected, "request {r}");
        if expected == 1 {
            retrieve(&mut store, &engine, tokens, &[3]);
            assert!(engine.holds(3, keys_of(tokens)[0], geometry().layers), "request {r} came back with other bytes");
        }
    }
    assert_eq!(store.pool().index().counts().valid_slots, 23);
}
