//! What the data half needs to know about a pool, as plain data: the geometry, the slot layout
//! and, per device, its namespace, LBA arithmetic and command limits. [`Pool::shape`] produces
//! it; tuttid will send it to an engine process over its socket, so [`PoolShape::check`]
//! treats it as untrusted (a shape whose slots reach past a namespace is refused), and the data
//! half checks every placement it is given against it.

use crate::error::{ObjstoreError, Result};
use crate::format::{header_entry_bytes, metadata_layout, SlotAddressing, BLOCKS_PER_SLOT_MAX, FLAG_PAYLOAD_CRC};
use crate::geometry::ModelGeometry;
use crate::index::BlockLocation;
use crate::pool::Pool;
use nvme_driver::datapath::TRANSFER_BYTES_MAX;

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

/// The LBA sizes a shape may name: those a pool can be formatted on (`Superblock::plan`).
const LBA_BYTES_MIN: u32 = 512;
const LBA_BYTES_MAX: u32 = 65536;

fn bad_shape(reason: String) -> ObjstoreError {
    ObjstoreError::InvalidPoolShape { reason }
}

impl PoolShape {
    /// Checks that the shape is self-consistent and that every slot of every device, all its
    /// layers, lies inside that device's namespace: then no placement inside the shape names
    /// an LBA outside it. Every field is untrusted: the geometry and blocks per slot are
    /// validated as at format, LBA sizes must be ones a namespace has, each MDTS lies between
    /// one LBA and what one command carries, and all arithmetic is checked.
    pub fn check(&self) -> Result<()> {
        if self.devices.is_empty() || self.devices.len() > usize::from(u16::MAX) {
            return Err(bad_shape(format!("{} devices, expected 1..={}", self.devices.len(), u16::MAX)));
        }
        // As at format (`Superblock::plan`: a slot header lists each block); the header
        // entry's fit in one LBA is checked per device below.
        let k = u64::from(self.blocks_per_slot);
        if k == 0 || self.blocks_per_slot > BLOCKS_PER_SLOT_MAX {
            return Err(bad_shape(format!("{} blocks per slot, expected 1..={BLOCKS_PER_SLOT_MAX}", self.blocks_per_slot)));
        }
        // A validated geometry's object is at most 1 GiB, so the pair's bytes cannot overflow;
        // checked all the same.
        self.geometry.validate().map_err(|error| bad_shape(format!("geometry {}: {error}", self.geometry)))?;
        let pair_bytes = self
            .geometry
            .checked_object_bytes()
            .and_then(|bytes| bytes.checked_mul(2))
            .ok_or_else(|| bad_shape(format!("geometry {}: a K+V pair overflows 64 bits", self.geometry)))?;
        let layers = u64::from(self.geometry.layers);
        for (index, device) in self.devices.iter().enumerate() {
            let a = &device.addressing;
            if !device.lba_bytes.is_power_of_two()
                || !(LBA_BYTES_MIN..=LBA_BYTES_MAX).contains(&device.lba_bytes)
                || a.lba_shift != device.lba_bytes.trailing_zeros()
            {
                return Err(bad_shape(format!(
                    "device {index}: LBA size {} with shift {}, expected a power of two in {LBA_BYTES_MIN}..={LBA_BYTES_MAX} and its log2",
                    device.lba_bytes, a.lba_shift
                )));
            }
            let entry_bytes = header_entry_bytes(self.blocks_per_slot);
            if entry_bytes > u64::from(device.lba_bytes) {
                return Err(bad_shape(format!(
                    "device {index}: {} blocks per slot need a {entry_bytes}-byte slot header entry, more than one {}-byte LBA",
                    self.blocks_per_slot, device.lba_bytes
                )));
            }
            // The data half cuts every transfer into commands of at most this many bytes, and
            // counts one command's LBAs in a u32: between one LBA and what the driver lets one
            // command carry (every controller's MDTS is capped there).
            if !(u64::from(device.lba_bytes)..=TRANSFER_BYTES_MAX).contains(&device.max_transfer_bytes) {
                return Err(bad_shape(format!(
                    "device {index}: a largest transfer (MDTS) of {} bytes, expected {}..={TRANSFER_BYTES_MAX} (one LBA to what one \
                     command carries)",
                    device.max_transfer_bytes, device.lba_bytes
                )));
            }
            if !pair_bytes.is_multiple_of(u64::from(device.lba_bytes)) || a.pair_blocks != pair_bytes >> a.lba_shift {
                return Err(bad_shape(format!(
                    "device {index}: {} LBAs per K+V pair, the geometry needs {pair_bytes} bytes",
                    a.pair_blocks
                )));
            }
            let stride = a.pair_blocks.checked_mul(k);
            if stride != Some(self.layer_stride_blocks) {
                return Err(bad_shape(format!(
                    "device {index}: layer stride {} LBAs, {k} pairs of {} LBAs are {stride:?}",
                    self.layer_stride_blocks, a.pair_blocks
                )));
            }
            let slot_needs = self.layer_stride_blocks.checked_mul(layers);
            if slot_needs.is_none_or(|needs| needs > a.slot_blocks) {
                return Err(bad_shape(format!("device {index}: slots of {} LBAs cannot hold {layers} layers", a.slot_blocks)));
            }
            // The data region starts exactly where format places it for this many slots: past
            // the superblock and every slot's header, on a 1 MiB boundary (`metadata_layout`,
            // the rule `Superblock::plan` uses, and `open` holds every superblock to). A data
            // half must never write slots over them: a start merely on the boundary could lie
            // inside a header region longer than 1 MiB.
            let expected_lba = metadata_layout(device.slot_count, self.blocks_per_slot, device.lba_bytes)
                .map(|layout| layout.data_start >> a.lba_shift)
                .filter(|&lba| lba > 0);
            if expected_lba != Some(a.data_lba) {
                return Err(bad_shape(format!(
                    "device {index}: the data region at LBA {} is not where format puts it past the pool's metadata for {} slots (LBA {})",
                    a.data_lba,
                    device.slot_count,
                    expected_lba.map_or_else(|| "beyond 64 bits".to_string(), |lba| lba.to_string())
                )));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Superblock;
    use crate::hash::KeySecret;

    /// A shape as `Pool::shape` makes it for one device of 4096 LBAs of 512 bytes, k = 2.
    fn good_shape() -> PoolShape {
        let geometry = ModelGeometry { layers: 4, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let size_blocks = 8192;
        let superblock =
            Superblock::plan(geometry, 2, 512, size_blocks, None, [7; 16], 0, 1, 0, KeySecret::from_bytes([7; 32]).unwrap()).expect("plan");
        PoolShape {
            geometry,
            blocks_per_slot: 2,
            layer_stride_blocks: superblock.layer_stride_blocks(),
            payload_crcs: false,
            devices: vec![DeviceLayout {
                nsid: 1,
                addressing: superblock.addressing(),
                slot_count: superblock.slot_count,
                lba_bytes: 512,
                capacity_blocks: size_blocks,
                max_transfer_bytes: 128 << 10,
                sgl_supported: true,
            }],
        }
    }

    fn refused(shape: &PoolShape, what: &str) -> String {
        match shape.check() {
            Err(ObjstoreError::InvalidPoolShape { reason }) => reason,
            other => panic!("{what}: expected InvalidPoolShape, got {other:?}"),
        }
    }

    #[test]
    fn a_shape_with_impossible_geometry_is_refused_not_a_panic() {
        // Goal: a shape comes over tuttid's socket, so its geometry is untrusted. Every field at
        // u32::MAX used to overflow `2 * object_bytes` (a panic in a debug build, a wrapped
        // size in release); it is refused with a reason naming the geometry.
        good_shape().check().expect("the shape of a real pool");
        let mut huge = good_shape();
        huge.geometry =
            ModelGeometry { layers: u32::MAX, kv_heads: u32::MAX, head_dim: u32::MAX, dtype_bytes: u32::MAX, block_tokens: u32::MAX };
        let reason = refused(&huge, "u32::MAX geometry");
        assert!(reason.contains("geometry"), "{reason}");
        let mut zero = good_shape();
        zero.geometry.layers = 0;
        refused(&zero, "zero layers");
    }

    #[test]
    fn a_shape_whose_data_region_overlaps_the_metadata_is_refused() {
        // Goal: a data region at LBA 0 (over the superblock and headers), or not on the 1 MiB
        // boundary format uses, is refused: a data half would write slot 0 over the metadata.
        let good = good_shape();
        good.check().expect("the shape of a real pool");
        for data_lba in [0, 1, 8, 2048 + 1, u64::MAX >> 2] {
            let mut shape = good.clone();
            shape.devices[0].addressing.data_lba = data_lba;
            let reason = refused(&shape, &format!("data at LBA {data_lba}"));
            assert!(reason.contains("data region"), "{reason}");
        }
    }

    #[test]
    fn a_shape_whose_slots_overlap_the_slot_headers_is_refused() {
        // Goal: the data region must start where format puts it for the shape's slot count,
        // past the whole header region. A 1 GiB namespace at k = 2 holds ~16,000 slots whose
        // headers (128 B each) reach past 1 MiB, so format puts the data at 2 MiB; a shape
        // saying 1 MiB used to pass (on the 1 MiB boundary, past the superblock), and a store
        // into slot 0 would have overwritten the header entries of slots 8,160 on.
        let mut shape = good_shape();
        let size_blocks = (1 << 30) / 512;
        let superblock =
            Superblock::plan(shape.geometry, 2, 512, size_blocks, None, [7; 16], 0, 1, 0, KeySecret::from_bytes([7; 32]).unwrap())
                .expect("plan");
        assert_eq!(superblock.data_lba * 512, 2 << 20, "the headers reach past 1 MiB");
        shape.devices[0].addressing = superblock.addressing();
        shape.devices[0].slot_count = superblock.slot_count;
        shape.devices[0].capacity_blocks = size_blocks;
        shape.check().expect("the shape of a real pool");
        for (data_lba, what) in [(2048, "inside the header region"), (3 * 2048, "not where format puts it")] {
            let mut moved = shape.clone();
            moved.devices[0].addressing.data_lba = data_lba;
            let reason = refused(&moved, &format!("data at LBA {data_lba}, {what}"));
            assert!(reason.contains("data region"), "{reason}");
        }
    }

    #[test]
    fn a_shape_whose_devices_differ_in_lba_size_is_refused() {
        // Goal: the data half cuts every command with device 0's LBA size (`StoreData::new`),
        // so a shape (untrusted, from tuttid's socket) whose device 1 has 4 KiB LBAs beside
        // device 0's 512-byte ones would give device 1 short, overlapping commands. Device 1
        // here is exactly what format plans on a 4 KiB namespace; the shape is refused because
        // every device must have the one layer stride (`pair_blocks * k`), and equal pair
        // counts of one pair size mean equal LBA sizes: a per-device stride would need an
        // explicit LBA-size check in its place.
        let mut shape = good_shape();
        let size_blocks = 8192;
        let superblock =
            Superblock::plan(shape.geometry, 2, 4096, size_blocks, None, [7; 16], 1, 2, 0, KeySecret::from_bytes([7; 32]).unwrap())
                .expect("plan");
        shape.devices.push(DeviceLayout {
            nsid: 1,
            addressing: superblock.addressing(),
            slot_count: superblock.slot_count,
            lba_bytes: 4096,
            capacity_blocks: size_blocks,
            max_transfer_bytes: 128 << 10,
            sgl_supported: true,
        });
        let reason = refused(&shape, "devices of 512-byte and 4 KiB LBAs");
        assert!(reason.contains("device 1"), "{reason}");
    }

    #[test]
    fn a_shape_with_an_lba_size_no_namespace_has_is_refused() {
        // Goal: LBA sizes of 1, 2 or 256 bytes, with everything else in the shape consistent
        // with them, used to pass the check (only a power of two matching the shift was
        // asked for); only 512..=65536 is a namespace's LBA size (as at format).
        good_shape().check().expect("the shape of a real pool");
        for lba_bytes in [1u32, 2, 256, 1 << 17] {
            // Everything else consistent with that LBA size.
            let mut shape = good_shape();
            let pair_bytes = 2 * shape.geometry.object_bytes();
            let device = &mut shape.devices[0];
            device.lba_bytes = lba_bytes;
            device.addressing.lba_shift = lba_bytes.trailing_zeros();
            device.addressing.pair_blocks = pair_bytes >> device.addressing.lba_shift;
            device.addressing.slot_blocks = device.addressing.pair_blocks * 2 * u64::from(shape.geometry.layers);
            device.capacity_blocks = u64::MAX;
            shape.layer_stride_blocks = device.addressing.pair_blocks * 2;
            if pair_bytes.is_multiple_of(u64::from(lba_bytes)) {
                let reason = refused(&shape, &format!("{lba_bytes}-byte LBAs"));
                assert!(reason.contains("LBA size"), "{reason}");
            } else {
                assert!(shape.check().is_err(), "{lba_bytes}-byte LBAs");
            }
        }
    }

    #[test]
    fn a_shape_whose_commands_or_slots_no_pool_has_is_refused() {
        // Goal: the data half cuts commands by the shape's MDTS and puts one command's LBAs in
        // a u32; both come over tuttid's socket. An MDTS of 0, below one LBA or above what one
        // command can carry (`TRANSFER_BYTES_MAX`, where the driver caps every controller's) is
        // refused, and so is a slot of more blocks than format allows (`BLOCKS_PER_SLOT_MAX`,
        // a header entry within one LBA), consistent in every other field: with k = 2048 and
        // an MDTS of u64::MAX both used to pass, and one merged run's command of 2048 blocks
        // could exceed a u32 count of LBAs.
        good_shape().check().expect("the shape of a real pool");
        for max_transfer_bytes in [0, 256, TRANSFER_BYTES_MAX + 1, u64::MAX] {
            let mut shape = good_shape();
            shape.devices[0].max_transfer_bytes = max_transfer_bytes;
            let reason = refused(&shape, &format!("MDTS {max_transfer_bytes}"));
            assert!(reason.contains("transfer"), "{reason}");
        }
        let mut largest = good_shape();
        largest.devices[0].max_transfer_bytes = TRANSFER_BYTES_MAX;
        largest.check().expect("the largest MDTS a controller reports");
        // k blocks per slot, every other field what format would write for one slot of them
        // (blocks of 128 tokens: a K+V pair of 64 KiB, whole LBAs of every size here).
        let with_k = |k: u32, lba_bytes: u32, max_transfer_bytes: u64| {
            let mut shape = good_shape();
            shape.geometry.block_tokens = 128;
            let pair_bytes = 2 * shape.geometry.object_bytes();
            shape.blocks_per_slot = k;
            let device = &mut shape.devices[0];
            device.lba_bytes = lba_bytes;
            device.max_transfer_bytes = max_transfer_bytes;
            let a = &mut device.addressing;
            a.lba_shift = lba_bytes.trailing_zeros();
            a.pair_blocks = pair_bytes >> a.lba_shift;
            shape.layer_stride_blocks = a.pair_blocks * u64::from(k);
            a.slot_blocks = shape.layer_stride_blocks * u64::from(shape.geometry.layers);
            device.slot_count = 1;
            a.data_lba = metadata_layout(1, k, lba_bytes).unwrap().data_start >> a.lba_shift;
            device.capacity_blocks = a.data_lba + a.slot_blocks;
            shape
        };
        // The largest k format allows, on LBAs that hold its header entry.
        let lba_bytes = header_entry_bytes(BLOCKS_PER_SLOT_MAX) as u32;
        with_k(BLOCKS_PER_SLOT_MAX, lba_bytes, TRANSFER_BYTES_MAX).check().expect("k at format's limit");
        for (k, lba_bytes, max_transfer_bytes, named) in [
            (2048, 65536, u64::MAX, "blocks per slot"),
            (2048, 65536, TRANSFER_BYTES_MAX, "blocks per slot"),
            (BLOCKS_PER_SLOT_MAX + 1, 65536, TRANSFER_BYTES_MAX, "blocks per slot"),
            (u32::from(u16::MAX), 65536, TRANSFER_BYTES_MAX, "blocks per slot"),
            (BLOCKS_PER_SLOT_MAX, 65536, u64::MAX, "transfer"),
            // A header entry of 1024 blocks does not fit a 512-byte LBA.
            (BLOCKS_PER_SLOT_MAX, 512, TRANSFER_BYTES_MAX, "header entry"),
        ] {
            let shape = with_k(k, lba_bytes, max_transfer_bytes);
            let reason = refused(&shape, &format!("k = {k} on {lba_bytes}-byte LBAs, MDTS {max_transfer_bytes}"));
            assert!(reason.contains(named), "{reason}");
        }
    }
}
