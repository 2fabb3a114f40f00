//! Layer-wise store and retrieve bandwidth of Llama-3.1-8B blocks (16 tokens, 32 KiB objects)
//! on a file-backed software controller with the CPU executor.
//!
//! `cargo run --release -p objstore --example bandwidth -- [FILE] [BLOCKS] [K]`
//! (defaults: /tmp/objstore-bandwidth.img, 128 blocks, k = 1). One request of BLOCKS blocks in
//! consecutive engine blocks, all 32 layers, best of 3; twice in one run: plain, then with
//! payload CRCs recorded at commit and every retrieve verified (`verify_retrieves`), so the
//! cost of verification is read off the same run. FILE `mem` puts the namespace in memory
//! instead (no disk variance: what is left is the CPU cost). With k > 1 a slot holds k blocks and one
//! command moves a layer of up to k blocks (an SGL scatter list straight from the mapping table).
//! A layer's commands are submitted together (128 at k = 1, 32 at k = 4 for 128 blocks), and
//! the software controller moves the commands of one doorbell scan as one io_uring batch
//! (O_DIRECT where the filesystem allows, batches up to 4 MiB), so compare with fio at the same
//! I/O size and a deep queue (e.g. 32).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, DataPointerMode, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};
use objstore::{
    cpu_executor_for, format_pool, FormatParams, KvLayout, KvRegistration, KvRequest, KvStore, ModelGeometry, Pool, PoolTarget, StoreConfig,
};

/// One configuration's best-of-3 times.
struct Measured {
    store: Duration,
    commit: Duration,
    retrieve: Duration,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().unwrap_or_else(|| "/tmp/objstore-bandwidth.img".into()));
    let blocks: u32 = args.next().map_or(Ok(128), |a| a.parse())?;
    let k: u32 = args.next().map_or(Ok(1), |a| a.parse())?;
    let geometry = ModelGeometry::llama3_8b(16);
    let total = f64::from(blocks) * geometry.block_bytes() as f64;
    let mut results = Vec::new();
    // Same run, same file: plain, then with payload CRCs recorded at commit and every retrieve
    // verified against them (the CPU reads the retrieved bytes once more).
    for verify in [false, true] {
        let (measured, command_bytes, commands_per_layer) = run(&path, blocks, k, geometry, verify)?;
        println!(
            "{blocks} blocks x {} MiB, k = {k} ({} KiB per command, {commands_per_layer} commands per layer), payload CRC + verified retrieve {}, file {}:\n  store    {:.2} GB/s ({:?}), commit {:?}\n  retrieve {:.2} GB/s ({:?})",
            geometry.block_bytes() >> 20,
            command_bytes >> 10,
            if verify { "on" } else { "off" },
            path.display(),
            total / measured.store.as_secs_f64() / 1e9,
            measured.store,
            measured.commit,
            total / measured.retrieve.as_secs_f64() / 1e9,
            measured.retrieve,
        );
        results.push(measured);
    }
    let ratio = |on: Duration, off: Duration| on.as_secs_f64() / off.as_secs_f64();
    println!(
        "verified / plain time: retrieve {:.2}x, store + commit {:.2}x",
        ratio(results[1].retrieve, results[0].retrieve),
        ratio(results[1].store + results[1].commit, results[0].store + results[0].commit)
    );
    std::fs::remove_file(&path).ok();
    Ok(())
}

/// Formats a pool on `path`, stores and retrieves `blocks` blocks 3 times, keeps the best
/// times; returns them with the largest command and the commands of one layer.
fn run(
    path: &Path,
    blocks: u32,
    k: u32,
    geometry: ModelGeometry,
    verify: bool,
) -> Result<(Measured, u64, u64), Box<dyn std::error::Error>> {
    let slots = u64::from(blocks.div_ceil(k));
    let bytes = slots * u64::from(k) * geometry.block_bytes() + (16 << 20);
    // `mem`: a memory-backed controller, for the CPU cost without the disk's variance.
    let backing = if path == Path::new("mem") {
        Backing::Memory { bytes }
    } else {
        Backing::File { path: path.to_path_buf(), create_bytes: Some(bytes) }
    };
    let mut config = EmuConfig::default()
        .with_backing(backing)
        .with_namespaces(vec![NamespaceConfig::new(4096, None)])
        .with_mdts(9)
        .with_volatile_write_cache(false);
    config.idle_sleep_max = Duration::from_micros(20);
    let device = EmuDevice::start(config)?;
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Arc::new(Controller::init(backend, ControllerConfig::default())?);
    let targets = vec![PoolTarget { controller: controller.clone(), namespace: NamespaceId(1) }];
    format_pool(
        &targets,
        &FormatParams { blocks_per_slot: k, slot_count_max: Some(slots), payload_crc: verify, ..FormatParams::new(geometry) },
    )?;
    let (pool, _) = Pool::open(targets, Some(&geometry))?;
    let tensor = (geometry.object_bytes() * u64::from(blocks)) as usize;
    let engine: Vec<_> = (0..2 * geometry.layers).map(|_| controller.dma().allocate(tensor)).collect::<Result<_, _>>()?;
    for (i, region) in engine.iter().enumerate() {
        region.fill(0, tensor, i as u8)?;
    }
    let layout = KvLayout::SeparateKv {
        key_bases: engine.iter().step_by(2).map(|r| r.iova()).collect(),
        value_bases: engine.iter().skip(1).step_by(2).map(|r| r.iova()).collect(),
        block_stride_bytes: geometry.object_bytes(),
    };
    let registration = KvRegistration::new(geometry, blocks, layout, DataPointerMode::Sgl)?;
    let store_config = StoreConfig { verify_retrieves: verify, ..StoreConfig::default() };
    let executor = cpu_executor_for(&pool, 1024, &store_config)?;
    let mut store = KvStore::new(pool, registration, controller.dma().clone(), executor, store_config)?;
    let ids: Vec<u32> = (0..blocks).collect();
    let deadline = || Instant::now() + Duration::from_secs(60);
    let mut best = Measured { store: Duration::MAX, commit: Duration::MAX, retrieve: Duration::MAX };
    for round in 0..3u32 {
        let tokens: Vec<u32> = (0..16 * blocks).map(|t| t ^ (round << 24)).collect();
        let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &ids })?;
        let started = Instant::now();
        for layer in 0..geometry.layers {
            store.store_layer(plan.handle, layer, SmBudget(1))?;
            store.wait(plan.handle, deadline())?;
        }
        best.store = best.store.min(started.elapsed());
        let started = Instant::now();
        store.commit_store(plan.handle)?;
        best.commit = best.commit.min(started.elapsed());
        let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &ids })?;
        let started = Instant::now();
        for layer in 0..geometry.layers {
            store.retrieve_layer(handle, layer, SmBudget(1))?;
            store.wait(handle, deadline())?;
        }
        best.retrieve = best.retrieve.min(started.elapsed());
        store.finish(handle)?;
    }
    let table = store.table();
    let runs = if table.form() == objstore::MappingForm::SglTable { blocks.div_ceil(k) } else { blocks };
    let commands_per_layer = u64::from(runs) * table.commands_per_run(if table.form() == objstore::MappingForm::SglTable { k } else { 1 });
    let command_bytes = table.command_bytes_max();
    drop(store);
    Ok((best, command_bytes, commands_per_layer))
}
