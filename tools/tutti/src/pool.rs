//! `tutti pool format|inspect|check`: create, describe and verify an object-store pool
//! (crates/objstore, format in docs/objstore.md) on one or more NVMe namespaces.
//!
//! A device is `vfio:<PCI address>` (a function bound to vfio-pci) or `emu:<file>` (the software
//! controller over a regular file, created with `--emu-create-bytes`; useful for tests and
//! benchmarks on machines without a spare SSD). Devices are listed in pool order for `format`;
//! `inspect` and `check` take them in any order.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use nvme_driver::hw::vfio::{PciAddress, VfioOptions};
use nvme_driver::hw::{DeviceBackend, DmaPool, VfioDevice};
use nvme_driver::{Controller, ControllerConfig, NamespaceId};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};
use objstore::format::Superblock;
use objstore::pool::{format_uuid, read_superblock};
use objstore::{format_pool, FormatParams, ModelGeometry, Pool, PoolTarget};

#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// A pool member: `vfio:0000:01:00.0` or `emu:/path/to/file`. Repeat for several devices.
    #[arg(long = "device", required = true)]
    devices: Vec<String>,
    /// Namespace id on every device.
    #[arg(long, default_value_t = 1)]
    namespace: u32,
    /// LBA size of an `emu:` device's namespace.
    #[arg(long, default_value_t = 4096)]
    emu_lba_bytes: u32,
    /// Create (or grow) `emu:` files to this many bytes.
    #[arg(long)]
    emu_create_bytes: Option<u64>,
}

#[derive(clap::Subcommand, Debug)]
pub enum PoolCommand {
    /// Write a fresh pool (superblock and empty slot headers) on the devices, in pool order.
    Format(FormatArgs),
    /// Print each device's superblock and the slot counts found by recovery.
    Inspect(DeviceArgs),
    /// Verify every slot header (and, with --payload, every recorded payload CRC); exits
    /// non-zero if anything is damaged.
    Check(CheckArgs),
}

#[derive(Args, Debug)]
pub struct FormatArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    /// Model preset: llama3-8b, qwen3-32b, llama3-70b.
    #[arg(long)]
    model: String,
    /// Tokens per engine block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    /// Engine blocks per slot (k).
    #[arg(long, default_value_t = 1)]
    blocks_per_slot: u32,
    /// At most this many slots per device (default: as many as fit).
    #[arg(long)]
    slots: Option<u64>,
    /// Record a CRC32 of every slot's payload at commit.
    #[arg(long)]
    payload_crc: bool,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    /// Also read back every slot that records a payload CRC and compare.
    #[arg(long)]
    payload: bool,
}

/// Opens the pool's devices in one DMA space, as a store over them needs: every `vfio:` device
/// in one VFIO container (which also lets two functions of one IOMMU group be used), every
/// `emu:` controller in the first one's DMA pool.
fn open_targets(args: &DeviceArgs) -> Result<Vec<PoolTarget>> {
    let mut addresses = Vec::new();
    for spec in &args.devices {
        if let Some(address) = spec.strip_prefix("vfio:") {
            addresses.push(address.parse::<PciAddress>().with_context(|| format!("device {spec:?}"))?);
        } else if !spec.starts_with("emu:") {
            bail!("device {spec:?}: expected vfio:<PCI address> or emu:<file>");
        }
    }
    let listed = addresses.iter().map(ToString::to_string).collect::<Vec<_>>().join(" ");
    let mut vfio = VfioDevice::open_many(&addresses, &VfioOptions::default())
        .with_context(|| format!("opening {listed} through VFIO (are they bound? `tutti bind ADDRESS`)"))?
        .into_iter();
    let mut emu_space: Option<DmaPool> = None;
    let mut targets = Vec::with_capacity(args.devices.len());
    for spec in &args.devices {
        let backend: Arc<dyn DeviceBackend> = if spec.starts_with("vfio:") {
            Arc::new(vfio.next().expect("one opened device per vfio: spec"))
        } else {
            let path = spec.strip_prefix("emu:").expect("checked above");
            let mut config = EmuConfig::default()
                .with_backing(Backing::File { path: PathBuf::from(path), create_bytes: args.emu_create_bytes })
                .with_namespaces(vec![NamespaceConfig::new(args.emu_lba_bytes, None)])
                .with_mdts(8);
            config.sync_file_on_flush = true; // the pool's durability promises hold across host crashes too
            let space = emu_space.get_or_insert_with(DmaPool::identity);
            EmuDevice::start_in(config, space).with_context(|| format!("starting the software controller on {path}"))?
        };
        let controller = Controller::init(backend, ControllerConfig::default()).with_context(|| format!("bringing up {spec}"))?;
        targets.push(PoolTarget { controller: Arc::new(controller), namespace: NamespaceId(args.namespace) });
    }
    Ok(targets)
}

fn describe(superblock: &Superblock) -> String {
    let g = &superblock.geometry;
    format!(
        "pool {} device {}/{} v{}\n  geometry: {g}\n  object {} B, block {} B, {} block(s) per slot, slot {} B\n  {} slots, LBA {} B, headers at LBA {} ({} LBAs of {}-byte entries), data at LBA {}, payload CRC {}",
        format_uuid(&superblock.pool_uuid),
        superblock.device_index,
        superblock.device_count,
        superblock.version,
        g.object_bytes(),
        g.block_bytes(),
        superblock.blocks_per_slot,
        superblock.slot_bytes,
        superblock.slot_count,
        superblock.lba_bytes,
        superblock.header_lba,
        superblock.header_blocks,
        superblock.header_entry_bytes,
        superblock.data_lba,
        if superblock.flags & objstore::format::FLAG_PAYLOAD_CRC != 0 { "on" } else { "off" },
    )
}

pub fn run(command: &PoolCommand) -> Result<()> {
    match command {
        PoolCommand::Format(args) => {
            let geometry = ModelGeometry::preset(&args.model, args.block_tokens)
                .with_context(|| format!("unknown model {:?}: llama3-8b, qwen3-32b or llama3-70b", args.model))?;
            let targets = open_targets(&args.devices)?;
            let params = FormatParams {
                geometry,
                blocks_per_slot: args.blocks_per_slot,
                slot_count_max: args.slots,
                pool_uuid: None,
                payload_crc: args.payload_crc,
            };
            for superblock in format_pool(&targets, &params)? {
                println!("{}", describe(&superblock));
            }
            Ok(())
        }
        PoolCommand::Inspect(args) => {
            let targets = open_targets(args)?;
            for (position, target) in targets.iter().enumerate() {
                match read_superblock(target, position) {
                    Ok(superblock) => println!("{target:?}: {}", describe(&superblock)),
                    Err(error) => println!("{target:?}: {error}"),
                }
            }
            let (pool, report) = Pool::open(targets, None)?;
            let counts = pool.index().counts();
            println!(
                "{} slots: {} valid, {} empty, {} corrupt headers, {} duplicates; {} cached blocks",
                report.slots, report.valid_slots, report.empty_slots, report.corrupt_headers, report.duplicate_slots, counts.cached_blocks
            );
            Ok(())
        }
        PoolCommand::Check(args) => {
            let (mut pool, report) = Pool::open(open_targets(&args.devices)?, None)?;
            println!(
                "{} slots checked: {} valid, {} empty, {} corrupt headers ({} all zeroes), {} duplicates",
                report.slots, report.valid_slots, report.empty_slots, report.corrupt_headers, report.zeroed_headers, report.duplicate_slots
            );
            if report.zeroed_headers > 0 {
                println!("  the slot-header region was zeroed or deallocated: the blocks recorded there are lost");
            }
            let mut damaged = report.corrupt_headers + report.duplicate_slots;
            if args.payload {
                let (verified, bad) = pool.check_payloads(Instant::now() + Duration::from_secs(24 * 3600))?;
                println!("{verified} payloads verified, {} mismatches", bad.len());
                for (device, slot) in &bad {
                    println!("  payload CRC mismatch: device {device} slot {slot}");
                }
                damaged += bad.len() as u64;
            }
            if damaged > 0 {
                bail!("{damaged} damaged slots (their blocks are not served; the slots are reused)");
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_inspect_check_on_an_emulated_file() {
        // Goal: the three subcommands run end to end on a file-backed software controller, and
        // check fails once the slot-header region is zeroed, and once the superblock is damaged.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.img");
        let devices = DeviceArgs {
            devices: vec![format!("emu:{}", path.display())],
            namespace: 1,
            emu_lba_bytes: 4096,
            emu_create_bytes: Some(64 << 20),
        };
        let format = FormatArgs {
            devices: devices.clone(),
            model: "llama3-8b".into(),
            block_tokens: 16,
            blocks_per_slot: 1,
            slots: None,
            payload_crc: false,
        };
        run(&PoolCommand::Format(format)).unwrap();
        run(&PoolCommand::Inspect(devices.clone())).unwrap();
        run(&PoolCommand::Check(CheckArgs { devices: devices.clone(), payload: true })).unwrap();
        let bad_model = FormatArgs {
            devices: devices.clone(),
            model: "gpt".into(),
            block_tokens: 16,
            blocks_per_slot: 1,
            slots: None,
            payload_crc: false,
        };
        assert!(run(&PoolCommand::Format(bad_model)).unwrap_err().to_string().contains("unknown model"));
        // Zero the slot-header region (byte 4096 on, one 4 KiB LBA here): check reports damage
        // (every empty slot carries a tagged, checksummed entry), not an empty pool.
        let mut bytes = std::fs::read(&path).unwrap();
        let pristine = bytes.clone();
        bytes[4096..8192].fill(0);
        std::fs::write(&path, &bytes).unwrap();
        let error = run(&PoolCommand::Check(CheckArgs { devices: devices.clone(), payload: false })).unwrap_err();
        assert!(format!("{error:#}").contains("damaged slots"), "{error:#}");
        std::fs::write(&path, &pristine).unwrap();
        run(&PoolCommand::Check(CheckArgs { devices: devices.clone(), payload: false })).unwrap();
        // Flip a superblock byte in the file: check refuses the pool.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[100] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let error = run(&PoolCommand::Check(CheckArgs { devices, payload: false })).unwrap_err();
        assert!(format!("{error:#}").contains("CRC"), "{error:#}");
    }
}
