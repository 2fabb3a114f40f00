//! Opening the daemon's devices and pool from device strings: lock every device (one daemon
//! per pool), open them in one DMA space (`tutti_devices::open_in_one_space`), bring up each
//! controller, format the pool if asked, then open it (recovery happens there).

use std::path::PathBuf;
use std::sync::Arc;

use nvme_driver::{Controller, ControllerConfig, NamespaceId};
use nvme_emu::{EmuConfig, NamespaceConfig};
use objstore::{format_pool, FormatParams, Pool, PoolTarget, RecoveryReport};
use tutti_devices::open::EmuOptions;
use tutti_devices::{open_in_one_space, DeviceSpec};

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
    let mut config = EmuConfig::default().with_namespaces(vec![NamespaceConfig::new(options.emu_lba_bytes, None)]).with_mdts(8);
    // The pool's durability promises hold across host crashes too (as `tutti pool`).
    config.sync_file_on_flush = true;
    let emu = EmuOptions { config, create_bytes: options.emu_create_bytes };
    let opened = open_in_one_space(&options.specs, &emu)?;
    let mut targets = Vec::with_capacity(opened.len());
    let mut devices = Vec::with_capacity(opened.len());
    for device in opened {
        let spec = device.spec.to_string();
        let controller = Controller::init(device.backend, ControllerConfig::default())
            .map_err(|source| DaemonError::Controller { spec: spec.clone(), source })?;
        devices.push(DeviceStatus { spec, description: device.spec.describe() });
        targets.push(PoolTarget { controller: Arc::new(controller), namespace: NamespaceId(options.namespace) });
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
