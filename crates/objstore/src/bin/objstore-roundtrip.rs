//! `objstore-roundtrip --device vfio:BDF [--device vfio:BDF ...] [--requests N] [--blocks N] [--k N]
//! [--layout separate|block-major]`
//!
//! Formats one pool over the first namespace of every device given (their data is lost),
//! stores KV for several requests layer by layer, reopens the pool, retrieves every request
//! into different engine blocks and compares every byte. Several devices are opened in one
//! VFIO container (one IOVA space), and the pool's blocks are striped across them. Prints
//! OBJSTORE_ROUNDTRIP_OK on success; exit status 1 on a failed check, 2 on bad usage. The VM
//! harness runs it against QEMU's NVMe controllers, including one with `mdts=2,max_ioqpairs=1`
//! (commands are cut to MDTS; with one I/O queue pair the pool's metadata borrows the
//! executor's).
use std::process::ExitCode;
use std::sync::Arc;

use nvme_driver::hw::vfio::{PciAddress, VfioDevice, VfioOptions};
use nvme_driver::{Controller, ControllerConfig, DeviceBackend};
use objstore::selfcheck::{round_trip, EngineLayout, RoundTripConfig};
use objstore::PoolTarget;

const USAGE: &str =
    "usage: objstore-roundtrip --device vfio:DOMAIN:BUS:DEVICE.FUNCTION [--device vfio:BDF ...] [--requests N] [--blocks N] \
                     [--k N] [--layout separate|block-major]";

fn parse() -> Result<(Vec<PciAddress>, RoundTripConfig), String> {
    let mut addresses = Vec::new();
    let mut config = RoundTripConfig::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |text: String| text.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(|| format!("'{text}' is not a positive number"));
        match flag.as_str() {
            "--device" => {
                let device = value()?;
                let address = device.strip_prefix("vfio:").ok_or_else(|| format!("'{device}' is not a vfio:BDF device"))?;
                addresses.push(address.parse::<PciAddress>().map_err(|error| error.to_string())?);
            }
            "--requests" => config.requests = number(value()?)?,
            "--blocks" => config.blocks_per_request = number(value()?)?,
            "--k" => config.blocks_per_slot = number(value()?)?,
            "--layout" => {
                config.layout = match value()?.as_str() {
                    "separate" => EngineLayout::SeparateKv,
                    "block-major" => EngineLayout::BlockMajor,
                    other => return Err(format!("layout '{other}': expected separate or block-major")),
                }
            }
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    if addresses.is_empty() {
        return Err("--device is required".into());
    }
    Ok((addresses, config))
}

fn run(addresses: &[PciAddress], config: &RoundTripConfig) -> Result<objstore::selfcheck::RoundTripReport, String> {
    let devices = VfioDevice::open_many(addresses, &VfioOptions::default()).map_err(|error| error.to_string())?;
    let mut targets = Vec::with_capacity(devices.len());
    for device in devices {
        let address = device.address();
        let backend: Arc<dyn DeviceBackend> = Arc::new(device);
        let controller = Controller::init(backend, ControllerConfig::default()).map_err(|error| format!("{address}: {error}"))?;
        let namespace =
            controller.namespaces().first().map(|namespace| namespace.id).ok_or_else(|| format!("{address} has no active namespace"))?;
        targets.push(PoolTarget { controller: Arc::new(controller), namespace });
    }
    round_trip(targets, config).map_err(|error| error.to_string())
}

fn main() -> ExitCode {
    let (addresses, config) = match parse() {
        Ok(parsed) => parsed,
        Err(message) => {
            eprintln!("objstore-roundtrip: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let names = addresses.iter().map(|address| format!("vfio:{address}")).collect::<Vec<_>>().join(" + ");
    match run(&addresses, &config) {
        Ok(report) => {
            println!(
                "objstore round trip on {names}: {} blocks stored, {} shared, reopened ({} devices, {} valid slots, {} corrupt headers), {} MiB compared",
                report.blocks_stored,
                report.blocks_shared,
                report.recovery.devices,
                report.recovery.valid_slots,
                report.recovery.corrupt_headers,
                report.bytes_verified >> 20
            );
            println!("OBJSTORE_ROUNDTRIP_OK");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("objstore-roundtrip: {message}");
            println!("OBJSTORE_ROUNDTRIP_FAILED");
            ExitCode::from(1)
        }
    }
}
