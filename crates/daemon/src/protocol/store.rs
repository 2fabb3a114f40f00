//! The store path's messages (docs/tuttid.md, "Wire protocol"): registering a client's memory
//! window, attaching its queue pairs, the pool's shape, and the per-request prepare / commit /
//! release. Encoded and decoded with the same bounds-checked reader as the rest of the protocol;
//! every count is checked against the bytes left before anything is allocated from it.

use objstore::format::SlotAddressing;
use objstore::{BlockLocation, DeviceLayout, MismatchedBlock, ModelGeometry, Placement, Transferred};

use super::{put_u16, put_u32, put_u64, BodyReader, Kind, ProtocolError, Reply, Request};

/// Most pool devices a shape or an attach may list (the pool's own cap is u16::MAX; a node has
/// a handful).
pub const DEVICES_MAX: usize = 256;
/// Most namespaces one queue grant may list.
pub const NAMESPACES_MAX: usize = 16;
/// Most blocks one `PrepareRetrieve` / `PrepareStore` may name: its reply carries a placement
/// (and, for a retrieve in a pool that records them, a CRC) per block, and must fit one frame.
/// Checked before anything is reserved. Only pools of 1–3 tokens per block reach it: a request
/// names at least `block_tokens` tokens per block, 4 bytes each, within the same body cap.
pub const PREPARE_BLOCKS_MAX: usize = (super::BODY_BYTES_MAX as usize - 64) / (PLACEMENT_BYTES + 4);
/// The engine block `ids` names twice (the least such), if any. `scratch` receives the sorted
/// ids: kept by the caller, it is allocated once, not per request. The daemon refuses such a
/// prepare before reserving (`check_prepare`), and `RemoteKvStore` knows it for one it sends.
pub fn block_named_twice(ids: &[u32], scratch: &mut Vec<u32>) -> Option<u32> {
    scratch.clear();
    scratch.extend_from_slice(ids);
    scratch.sort_unstable();
    scratch.windows(2).find(|pair| pair[0] == pair[1]).map(|pair| pair[0])
}
/// Most corrupt blocks one `Release` can report and still fit one frame (its handle,
/// transferred bytes and commands, and the count come first): 47,661, fewer than a retrieve
/// may name ([`PREPARE_BLOCKS_MAX`]). A client with more reports these and logs the rest
/// (`RemoteKvStore::finish`): they stay indexed until a later verified retrieve finds them.
pub const RELEASE_CORRUPT_BLOCKS_MAX: usize = (super::BODY_BYTES_MAX as usize - 8 - 16 - 4) / MISMATCHED_BLOCK_BYTES;

/// `RegisterMemory`: the client's sealed memfd (one descriptor with the frame) of
/// `window_bytes`, of which the engine's KV blocks use `kv_blocks` (block ids below it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterMemory {
    pub window_bytes: u64,
    pub kv_blocks: u32,
}

/// Where the daemon mapped a registered window in the devices' DMA space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    pub registration: u64,
    pub iova_base: u64,
    /// The DMA space's id (`AddressSpaceId`): the client's `DmaWindow` carries it.
    pub address_space: u64,
}

/// Byte offsets, in the registered window, of one device's submission and completion rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingOffsets {
    pub submission_offset: u64,
    pub completion_offset: u64,
}

/// `AttachQueues`: one detached queue pair per pool device (in pool order), `depth` entries,
/// rings at `rings[i]` in the window of `registration`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachQueues {
    pub registration: u64,
    pub depth: u32,
    pub rings: Vec<RingOffsets>,
}

/// A namespace a client's queue may address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceGrant {
    pub nsid: u32,
    pub lba_bytes: u32,
    pub size_blocks: u64,
}

/// One created queue pair, as `IoQueuePair::attach` needs it (the host addresses of the rings
/// are the client's own and do not travel).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueGrant {
    pub queue_id: u16,
    pub depth: u32,
    pub submission_iova: u64,
    pub completion_iova: u64,
    pub submission_doorbell_offset: u64,
    pub completion_doorbell_offset: u64,
    pub namespaces: Vec<NamespaceGrant>,
    /// SGL data pointers (else PRP).
    pub sgl: bool,
    /// The controller requires SGL Data Blocks of whole dwords (Identify SGLS bits 1:0 = 10b):
    /// the client's pair refuses other lengths, as the daemon's own pairs do.
    pub sgl_dword_lengths: bool,
    pub max_transfer_bytes: u64,
    /// Index, in the reply frame's descriptors, of the controller's register page memfd.
    pub register_fd: u8,
    pub register_bytes: u64,
}

/// `PrepareRetrieve` / `PrepareStore`: blocks `first_block..first_block + block_ids.len()` of
/// the prefix `tokens` (full blocks count) move to or from the engine blocks `block_ids` of
/// `registration`'s KV memory. Keys come from the session's key space. A retrieve from
/// `first_block` > 0 leaves the blocks before it (the engine's own) alone; a store starts at 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepare {
    pub registration: u64,
    pub tokens: Vec<u32>,
    pub block_ids: Vec<u32>,
    pub first_block: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetrievePrepared {
    pub handle: u64,
    pub placements: Vec<Placement>,
    /// The CRCs recorded at commit, one per placement, when the pool records them.
    pub expected_crcs: Option<Vec<u32>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorePrepared {
    pub handle: u64,
    pub new_blocks: u32,
    pub shared_blocks: u32,
    pub evicted_slots: u32,
    /// The new blocks' placements (what this client writes).
    pub placements: Vec<Placement>,
}

/// `Commit`: every layer of the store is written; its payload CRCs when the pool records them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    pub handle: u64,
    pub payload_crcs: Option<Vec<u32>>,
    /// What the client's data path moved for the request (`StoreData::transferred`), checked
    /// against the request's placements and counted in `/metrics` (protocol version 3).
    pub transferred: Transferred,
}

fn put_u32s(out: &mut Vec<u8>, values: &[u32]) {
    put_u32(out, values.len() as u32);
    for &value in values {
        put_u32(out, value);
    }
}

fn put_optional_u32s(out: &mut Vec<u8>, values: Option<&[u32]>) {
    match values {
        None => out.push(0),
        Some(values) => {
            out.push(1);
            put_u32s(out, values);
        }
    }
}

/// Bytes of one placement on the wire: device u16, slot u32, index u16, engine block u32.
const PLACEMENT_BYTES: usize = 12;
/// Bytes of one mismatched block on the wire: prefix index u32, engine block u32, device u16,
/// slot u32, expected and computed CRC u32.
const MISMATCHED_BLOCK_BYTES: usize = 22;

fn put_transferred(out: &mut Vec<u8>, transferred: &Transferred) {
    put_u64(out, transferred.bytes);
    put_u64(out, transferred.commands);
}

fn put_mismatched_blocks(out: &mut Vec<u8>, blocks: &[MismatchedBlock]) {
    put_u32(out, blocks.len() as u32);
    for block in blocks {
        put_u32(out, u32::try_from(block.position).unwrap_or(u32::MAX));
        put_u32(out, block.engine_block);
        put_u16(out, block.device);
        put_u32(out, block.slot);
        put_u32(out, block.expected_crc);
        put_u32(out, block.computed_crc);
    }
}

fn put_placements(out: &mut Vec<u8>, placements: &[Placement]) {
    put_u32(out, placements.len() as u32);
    for placement in placements {
        put_u16(out, placement.location.device);
        put_u32(out, placement.location.slot);
        put_u16(out, placement.location.index);
        put_u32(out, placement.engine_block);
    }
}

impl BodyReader<'_> {
    /// A count of items of `item_bytes` each, checked against the bytes left (so a lying count
    /// allocates nothing).
    fn count(&mut self, field: &str, item_bytes: usize) -> Result<usize, ProtocolError> {
        let count = self.u32(field)? as usize;
        if count.saturating_mul(item_bytes) > self.remaining() {
            return Err(self.malformed(format!("{field} {count} but {} bytes left", self.remaining())));
        }
        Ok(count)
    }

    fn u32s(&mut self, field: &str) -> Result<Vec<u32>, ProtocolError> {
        let count = self.count(field, 4)?;
        (0..count).map(|_| self.u32(field)).collect()
    }

    pub(super) fn flag(&mut self, field: &str) -> Result<bool, ProtocolError> {
        match self.bytes(1, field)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.malformed(format!("{field} is {other}, expected 0 or 1"))),
        }
    }

    fn optional_u32s(&mut self, field: &str) -> Result<Option<Vec<u32>>, ProtocolError> {
        if self.flag(field)? {
            self.u32s(field).map(Some)
        } else {
            Ok(None)
        }
    }

    fn placements(&mut self) -> Result<Vec<Placement>, ProtocolError> {
        let count = self.count("placement_count", PLACEMENT_BYTES)?;
        let mut placements = Vec::with_capacity(count);
        for _ in 0..count {
            let device = self.u16("placement device")?;
            let slot = self.u32("placement slot")?;
            let index = self.u16("placement index")?;
            let engine_block = self.u32("placement engine_block")?;
            placements.push(Placement { location: BlockLocation { device, slot, index }, engine_block });
        }
        Ok(placements)
    }

    fn transferred(&mut self) -> Result<Transferred, ProtocolError> {
        Ok(Transferred { bytes: self.u64("transferred bytes")?, commands: self.u64("transferred commands")? })
    }

    fn mismatched_blocks(&mut self) -> Result<Vec<MismatchedBlock>, ProtocolError> {
        let count = self.count("corrupt_block_count", MISMATCHED_BLOCK_BYTES)?;
        let mut blocks = Vec::with_capacity(count);
        for _ in 0..count {
            blocks.push(MismatchedBlock {
                position: self.u32("corrupt position")? as usize,
                engine_block: self.u32("corrupt engine_block")?,
                device: self.u16("corrupt device")?,
                slot: self.u32("corrupt slot")?,
                expected_crc: self.u32("corrupt expected_crc")?,
                computed_crc: self.u32("corrupt computed_crc")?,
            });
        }
        Ok(blocks)
    }

    fn prepare(&mut self) -> Result<Prepare, ProtocolError> {
        Ok(Prepare {
            registration: self.u64("registration")?,
            tokens: self.u32s("token_count")?,
            block_ids: self.u32s("block_count")?,
            first_block: self.u32("first_block")?,
        })
    }

    fn pool_shape(&mut self) -> Result<objstore::PoolShape, ProtocolError> {
        let geometry = ModelGeometry {
            layers: self.u32("layers")?,
            kv_heads: self.u32("kv_heads")?,
            head_dim: self.u32("head_dim")?,
            dtype_bytes: self.u32("dtype_bytes")?,
            block_tokens: self.u32("block_tokens")?,
        };
        let blocks_per_slot = self.u32("blocks_per_slot")?;
        let layer_stride_blocks = self.u64("layer_stride_blocks")?;
        let payload_crcs = self.flag("payload_crcs")?;
        let count = usize::from(self.u16("device_count")?);
        if count > DEVICES_MAX {
            return Err(self.malformed(format!("{count} devices, at most {DEVICES_MAX}")));
        }
        let mut devices = Vec::with_capacity(count);
        for _ in 0..count {
            devices.push(DeviceLayout {
                nsid: self.u32("nsid")?,
                addressing: SlotAddressing {
                    data_lba: self.u64("data_lba")?,
                    slot_blocks: self.u64("slot_blocks")?,
                    pair_blocks: self.u64("pair_blocks")?,
                    lba_shift: self.u32("lba_shift")?,
                },
                slot_count: self.u64("slot_count")?,
                lba_bytes: self.u32("lba_bytes")?,
                capacity_blocks: self.u64("capacity_blocks")?,
                max_transfer_bytes: self.u64("max_transfer_bytes")?,
                sgl_supported: self.flag("sgl_supported")?,
            });
        }
        Ok(objstore::PoolShape { geometry, blocks_per_slot, layer_stride_blocks, payload_crcs, devices })
    }

    fn queue_grant(&mut self) -> Result<QueueGrant, ProtocolError> {
        let queue_id = self.u16("queue_id")?;
        let depth = self.u32("depth")?;
        let submission_iova = self.u64("submission_iova")?;
        let completion_iova = self.u64("completion_iova")?;
        let submission_doorbell_offset = self.u64("submission_doorbell_offset")?;
        let completion_doorbell_offset = self.u64("completion_doorbell_offset")?;
        let count = usize::from(self.u16("namespace_count")?);
        if count > NAMESPACES_MAX {
            return Err(self.malformed(format!("{count} namespaces, at most {NAMESPACES_MAX}")));
        }
        let mut namespaces = Vec::with_capacity(count);
        for _ in 0..count {
            namespaces.push(NamespaceGrant {
                nsid: self.u32("nsid")?,
                lba_bytes: self.u32("lba_bytes")?,
                size_blocks: self.u64("size_blocks")?,
            });
        }
        Ok(QueueGrant {
            queue_id,
            depth,
            submission_iova,
            completion_iova,
            submission_doorbell_offset,
            completion_doorbell_offset,
            namespaces,
            sgl: self.flag("sgl")?,
            sgl_dword_lengths: self.flag("sgl_dword_lengths")?,
            max_transfer_bytes: self.u64("max_transfer_bytes")?,
            register_fd: self.bytes(1, "register_fd")?[0],
            register_bytes: self.u64("register_bytes")?,
        })
    }
}

fn put_pool_shape(out: &mut Vec<u8>, shape: &objstore::PoolShape) {
    let g = &shape.geometry;
    for value in [g.layers, g.kv_heads, g.head_dim, g.dtype_bytes, g.block_tokens, shape.blocks_per_slot] {
        put_u32(out, value);
    }
    put_u64(out, shape.layer_stride_blocks);
    out.push(u8::from(shape.payload_crcs));
    put_u16(out, shape.devices.len().min(DEVICES_MAX) as u16);
    for device in shape.devices.iter().take(DEVICES_MAX) {
        put_u32(out, device.nsid);
        let a = &device.addressing;
        put_u64(out, a.data_lba);
        put_u64(out, a.slot_blocks);
        put_u64(out, a.pair_blocks);
        put_u32(out, a.lba_shift);
        put_u64(out, device.slot_count);
        put_u32(out, device.lba_bytes);
        put_u64(out, device.capacity_blocks);
        put_u64(out, device.max_transfer_bytes);
        out.push(u8::from(device.sgl_supported));
    }
}

fn put_queue_grant(out: &mut Vec<u8>, grant: &QueueGrant) {
    put_u16(out, grant.queue_id);
    put_u32(out, grant.depth);
    put_u64(out, grant.submission_iova);
    put_u64(out, grant.completion_iova);
    put_u64(out, grant.submission_doorbell_offset);
    put_u64(out, grant.completion_doorbell_offset);
    put_u16(out, grant.namespaces.len().min(NAMESPACES_MAX) as u16);
    for namespace in grant.namespaces.iter().take(NAMESPACES_MAX) {
        put_u32(out, namespace.nsid);
        put_u32(out, namespace.lba_bytes);
        put_u64(out, namespace.size_blocks);
    }
    out.push(u8::from(grant.sgl));
    out.push(u8::from(grant.sgl_dword_lengths));
    put_u64(out, grant.max_transfer_bytes);
    out.push(grant.register_fd);
    put_u64(out, grant.register_bytes);
}

/// Encodes a store-path request's body; `false` if `request` is not one.
pub(super) fn encode_request(request: &Request, out: &mut Vec<u8>) -> bool {
    match request {
        Request::RegisterMemory(register) => {
            put_u64(out, register.window_bytes);
            put_u32(out, register.kv_blocks);
        }
        Request::AttachQueues(attach) => {
            put_u64(out, attach.registration);
            put_u32(out, attach.depth);
            put_u32(out, attach.rings.len() as u32);
            for rings in &attach.rings {
                put_u64(out, rings.submission_offset);
                put_u64(out, rings.completion_offset);
            }
        }
        Request::PoolShape => {}
        Request::PrepareRetrieve(prepare) | Request::PrepareStore(prepare) => {
            put_u64(out, prepare.registration);
            put_u32s(out, &prepare.tokens);
            put_u32s(out, &prepare.block_ids);
            put_u32(out, prepare.first_block);
        }
        Request::Commit(commit) => {
            put_u64(out, commit.handle);
            put_optional_u32s(out, commit.payload_crcs.as_deref());
            put_transferred(out, &commit.transferred);
        }
        Request::Release { handle, transferred, corrupt_blocks } => {
            put_u64(out, *handle);
            put_transferred(out, transferred);
            put_mismatched_blocks(out, corrupt_blocks);
        }
        _ => return false,
    }
    true
}

/// Decodes a store-path request of `kind` (`None`: not one of these kinds).
pub(super) fn decode_request(kind: Kind, r: &mut BodyReader<'_>) -> Result<Option<Request>, ProtocolError> {
    Ok(Some(match kind {
        Kind::RegisterMemory => {
            Request::RegisterMemory(RegisterMemory { window_bytes: r.u64("window_bytes")?, kv_blocks: r.u32("kv_blocks")? })
        }
        Kind::AttachQueues => {
            let registration = r.u64("registration")?;
            let depth = r.u32("depth")?;
            let count = r.count("ring_count", 16)?;
            if count > DEVICES_MAX {
                return Err(r.malformed(format!("{count} ring pairs, at most {DEVICES_MAX}")));
            }
            let mut rings = Vec::with_capacity(count);
            for _ in 0..count {
                rings.push(RingOffsets { submission_offset: r.u64("submission_offset")?, completion_offset: r.u64("completion_offset")? });
            }
            Request::AttachQueues(AttachQueues { registration, depth, rings })
        }
        Kind::PoolShape => Request::PoolShape,
        Kind::PrepareRetrieve => Request::PrepareRetrieve(r.prepare()?),
        Kind::PrepareStore => Request::PrepareStore(r.prepare()?),
        Kind::Commit => Request::Commit(Commit {
            handle: r.u64("handle")?,
            payload_crcs: r.optional_u32s("payload_crcs")?,
            transferred: r.transferred()?,
        }),
        Kind::Release => {
            Request::Release { handle: r.u64("handle")?, transferred: r.transferred()?, corrupt_blocks: r.mismatched_blocks()? }
        }
        _ => return Ok(None),
    }))
}

/// Encodes a store-path reply's body; `false` if `reply` is not one.
pub(super) fn encode_reply(reply: &Reply, out: &mut Vec<u8>) -> bool {
    match reply {
        Reply::Registered(registered) => {
            put_u64(out, registered.registration);
            put_u64(out, registered.iova_base);
            put_u64(out, registered.address_space);
        }
        Reply::Attached { queues } => {
            put_u16(out, queues.len().min(DEVICES_MAX) as u16);
            for grant in queues.iter().take(DEVICES_MAX) {
                put_queue_grant(out, grant);
            }
        }
        Reply::PoolShape(shape) => put_pool_shape(out, shape),
        Reply::RetrievePrepared(prepared) => {
            put_u64(out, prepared.handle);
            put_placements(out, &prepared.placements);
            put_optional_u32s(out, prepared.expected_crcs.as_deref());
        }
        Reply::StorePrepared(prepared) => {
            put_u64(out, prepared.handle);
            put_u32(out, prepared.new_blocks);
            put_u32(out, prepared.shared_blocks);
            put_u32(out, prepared.evicted_slots);
            put_placements(out, &prepared.placements);
        }
        Reply::Committed { stored } => put_u32(out, *stored),
        Reply::Released => {}
        _ => return false,
    }
    true
}

/// Decodes a store-path reply of `kind` (`None`: not one of these kinds).
pub(super) fn decode_reply(kind: Kind, r: &mut BodyReader<'_>) -> Result<Option<Reply>, ProtocolError> {
    Ok(Some(match kind {
        Kind::Registered => Reply::Registered(Registered {
            registration: r.u64("registration")?,
            iova_base: r.u64("iova_base")?,
            address_space: r.u64("address_space")?,
        }),
        Kind::Attached => {
            let count = usize::from(r.u16("queue_count")?);
            if count > DEVICES_MAX {
                return Err(r.malformed(format!("{count} queues, at most {DEVICES_MAX}")));
            }
            let mut queues = Vec::with_capacity(count);
            for _ in 0..count {
                queues.push(r.queue_grant()?);
            }
            Reply::Attached { queues }
        }
        Kind::PoolShapeReply => Reply::PoolShape(r.pool_shape()?),
        Kind::RetrievePrepared => Reply::RetrievePrepared(RetrievePrepared {
            handle: r.u64("handle")?,
            placements: r.placements()?,
            expected_crcs: r.optional_u32s("expected_crcs")?,
        }),
        Kind::StorePrepared => Reply::StorePrepared(StorePrepared {
            handle: r.u64("handle")?,
            new_blocks: r.u32("new_blocks")?,
            shared_blocks: r.u32("shared_blocks")?,
            evicted_slots: r.u32("evicted_slots")?,
            placements: r.placements()?,
        }),
        Kind::Committed => Reply::Committed { stored: r.u32("stored")? },
        Kind::Released => Reply::Released,
        _ => return Ok(None),
    }))
}
