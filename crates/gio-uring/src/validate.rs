//! What a caller may put in an IOCB, and the checks that turn it into ABI records.
//!
//! Every IOCTX is checked when its IOCB is filled, for the first and the last layer the IOCB was
//! prepared for. The per-layer rule is linear (`x + layer * stride`) and each check is an interval
//! inside one contiguous range, so both ends inside the same range implies every layer in between
//! is too: a per-layer issue then costs O(1) checks, not O(blocks).

use crate::abi::{self, gio_ioctx, Opcode};
use crate::error::IoctxFault;
use crate::types::{DeviceIndex, Iova, IovaRange, Lba};

/// What the queue knows about one NVMe device (a namespace reachable through the executor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceInfo {
    pub nsid: u32,
    pub capacity_blocks: u64,
    pub block_bytes: u32,
    /// Whether the controller accepts SGL data pointers (Identify Controller SGLS != 0).
    pub sgl_supported: bool,
}

/// The devices an IOCTX's `device` index refers to, fixed at `init_queue`.
#[derive(Debug, Clone, Default)]
pub struct DeviceTable {
    devices: Vec<DeviceInfo>,
}

impl DeviceTable {
    pub fn new(devices: Vec<DeviceInfo>) -> Self {
        Self { devices }
    }

    pub fn get(&self, device: DeviceIndex) -> Option<&DeviceInfo> {
        self.devices.get(usize::from(device.0))
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

/// Device-visible memory that data and descriptors may live in (e.g. the engine's KV pool mapped
/// through the IOMMU, and the descriptor tables).
#[derive(Debug, Clone, Default)]
pub struct RegisteredMemory {
    /// Sorted by start, non-overlapping.
    ranges: Vec<IovaRange>,
}

impl RegisteredMemory {
    /// `None` if two ranges overlap or a range wraps the address space.
    pub fn new(mut ranges: Vec<IovaRange>) -> Option<Self> {
        ranges.sort_by_key(|range| range.start);
        for range in &ranges {
            range.end()?;
        }
        for pair in ranges.windows(2) {
            if pair[0].end()? > pair[1].start.0 {
                return None;
            }
        }
        Some(Self { ranges })
    }

    /// The registered range holding `address`, if any.
    fn range_of(&self, address: u64) -> Option<&IovaRange> {
        let index = self.ranges.partition_point(|range| range.start.0 <= address);
        let range = self.ranges.get(index.checked_sub(1)?)?;
        range.contains(address, 0).then_some(range)
    }
}

/// How the controller finds the data of one IOCTX.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Descriptor {
    /// One contiguous buffer, described by an SGL Data Block inside the command.
    SglInline,
    /// A Last Segment of SGL descriptors at `segment` (16 bytes each).
    SglSegment { segment: IovaRange },
    /// PRP1 = the data address; PRP2 = `prp2` (the second page, or a PRP list), if the transfer
    /// needs it.
    Prp { prp2: Option<IovaRange> },
}

/// One IOCTX as the caller describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoctxSpec {
    pub device: DeviceIndex,
    pub nsid: u32,
    pub start_lba: Lba,
    pub block_count: u32,
    /// Device address of the first data byte.
    pub data: Iova,
    pub descriptor: Descriptor,
    pub force_unit_access: bool,
}

/// The IOCB-wide part of a request: direction, the per-layer rule and the caller's tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IocbSpec {
    pub opcode: Opcode,
    pub user_data: u64,
    /// Layers the request will be issued for (1 for a plain request).
    pub layer_count: u32,
    pub lba_stride_blocks: u64,
    pub mem_stride_bytes: u64,
    pub desc_stride_bytes: u64,
}

impl IocbSpec {
    /// A single-layer request.
    pub fn single(opcode: Opcode, user_data: u64) -> Self {
        Self { opcode, user_data, layer_count: 1, lba_stride_blocks: 0, mem_stride_bytes: 0, desc_stride_bytes: 0 }
    }
}

/// The 16-bit, 0-based NLB field of an NVMe Read/Write command.
pub const NVME_BLOCKS_PER_COMMAND_MAX: u32 = 65536;

fn at_layer(base: u64, stride: u64, layer: u32) -> Option<u64> {
    stride.checked_mul(u64::from(layer)).and_then(|offset| base.checked_add(offset))
}

/// Checks one IOCTX against the devices and registered memory and encodes it.
pub fn encode_ioctx(spec: &IoctxSpec, iocb: &IocbSpec, devices: &DeviceTable, memory: &RegisteredMemory) -> Result<gio_ioctx, IoctxFault> {
    let device = devices.get(spec.device).ok_or(IoctxFault::UnknownDevice { device: spec.device, device_count: devices.len() })?;
    if spec.block_count == 0 {
        return Err(IoctxFault::ZeroLength);
    }
    if spec.block_count > NVME_BLOCKS_PER_COMMAND_MAX {
        return Err(IoctxFault::TooManyBlocks { block_count: spec.block_count });
    }
    if spec.nsid != device.nsid {
        return Err(IoctxFault::WrongNamespace { nsid: spec.nsid, expected_nsid: device.nsid });
    }
    let data_bytes = spec.block_count.checked_mul(device.block_bytes).ok_or(IoctxFault::LengthMismatch {
        data_bytes: u32::MAX,
        block_count: spec.block_count,
        block_bytes: device.block_bytes,
    })?;
    let (kind, desc, desc_bytes) = match spec.descriptor {
        Descriptor::SglInline => (abi::GIO_DESCRIPTOR_SGL, None, 0u32),
        Descriptor::SglSegment { segment } => {
            let bytes = u32::try_from(segment.len_bytes).unwrap_or(0);
            if bytes == 0 || bytes % 16 != 0 {
                return Err(IoctxFault::BadSglSegment { desc_bytes: bytes });
            }
            (abi::GIO_DESCRIPTOR_SGL, Some(segment), bytes)
        }
        Descriptor::Prp { prp2 } => {
            let bytes = prp2.map_or(0, |range| u32::try_from(range.len_bytes).unwrap_or(u32::MAX));
            (abi::GIO_DESCRIPTOR_PRP, prp2, bytes)
        }
    };
    if kind == abi::GIO_DESCRIPTOR_SGL && !device.sgl_supported {
        return Err(IoctxFault::SglUnsupported);
    }
    let last_layer = iocb.layer_count.saturating_sub(1);
    for layer in [0, last_layer] {
        let first_lba = at_layer(spec.start_lba.0, iocb.lba_stride_blocks, layer).ok_or(IoctxFault::AddressOverflow { layer })?;
        let lba_ok = first_lba.checked_add(u64::from(spec.block_count)).is_some_and(|end| end <= device.capacity_blocks);
        if !lba_ok {
            return Err(IoctxFault::LbaOutOfRange {
                first_lba,
                block_count: spec.block_count,
                layer,
                capacity_blocks: device.capacity_blocks,
            });
        }
    }
    check_registered(memory, "data", spec.data.0, u64::from(data_bytes), iocb.mem_stride_bytes, last_layer)?;
    if let Some(desc) = desc {
        check_registered(memory, "descriptor", desc.start.0, desc.len_bytes, iocb.desc_stride_bytes, last_layer)?;
    }
    Ok(gio_ioctx {
        desc_iova: desc.map_or(0, |range| range.start.0),
        data_iova: spec.data.0,
        start_lba: spec.start_lba.0,
        nsid: spec.nsid,
        block_count: spec.block_count,
        data_bytes,
        desc_bytes,
        device_index: spec.device.0,
        descriptor_kind: kind as u8,
        flags: if spec.force_unit_access { abi::GIO_IOCTX_FLAG_FUA as u8 } else { 0 },
        reserved0: 0,
    })
}

/// `[start + L*stride, +len)` must lie in one registered range for the first and the last layer —
/// the same range, so every layer in between lies in it too.
fn check_registered(
    memory: &RegisteredMemory,
    what: &'static str,
    start: u64,
    len_bytes: u64,
    stride: u64,
    last_layer: u32,
) -> Result<(), IoctxFault> {
    let outside =
        |layer: u32, start: u64| IoctxFault::OutsideRegisteredMemory { what, range: IovaRange::new(Iova(start), len_bytes), layer };
    let first = memory.range_of(start).filter(|r| r.contains(start, len_bytes)).ok_or_else(|| outside(0, start))?;
    let last_start = at_layer(start, stride, last_layer).ok_or(IoctxFault::AddressOverflow { layer: last_layer })?;
    if !first.contains(last_start, len_bytes) {
        return Err(outside(last_layer, last_start));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn devices() -> DeviceTable {
        DeviceTable::new(vec![
            DeviceInfo { nsid: 1, capacity_blocks: 1000, block_bytes: 512, sgl_supported: true },
            DeviceInfo { nsid: 1, capacity_blocks: 1 << 20, block_bytes: 4096, sgl_supported: false },
        ])
    }

    fn memory() -> RegisteredMemory {
        RegisteredMemory::new(vec![IovaRange::new(Iova(0x10_0000), 0x10_0000), IovaRange::new(Iova(0x80_0000), 0x1000)]).unwrap()
    }

    fn good() -> IoctxSpec {
        IoctxSpec {
            device: DeviceIndex(0),
            nsid: 1,
            start_lba: Lba(10),
            block_count: 8,
            data: Iova(0x10_0000),
            descriptor: Descriptor::SglInline,
            force_unit_access: true,
        }
    }

    fn layered(layers: u32) -> IocbSpec {
        IocbSpec {
            opcode: Opcode::Read,
            user_data: 0,
            layer_count: layers,
            lba_stride_blocks: 100,
            mem_stride_bytes: 0x1000,
            desc_stride_bytes: 0x10,
        }
    }

    fn check(spec: IoctxSpec, iocb: IocbSpec) -> Result<gio_ioctx, IoctxFault> {
        encode_ioctx(&spec, &iocb, &devices(), &memory())
    }

    #[test]
    fn a_good_ioctx_is_encoded_field_by_field() {
        let ioctx = check(good(), layered(9)).unwrap();
        assert_eq!(ioctx.data_iova, 0x10_0000);
        assert_eq!(ioctx.data_bytes, 4096);
        assert_eq!(ioctx.start_lba, 10);
        assert_eq!(ioctx.desc_iova, 0);
        assert_eq!(u32::from(ioctx.descriptor_kind), abi::GIO_DESCRIPTOR_SGL);
        assert_eq!(u32::from(ioctx.flags), abi::GIO_IOCTX_FLAG_FUA);
    }

    #[test]
    fn each_bad_input_gets_its_own_fault() {
        // Goal: every rejection reason of the issue is reachable and typed.
        let iocb = layered(1);
        type Case = (IoctxSpec, IocbSpec, fn(&IoctxFault) -> bool);
        let cases: Vec<Case> = vec![
            (IoctxSpec { device: DeviceIndex(2), ..good() }, iocb, |f| matches!(f, IoctxFault::UnknownDevice { device_count: 2, .. })),
            (IoctxSpec { block_count: 0, ..good() }, iocb, |f| matches!(f, IoctxFault::ZeroLength)),
            (IoctxSpec { block_count: 65537, ..good() }, iocb, |f| matches!(f, IoctxFault::TooManyBlocks { .. })),
            (IoctxSpec { nsid: 2, ..good() }, iocb, |f| matches!(f, IoctxFault::WrongNamespace { .. })),
            (IoctxSpec { start_lba: Lba(993), ..good() }, iocb, |f| matches!(f, IoctxFault::LbaOutOfRange { layer: 0, .. })),
            // In range at layer 0, out of range at layer 10 (10 + 10*100 + 8 > 1000).
            (good(), layered(11), |f| matches!(f, IoctxFault::LbaOutOfRange { layer: 10, .. })),
            (IoctxSpec { data: Iova(0x7F_0000), ..good() }, iocb, |f| {
                matches!(f, IoctxFault::OutsideRegisteredMemory { what: "data", layer: 0, .. })
            }),
            // Straddles the end of a range.
            (IoctxSpec { data: Iova(0x1F_F800), ..good() }, iocb, |f| matches!(f, IoctxFault::OutsideRegisteredMemory { .. })),
            (IoctxSpec { descriptor: Descriptor::SglSegment { segment: IovaRange::new(Iova(0x90_0000), 32) }, ..good() }, iocb, |f| {
                matches!(f, IoctxFault::OutsideRegisteredMemory { what: "descriptor", .. })
            }),
            (IoctxSpec { descriptor: Descriptor::SglSegment { segment: IovaRange::new(Iova(0x80_0000), 24) }, ..good() }, iocb, |f| {
                matches!(f, IoctxFault::BadSglSegment { desc_bytes: 24 })
            }),
            (IoctxSpec { device: DeviceIndex(1), ..good() }, iocb, |f| matches!(f, IoctxFault::SglUnsupported)),
            (IoctxSpec { start_lba: Lba(u64::MAX - 2), ..good() }, iocb, |f| matches!(f, IoctxFault::LbaOutOfRange { .. })),
        ];
        for (index, (spec, iocb, expected)) in cases.into_iter().enumerate() {
            let fault = check(spec, iocb).expect_err(&format!("case {index} must fail"));
            assert!(expected(&fault), "case {index}: unexpected {fault:?}");
        }
    }

    #[test]
    fn prp_descriptor_and_layer_strides_are_checked_at_the_last_layer() {
        let prp = IoctxSpec {
            device: DeviceIndex(1),
            block_count: 2,
            descriptor: Descriptor::Prp { prp2: Some(IovaRange::new(Iova(0x80_0000), 8)) },
            ..good()
        };
        let ok = check(prp, layered(1)).unwrap();
        assert_eq!(ok.desc_iova, 0x80_0000);
        assert_eq!(u32::from(ok.descriptor_kind), abi::GIO_DESCRIPTOR_PRP);
        // With 0x10 descriptor stride, layer 0x200 puts the list outside its 0x1000-byte range.
        let fault = check(prp, IocbSpec { layer_count: 0x200, lba_stride_blocks: 0, mem_stride_bytes: 0, ..layered(1) }).unwrap_err();
        assert!(matches!(fault, IoctxFault::OutsideRegisteredMemory { what: "descriptor", layer: 0x1FF, .. }), "{fault:?}");
    }

    #[test]
    fn overlapping_registrations_are_refused() {
        assert!(RegisteredMemory::new(vec![IovaRange::new(Iova(0), 0x2000), IovaRange::new(Iova(0x1000), 0x1000),]).is_none());
        assert!(RegisteredMemory::new(vec![IovaRange::new(Iova(u64::MAX), 2)]).is_none());
    }
}
