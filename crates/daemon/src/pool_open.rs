//! Opening the daemon's devices and pool from device strings: lock every device (one daemon
//! per pool), open them in one DMA space (`tutti_devices::open_in_one_space`), bring up each
//! controller, format the pool if asked, then open it (recovery happens there).

use std::path::PathBuf;
use std::sync::Arc;

use nvme_driver::NamespaceId;
use objstore::{format_pool, FormatParams, Pool, PoolTarget, RecoveryReport};
use tutti_devices::{open_pool_devices, DeviceError, DeviceSpec};

use crate::lock::DeviceLocks;
use crate::protocol::DeviceStatus;
use crate::DaemonError;

/// What to open.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub specs: Vec<DeviceSpec>,
    /// Namespace id on every device.
    pub namespace: u32,
    /// LBA size of a software controller's namespace.
    pub emu_lba_bytes: u32,
    /// Create (or grow) `emu:PATH` files to this size.
    pub emu_create_bytes: Option<u64>,
    /// Format a fresh pool before opening (`emu:mem:` needs it at every start).
    pub format: Option<FormatParams>,
    /// Where `vfio:` devices' lock files live.
    pub lock_dir: PathBuf,
}

/// The open pool with what keeps it ours. Fields drop in order: the pool (its controllers, the
/// software controllers' threads) before the locks.
pub struct OpenedPool {
    pub pool: Pool,
    pub devices: Vec<DeviceStatus>,
    pub report: RecoveryReport,
    pub locks: DeviceLocks,
}

pub fn open_pool(options: &PoolOptions) -> Result<OpenedPool, DaemonError> {
    let locks = DeviceLocks::acquire(&options.specs, &options.lock_dir, options.emu_create_bytes.is_some())?;
    let opened = open_pool_devices(&options.specs, options.emu_lba_bytes, options.emu_create_bytes).map_err(|error| match error {
        DeviceError::BringUp { spec, source } => DaemonError::Controller { spec, source },
        error => DaemonError::Devices(error),
    })?;
    let mut targets = Vec::with_capacity(opened.len());
    let mut devices = Vec::with_capacity(opened.len());
    for device in opened {
        devices.push(DeviceStatus { spec: device.spec.to_string(), description: device.spec.describe() });
        targets.push(PoolTarget { controller: Arc::clone(&device.controller), namespace: NamespaceId(options.namespace) });
    }
    if let Some(params) = &options.format {
        format_pool(&targets, params).map_err(|source| DaemonError::Pool { context: "formatting the pool".into(), source })?;
    }
    let (pool, report) = Pool::open(targets, None).map_err(|source| DaemonError::Pool {
        context: "opening the pool (a device that holds none: start with --format, or run `tutti pool format`)".into(),
        source,
    })?;
    Ok(OpenedPool { pool, devices, report, locks })
}
