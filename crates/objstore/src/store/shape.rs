//! What the data half needs to know about a pool, as plain data: the geometry, the slot layout
//! and, per device, its namespace, LBA arithmetic and command limits. [`Pool::shape`] produces
//! it; tuttid will send it to an engine process over its socket, so [`PoolShape::check`]
//! treats it as untrusted (a shape whose slots reach past a namespace is refused), and the data
//! half checks every placement it is given against it.

use crate::error::{ObjstoreError, Result};
use crate::format::{SlotAddressing, FLAG_PAYLOAD_CRC};
use crate::geometry::ModelGeometry;
use crate::index::BlockLocation;
use crate::pool::Pool;

/// One pool device as the data half sees it (pool device i is gio_uring device index i).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLayout {
    /// Namespace id of the pool's namespace on this device.
    pub nsid: u32,
    /// The data region's LBA arithmetic.
    pub addressing: SlotAddressing,
    /// Slots on this device (slot ids are below it).
    pub slot_count: u64,
    pub lba_bytes: u32,
    /// The namespace's size in LBAs.
    pub capacity_blocks: u64,
    /// The controller's MDTS in bytes.
    pub max_transfer_bytes: u64,
    /// Whether the controller takes SGL data pointers.
    pub sgl_supported: bool,
}

/// A pool's shape: everything [`super::StoreData`] needs to turn placements into commands,
/// with no reference into the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolShape {
    pub geometry: ModelGeometry,
    /// k: engine blocks per slot.
    pub blocks_per_slot: u32,
    /// LBAs between layer l and layer l + 1 of one block.
    pub layer_stride_blocks: u64,
    /// Whether the pool records a payload CRC per block at commit.
    pub payload_crcs: bool,
    /// In pool order.
    pub devices: Vec<DeviceLayout>,
}

/// Where one block of a request lives in the pool and which engine block it moves from or to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub location: BlockLocation,
    pub engine_block: u32,
}

/// What a request moved between the devices and the engine's memory (in its one direction):
/// bytes and NVMe commands of the layers that completed, each layer counted once. The data
/// half counts it ([`super::StoreData::transferred`]); with tuttid the client reports it to the
/// daemon, which checks it against [`PoolShape::transfer_bound`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transferred {
    pub bytes: u64,
    pub commands: u64,
}

impl Transferred {
    /// Whether a report of `self` is possible for a request whose whole transfer is `bound`
    /// on a pool whose commands move `command_bytes` (`PoolShape::command_bytes`): at most the
    /// bound's bytes and commands, and between the least and the most one command moves per
    /// command (so no bytes without commands, no commands without bytes).
    pub fn fits(&self, bound: Transferred, command_bytes: std::ops::RangeInclusive<u64>) -> bool {
        let within = |per_command: u64| self.commands.checked_mul(per_command);
        self.bytes <= bound.bytes
            && self.commands <= bound.commands
            && within(*command_bytes.start()).is_some_and(|least| least <= self.bytes)
            && within(*command_bytes.end()).is_none_or(|most| self.bytes <= most)
    }
}

impl PoolShape {
    /// The most a request over `placements` can move: every layer of every block once (each
    /// block's layer is its K and V objects, `pair_blocks` LBAs, so at most that many commands
    /// of one LBA each). Saturates instead of wrapping (placements are checked elsewhere; a
    /// placement naming no device of the shape adds nothing).
    pub fn transfer_bound(&self, placements: &[Placement]) -> Transferred {
        let layers = u64::from(self.geometry.layers);
        let mut bound = Transferred::default();
        for placement in placements {
            let Some(device) = self.devices.get(usize::from(placement.location.device)) else { continue };
            let lbas = device.addressing.pair_blocks.saturating_mul(layers);
            bound.commands = bound.commands.saturating_add(lbas);
            bound.bytes = bound.bytes.saturating_add(lbas.saturating_mul(u64::from(device.lba_bytes)));
        }
        bound
    }

    /// What one data command of the pool moves: at least the smallest LBA of its devices, at
    /// most the largest MDTS.
    pub fn command_bytes(&self) -> std::ops::RangeInclusive<u64> {
        let least = self.devices.iter().map(|device| u64::from(device.lba_bytes)).min().unwrap_or(1);
        let most = self.devices.iter().map(|device| device.max_transfer_bytes).max().unwrap_or(u64::MAX);
        least..=most
    }
}

impl Pool {
    /// The pool's shape, for a data half in this process or another.
    pub fn shape(&self) -> Result<PoolShape> {
        let mut devices = Vec::with_capacity(self.device_count());
        for device in &self.devices {
            let controller = &device.target.controller;
            let namespace = controller.namespace(device.target.namespace)?;
            devices.push(DeviceLayout {
                nsid: device.target.namespace.0,
                addressing: device.superblock.addressing(),
                slot_count: device.superblock.slot_count,
                lba_bytes: device.superblock.lba_bytes,
                capacity_blocks: namespace.size_blocks,
                max_transfer_bytes: controller.max_transfer_bytes(),
                sgl_supported: controller.data_pointer_mode() == nvme_driver::DataPointerMode::Sgl,
            });
        }
        let first = self.superblock(0);
        Ok(PoolShape {
            geometry: first.geometry,
            blocks_per_slot: first.blocks_per_slot,
            layer_stride_blocks: first.layer_stride_blocks(),
            payload_crcs: first.flags & FLAG_PAYLOAD_CRC != 0,
            devices,
        })
    }
}

fn bad_shape(reason: String) -> ObjstoreError {
    ObjstoreError::InvalidPoolShape { reason }
}

impl PoolShape {
    /// Checks that the shape is self-consistent and that every slot of every device, all its
    /// layers, lies inside that device's namespace: then no placement inside the shape names
    /// an LBA outside it.
    pub fn check(&self) -> Result<()> {
        if self.devices.is_empty() || self.devices.len() > usize::from(u16::MAX) {
            return Err(bad_shape(format!("{} devices, expected 1..={}", self.devices.len(), u16::MAX)));
        }
        let k = u64::from(self.blocks_per_slot);
        if k == 0 || self.blocks_per_slot > u32::from(u16::MAX) {
            return Err(bad_shape(format!("{} blocks per slot", self.blocks_per_slot)));
        }
        let layers = u64::from(self.geometry.layers);
        for (index, device) in self.devices.iter().enumerate() {
            let a = &device.addressing;
            if !device.lba_bytes.is_power_of_two() || a.lba_shift != device.lba_bytes.trailing_zeros() {
                return Err(bad_shape(format!("device {index}: LBA size {} with shift {}", device.lba_bytes, a.lba_shift)));
            }
            let pair_bytes = 2 * self.geometry.object_bytes();
            if !pair_bytes.is_multiple_of(u64::from(device.lba_bytes)) || a.pair_blocks != pair_bytes >> a.lba_shift {
                return Err(bad_shape(format!(
                    "device {index}: {} LBAs per K+V pair, the geometry needs {pair_bytes} bytes",
                    a.pair_blocks
                )));
            }
            if self.layer_stride_blocks != a.pair_blocks * k {
                return Err(bad_shape(format!(
                    "device {index}: layer stride {} LBAs, k pairs are {}",
                    self.layer_stride_blocks,
                    a.pair_blocks * k
                )));
            }
            let slot_needs = self.layer_stride_blocks.checked_mul(layers);
            if slot_needs.is_none_or(|needs| needs > a.slot_blocks) {
                return Err(bad_shape(format!("device {index}: slots of {} LBAs cannot hold {layers} layers", a.slot_blocks)));
            }
            let end = a.slot_blocks.checked_mul(device.slot_count).and_then(|bytes| bytes.checked_add(a.data_lba));
            if device.slot_count > u64::from(u32::MAX) + 1 || end.is_none_or(|end| end > device.capacity_blocks) {
                return Err(bad_shape(format!(
                    "device {index}: {} slots of {} LBAs from LBA {} reach past the namespace's {} LBAs",
                    device.slot_count, a.slot_blocks, a.data_lba, device.capacity_blocks
                )));
            }
        }
        Ok(())
    }

    /// Checks that `placement` names a block position of a slot of the pool
    /// ([`ObjstoreError::BadPlacement`] otherwise): `position` is its place in the request.
    #[inline]
    pub fn check_placement(&self, position: usize, placement: &Placement) -> Result<()> {
        let location = placement.location;
        let Some(device) = self.devices.get(usize::from(location.device)) else {
            return Err(ObjstoreError::BadPlacement {
                position,
                reason: format!("device {} of a pool of {}", location.device, self.devices.len()),
            });
        };
        if u64::from(location.slot) >= device.slot_count {
            return Err(ObjstoreError::BadPlacement {
                position,
                reason: format!("slot {} of device {}, which has {}", location.slot, location.device, device.slot_count),
            });
        }
        if u32::from(location.index) >= self.blocks_per_slot {
            return Err(ObjstoreError::BadPlacement {
                position,
                reason: format!("block {} of a slot of {}", location.index, self.blocks_per_slot),
            });
        }
        Ok(())
    }
}
