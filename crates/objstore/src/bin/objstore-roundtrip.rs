//! `objstore-roundtrip --device vfio:BDF [--requests N] [--blocks N] [--k N]`
//!
//! Formats a pool on the device's first namespace (its data is lost), stores KV for several
//! requests layer by layer, reopens the pool, retrieves every request into different engine
//! blocks and compares every byte. Prints OBJSTORE_ROUNDTRIP_OK on success; exit status 1 on a
//! failed check, 2 on bad usage. The VM harness runs it against QEMU's NVMe controller.
use std::process::ExitCode;
use std::sync::Arc;

use nvme_driver::hw::vfio::VfioDevice;
use nvme_driver::{Controller, ControllerConfig, DeviceBackend};
use objstore::selfcheck::{round_trip, RoundTripConfig};

const USAGE: &str = "usage: objstore-roundtrip --device vfio:DOMAIN:BUS:DEVICE.FUNCTION [--requests N] [--blocks N] [--k N]";

fn parse() -> Result<(String, RoundTripConfig), String> {
    let mut device = None;
    let mut config = RoundTripConfig::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |text: String| text.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(|| format!("'{text}' is not a positive number"));
        match flag.as_str() {
            "--device" => device = Some(value()?),
            "--requests" => config.requests = number(value()?)?,
            "--blocks" => config.blocks_per_request = number(value()?)?,
            "--k" => config.blocks_per_slot = number(value()?)?,
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    let device = device.ok_or("--device is required")?;
    let address = device.strip_prefix("vfio:").ok_or_else(|| format!("'{device}' is not a vfio:BDF device"))?.to_string();
    Ok((address, config))
}

fn main() -> ExitCode {
    let (address, config) = match parse() {
        Ok(parsed) => parsed,
        Err(message) => {
            eprintln!("objstore-roundtrip: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = VfioDevice::open(&address)
        .map_err(|error| error.to_string())
        .and_then(|device| {
            let backend: Arc<dyn DeviceBackend> = Arc::new(device);
            Controller::init(backend, ControllerConfig::default()).map_err(|error| error.to_string())
        })
        .and_then(|controller| {
            let namespace =
                controller.namespaces().first().map(|namespace| namespace.id).ok_or("the controller has no active namespace")?;
            round_trip(Arc::new(controller), namespace, &config).map_err(|error| error.to_string())
        });
    match result {
        Ok(report) => {
            println!(
                "objstore round trip on vfio:{address}: {} blocks stored, {} shared, reopened ({} valid slots, {} corrupt headers), {} MiB compared",
                report.blocks_stored,
                report.blocks_shared,
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
