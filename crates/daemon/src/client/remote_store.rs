//! [`RemoteKvStore`]: the layer-wise KV store of an engine process whose pool is tuttid's.
//!
//! Per request it asks the daemon (lookup; prepare = reserve + placements; commit; release);
//! per layer it does not: at connect it creates one memfd window (its KV memory, the mapping
//! table, one queue pair's rings and scratch pages per pool device), registers it with the
//! daemon, attaches the queue pairs the daemon created in it (doorbells through the software
//! controller's shared register page), and runs objstore's own [`StoreData`] over them with a
//! CPU executor. `retrieve_layer` / `store_layer` / `wait` / `poll` are `StoreData`'s calls and
//! send nothing on the socket ([`RemoteKvStore::requests_sent`] proves it in the tests).
//!
//! The engine holds the daemon's request handles; the data half holds each request in one of
//! this process's `StoreConfig::requests_max` slots, and every call translates
//! (`request_slots.rs`): the daemon numbers the requests of all its sessions together.
//!
//! The KV memory lies in the window in the layout the engine asks for ([`WindowKvLayout`]:
//! block-major by default, or per-layer tensors as engines allocate them), so that an engine
//! can use it as its KV cache in place ([`RemoteKvStore::kv_regions`], what the Python package
//! hands out as tensors): memory this process allocated elsewhere cannot be reached by the
//! daemon's devices, only the shared window can. Rust callers read and write the KV bytes
//! through copying accessors ([`RemoteKvStore::write_block`], [`RemoteKvStore::read_block`]):
//! the device writes that memory, so no Rust reference into it is ever handed out.
//!
//! With [`RemoteKvStore::connect_with_device_memory`] the KV blocks stay in the engine's device
//! memory (GPU memory through CUDA IPC, registered with `RegisterDeviceMemory`; `gpu_export.rs`)
//! and the window holds only the rings and the mapping table.
//!
//! Everything the daemon sends is untrusted: the pool's shape is checked
//! (`PoolShape::check`), every prepare reply against the request it answers
//! (`reply_checks.rs`: the engine blocks named, their count and order), every placement by
//! `StoreData::prepare`, every queue layout by
//! `IoQueuePair::attach` (doorbells from the register page's own CAP.DSTRD, rings at the IOVAs
//! this process allocated), every register page by `SharedMemory::from_fd`.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::{CpuExecutor, SmBudget};
use nvme_driver::hw::{AddressSpaceId, DmaAllocator, DmaRegion, DmaWindow, RegisterIo, SharedMemory, SharedRegisters};
use nvme_driver::spec::{COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use nvme_driver::{AttachedQueueConfig, DataPointerMode, DetachedQueueLayout, HwError, IoQueuePair, Iova, Namespace, NamespaceId, QueueId};
use objstore::{
    Direction, KvKind, KvLayout, KvRegistration, KvRequest, LayerKvStore, ModelGeometry, ObjstoreError, Placement, RemoteFailure,
    RequestHandle, StoreConfig, StoreData, StorePlan, Transferred,
};

use super::{Client, DeviceKvMemory};
use crate::protocol::{
    block_named_twice, AttachQueues, Commit, ErrorCode, Hello, HelloReply, Kind, Prepare, QueueGrant, RegisterMemory, Reply, Request,
    RingOffsets, PREPARE_BLOCKS_MAX,
};
use crate::DaemonError;

#[cfg(test)]
mod busy_hellos;
mod reply_checks;
mod request_slots;
#[cfg(test)]
mod store_refusals;
#[cfg(test)]
mod tampered_replies;
use reply_checks::{check_retrieve, check_store};
use request_slots::{to_daemon, RequestSlots};

/// Bytes per page of the window (rings and regions are page aligned).
const PAGE_BYTES: u64 = 4096;
/// Per-slot scratch page of an attached queue pair (nvme-driver's `SCRATCH_BYTES`).
const SCRATCH_PAGE_BYTES: u64 = 4096;
/// Room left in the window for allocator rounding and small regions.
const WINDOW_SLACK_BYTES: u64 = 1 << 20;

/// How a remote store is set up.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// Engine KV blocks in the window (block ids below it).
    pub kv_blocks: u32,
    /// Entries of each queue pair.
    pub queue_depth: u32,
    /// The data half's sizes (`verify_retrieves` needs a pool that records CRCs).
    pub store: StoreConfig,
    /// The longest wait for a daemon reply.
    pub timeout: Duration,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self { kv_blocks: 64, queue_depth: 64, store: StoreConfig::default(), timeout: Duration::from_secs(5) }
    }
}

/// How the engine's KV memory is laid out in the window: objstore's [`KvLayout`] kinds, each
/// tensor a page-aligned region of the window, allocated in the order
/// [`RemoteKvStore::kv_regions`] lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WindowKvLayout {
    /// One region `[blocks, layers, 2, object]` (`KvLayout::BlockMajor`).
    #[default]
    BlockMajor,
    /// Per layer a K region and a V region of `blocks` objects: all K regions (layer order),
    /// then all V regions (`KvLayout::SeparateKv`).
    SeparateKv,
    /// Per layer one region `[2, blocks, object]` (`KvLayout::FusedPerLayer`).
    FusedPerLayer,
    /// Per layer one region of `blocks` runs of `2 * object` bytes, K and V together in each
    /// (`KvLayout::PagedPerLayer`: vLLM 0.32's paged view).
    PagedPerLayer,
}

impl WindowKvLayout {
    /// The size of each region, in `kv_regions` order.
    fn region_bytes(self, geometry: &ModelGeometry, kv_blocks: u32) -> Result<Vec<u64>, ObjstoreError> {
        let layers = geometry.layers as usize;
        let object = geometry.object_bytes();
        let overflow = || ObjstoreError::AddressOverflow { what: format!("{kv_blocks} KV blocks of {geometry}") };
        let blocks = u64::from(kv_blocks);
        Ok(match self {
            WindowKvLayout::BlockMajor => vec![blocks.checked_mul(geometry.block_bytes()).ok_or_else(overflow)?],
            WindowKvLayout::SeparateKv => vec![blocks.checked_mul(object).ok_or_else(overflow)?; 2 * layers],
            WindowKvLayout::FusedPerLayer | WindowKvLayout::PagedPerLayer => {
                vec![blocks.checked_mul(2 * object).ok_or_else(overflow)?; layers]
            }
        })
    }

    /// The registration's layout over `regions` (as `region_bytes` sized them).
    fn layout(self, geometry: &ModelGeometry, regions: &[DmaRegion]) -> KvLayout {
        let object = geometry.object_bytes();
        let bases = || regions.iter().map(DmaRegion::iova).collect::<Vec<_>>();
        match self {
            WindowKvLayout::BlockMajor => KvLayout::BlockMajor { base: regions[0].iova(), block_stride_bytes: geometry.block_bytes() },
            WindowKvLayout::SeparateKv => {
                let (keys, values) = regions.split_at(regions.len() / 2);
                KvLayout::SeparateKv {
                    key_bases: keys.iter().map(DmaRegion::iova).collect(),
                    value_bases: values.iter().map(DmaRegion::iova).collect(),
                    block_stride_bytes: object,
                }
            }
            WindowKvLayout::FusedPerLayer => KvLayout::FusedPerLayer { layer_bases: bases(), block_stride_bytes: object },
            WindowKvLayout::PagedPerLayer => KvLayout::PagedPerLayer { layer_bases: bases(), block_stride_bytes: 2 * object },
        }
    }
}

/// A [`LayerKvStore`] whose control half is tuttid (module docs).
pub struct RemoteKvStore {
    /// Declared first, so dropped first: the attached pairs go before the window.
    data: StoreData<CpuExecutor>,
    client: Client,
    hello: HelloReply,
    registration: u64,
    /// The KV memory's regions (`WindowKvLayout` order); none when it is the engine's device memory.
    kv: Vec<DmaRegion>,
    kv_layout: WindowKvLayout,
    block_bytes: u64,
    /// The rings of every attached pair: kept until the daemon deleted the queues (the attach
    /// contract), i.e. for the life of this store (the daemon deletes them when the session ends).
    _rings: Vec<(DmaRegion, DmaRegion)>,
    window: DmaWindow,
    payload_crcs: bool,
    crcs: Vec<u32>,
    /// What the daemon accepted of this store's reports, per direction (retrieve, store).
    reported: [Transferred; 2],
    /// The queue ids the daemon granted, one per pool device.
    queue_ids: Vec<u16>,
    /// Which daemon request each of the data half's request slots holds.
    slots: RequestSlots,
    /// Lookups answered a miss with a warning logged (tests count them).
    lookup_warnings: u64,
    /// A prompt too long for one `Lookup` was warned about (once per store).
    long_prompt_warned: bool,
}

/// `layout` with its offsets (from the device memory's start) moved to `base`, the IOVA the
/// daemon gave the range; a block-major stride of 0 becomes the pool's `block_bytes`.
fn offset_layout(layout: KvLayout, base: Iova, block_bytes: u64) -> Result<KvLayout, ObjstoreError> {
    let at = |offset: Iova| {
        base.checked_add(offset.0)
            .ok_or_else(|| ObjstoreError::AddressOverflow { what: format!("device memory offset {:#x} from {base}", offset.0) })
    };
    let each = |offsets: Vec<Iova>| offsets.into_iter().map(at).collect::<Result<Vec<_>, _>>();
    Ok(match layout {
        KvLayout::BlockMajor { base: offset, block_stride_bytes } => KvLayout::BlockMajor {
            base: at(offset)?,
            block_stride_bytes: if block_stride_bytes == 0 { block_bytes } else { block_stride_bytes },
        },
        KvLayout::SeparateKv { key_bases, value_bases, block_stride_bytes } => {
            KvLayout::SeparateKv { key_bases: each(key_bases)?, value_bases: each(value_bases)?, block_stride_bytes }
        }
        KvLayout::FusedPerLayer { layer_bases, block_stride_bytes } => {
            KvLayout::FusedPerLayer { layer_bases: each(layer_bases)?, block_stride_bytes }
        }
        KvLayout::PagedPerLayer { layer_bases, block_stride_bytes } => {
            KvLayout::PagedPerLayer { layer_bases: each(layer_bases)?, block_stride_bytes }
        }
    })
}

/// The daemon client's error as the store's, classified where it can be (a refusal's code, a
/// lost connection, a timeout) so that callers can react by kind. A code the daemon sends only
/// as it ends the connection ([`super::ends_the_connection`]: `ShuttingDown`, `LeaseExpired`,
/// a refused or timed-out frame, ...) is the daemon saying goodbye before it closes: the caller
/// sees the session gone (`Disconnected`, as the Python package classifies them, keeping the
/// code when the goodbye reached it) whether the goodbye or the close reached it first, and
/// reconnects at once. So does a reply to another request or of a kind that does not answer
/// this one (`UnexpectedReply`): the client leaves such a connection out of step. Other
/// failures that leave it so are told by the client's state, not the error: [`remote_after`].
fn remote(error: DaemonError) -> ObjstoreError {
    let failure = match &error {
        DaemonError::Remote { code, .. } if super::ends_the_connection(*code) => RemoteFailure::Disconnected { code: Some(code.to_u16()) },
        DaemonError::Remote { code, .. } => RemoteFailure::Refused { code: code.to_u16() },
        DaemonError::Closed | DaemonError::Truncated { .. } | DaemonError::Io { .. } | DaemonError::UnexpectedReply { .. } => {
            RemoteFailure::Disconnected { code: None }
        }
        DaemonError::Timeout { .. } => RemoteFailure::TimedOut,
        // Refused before a byte was sent (a prepare whose tokens and block ids pass the 1 MiB
        // frame cap; a client name over 64 bytes): the caller's request, and the connection
        // stays usable.
        DaemonError::RequestTooLarge { .. } | DaemonError::ClientNameTooLong { .. } => {
            return ObjstoreError::BadRequest { reason: error.to_string() }
        }
        _ => return ObjstoreError::Remote { reason: error.to_string() },
    };
    ObjstoreError::RemoteFailed { failure, reason: error.to_string() }
}

/// [`remote`] for a failed call on a client that `broken` says ([`Client::is_broken`], read
/// after the call) it left out of step or ended: what [`remote`] can classify only as the
/// daemon's failure (`ObjstoreError::Remote`: a reply whose body does not decode, a frame
/// header or size refused, a lookup answer that does not fit the request: `Protocol`) is then
/// a lost connection too (`Disconnected`, no code), as for a reply that does not answer its
/// request: every later call on that client fails, so the caller reconnects. The classes
/// [`remote`] gives already stay (a goodbye's code, `TimedOut`, a refusal). A `Protocol`
/// error refused before a byte was sent leaves the client in step, so stays `Remote`.
fn remote_after(broken: bool, error: DaemonError) -> ObjstoreError {
    lost_if(broken, remote(error))
}

/// `error` ([`remote`]'s) as a lost connection when `broken` (see [`remote_after`]).
fn lost_if(broken: bool, error: ObjstoreError) -> ObjstoreError {
    match error {
        ObjstoreError::Remote { reason } if broken => {
            ObjstoreError::RemoteFailed { failure: RemoteFailure::Disconnected { code: None }, reason }
        }
        other => other,
    }
}

fn unexpected(asked: Kind, got: &Reply) -> ObjstoreError {
    remote(DaemonError::UnexpectedReply { asked, got: got.kind() })
}

/// Sends `attach` (an `AttachQueues`) and returns the grants and register page descriptors,
/// asked again while Busy ([`call_asking_again_while_busy`]): the daemon says it while an ended
/// session's queue deletion is not confirmed yet (its queue ids, or the controller's admin
/// queue, come free once it is; docs/tuttid.md). A refused attach leaves nothing at the daemon
/// (no pair, no id held: `Holdings::attach`), and the rings in the window were never given to a
/// queue, so the same request is valid again.
fn attach_queues(client: &mut Client, attach: &Request, timeout: Duration) -> Result<(Vec<QueueGrant>, Vec<OwnedFd>), ObjstoreError> {
    match call_asking_again_while_busy(client, attach, &[], timeout)? {
        (Reply::Attached { queues }, fds) => Ok((queues, fds)),
        (other, _) => Err(unexpected(Kind::AttachQueues, &other)),
    }
}

/// Sends `request` with `fds` and returns the reply. Busy is transient (an AttachQueues, or a
/// session's first registration, while an ended session's queue deletion is not confirmed yet,
/// or while other sessions hold the request reservations the new one needs: docs/tuttid.md), so
/// it is asked again on the same connection, after a pause, until `timeout` has passed; then the
/// last Busy is the error, saying so. The daemon refuses these before taking anything (the
/// descriptors sent with a refused one are closed there), so the same request is valid again.
fn call_asking_again_while_busy(
    client: &mut Client,
    request: &Request,
    fds: &[BorrowedFd<'_>],
    timeout: Duration,
) -> Result<(Reply, Vec<OwnedFd>), ObjstoreError> {
    let started = Instant::now();
    let deadline = crate::frame_io::deadline_after(started, timeout);
    let mut pauses = super::BusyPauses::new();
    let mut asked = 0u32;
    loop {
        asked += 1;
        match client.call_with_fds(request, fds) {
            Ok(answered) => return Ok(answered),
            Err(DaemonError::Remote { code: ErrorCode::Busy, message }) => {
                tracing::debug!(%message, asked, kind = ?request.kind(), "tuttid answered Busy; asking again");
                if !pauses.pause_before(deadline) {
                    let message = format!(
                        "{:?} answered Busy {asked} time(s) over {:.1} s, the store's timeout being {:.1} s: {message}",
                        request.kind(),
                        started.elapsed().as_secs_f64(),
                        timeout.as_secs_f64()
                    );
                    return Err(remote(DaemonError::Remote { code: ErrorCode::Busy, message }));
                }
            }
            Err(error) => return Err(remote_after(client.is_broken(), error)),
        }
    }
}

/// Connects to tuttid at `socket` and attaches as `hello`. A `Hello` answered Busy (the daemon
/// serves its maximum number of connections) is asked again on a new connection, after a
/// pause, until `timeout` has passed (as the Python package's `hello_daemon`); then the last
/// Busy is the error, saying so. A try after a pause that runs out of time (it may start with
/// only milliseconds left) fails with that last Busy too, not a timeout: the daemon answered,
/// and was full.
fn hello_asking_again_while_busy(socket: &Path, hello: &Hello, timeout: Duration) -> Result<(Client, HelloReply), ObjstoreError> {
    let started = Instant::now();
    let deadline = crate::frame_io::deadline_after(started, timeout);
    let mut pauses = super::BusyPauses::new();
    let mut busy = 0u32;
    let last_busy = |busy: u32, message: &str| {
        let message = format!(
            "Hello answered Busy {busy} time(s) over {:.1} s, the store's timeout being {:.1} s: {message}",
            started.elapsed().as_secs_f64(),
            timeout.as_secs_f64()
        );
        remote(DaemonError::Remote { code: ErrorCode::Busy, message })
    };
    let mut busy_message = String::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        // A failed Hello comes with whether it left its (dropped) client broken: `remote_after`.
        let tried = match Client::connect(socket, left) {
            Ok(mut client) => match client.hello(hello) {
                Ok(attached) => Ok((client, attached)),
                Err(error) => Err((error, client.is_broken())),
            },
            Err(error) => Err((error, false)),
        };
        match tried {
            Ok((mut client, attached)) => {
                client.set_timeout(timeout);
                return Ok((client, attached));
            }
            // The refused connection is closed by now (`tried` held it): a Busy Hello is answered
            // on the daemon's one status-only connection, which it keeps open, so a store that
            // held it through the pause would take that place from `tuttid --status`.
            Err((DaemonError::Remote { code: ErrorCode::Busy, message }, _)) => {
                busy += 1;
                tracing::debug!(%message, busy, "tuttid answered Hello Busy; asking again on a new connection");
                if !pauses.pause_before(deadline) {
                    return Err(last_busy(busy, &message));
                }
                busy_message = message;
            }
            Err((DaemonError::Timeout { .. }, _)) if busy > 0 => return Err(last_busy(busy, &busy_message)),
            Err((error, broken)) => return Err(remote_after(broken, error)),
        }
    }
}

impl RemoteKvStore {
    /// Connects to tuttid at `socket`, attaches as `hello`, and sets up the data path (module
    /// docs) with block-major KV memory. Fails with the daemon's typed refusal (e.g.
    /// `Unsupported` on a pool without a shared register page), or the local check that refused
    /// what it sent.
    pub fn connect(socket: &Path, hello: &Hello, config: &RemoteConfig) -> Result<RemoteKvStore, ObjstoreError> {
        Self::connect_with_layout(socket, hello, config, WindowKvLayout::BlockMajor)
    }

    /// [`RemoteKvStore::connect`] with the KV memory laid out as `kv_layout`.
    pub fn connect_with_layout(
        socket: &Path,
        hello: &Hello,
        config: &RemoteConfig,
        kv_layout: WindowKvLayout,
    ) -> Result<RemoteKvStore, ObjstoreError> {
        let (client, attached) = hello_asking_again_while_busy(socket, hello, config.timeout)?;
        Self::with_client(client, attached, config, kv_layout)
    }

    /// As [`RemoteKvStore::connect`], with the KV blocks in the engine's device memory (GPU
    /// memory through CUDA IPC, or a memfd stand-in: [`DeviceKvMemory`]), which the daemon's
    /// software controllers reach by copies; the window holds only rings and the mapping table.
    /// The engine moves its KV bytes itself (`write_block` / `read_block` refuse). A pool that
    /// records payload CRCs is refused: the CRCs are computed on the CPU from the KV memory.
    pub fn connect_with_device_memory(
        socket: &Path,
        hello: &Hello,
        config: &RemoteConfig,
        kv: &DeviceKvMemory,
    ) -> Result<RemoteKvStore, ObjstoreError> {
        let (client, attached) = hello_asking_again_while_busy(socket, hello, config.timeout)?;
        let block_major = KvLayout::BlockMajor { base: Iova(0), block_stride_bytes: 0 };
        Self::set_up(client, attached, config, WindowKvLayout::BlockMajor, Some((kv, block_major)))
    }

    /// As [`RemoteKvStore::connect_with_device_memory`], on a connection already attached, with
    /// the KV blocks laid out in the device memory as `layout`, whose addresses are byte offsets
    /// from the registered range's start (a block-major layout's stride 0: the pool's block
    /// size). What the Python package uses for an engine's CUDA tensors, which lie in one
    /// allocation in the engine's own layout. `layout` is checked by the registration like any
    /// other (every object inside `kv`'s range is the caller's promise, as for window memory).
    pub fn with_client_and_device_memory(
        client: Client,
        attached: HelloReply,
        config: &RemoteConfig,
        kv: &DeviceKvMemory,
        layout: KvLayout,
    ) -> Result<RemoteKvStore, ObjstoreError> {
        Self::set_up(client, attached, config, WindowKvLayout::BlockMajor, Some((kv, layout)))
    }

    /// Sets up the data path on a connection already attached (`Client::hello` answered
    /// `attached`): asks the pool's shape, creates and registers the window with the KV memory
    /// laid out as `kv_layout`, attaches the queue pairs. A client that only looked up so far
    /// (the engine's scheduler side, turned worker) becomes a store this way.
    pub fn with_client(
        client: Client,
        attached: HelloReply,
        config: &RemoteConfig,
        kv_layout: WindowKvLayout,
    ) -> Result<RemoteKvStore, ObjstoreError> {
        Self::set_up(client, attached, config, kv_layout, None)
    }

    /// The data path on an attached connection, with the KV memory in the window (laid out as
    /// `kv_layout`) or, given `device`, in the engine's device memory (laid out as its layout,
    /// offsets from the range's start).
    fn set_up(
        mut client: Client,
        attached: HelloReply,
        config: &RemoteConfig,
        kv_layout: WindowKvLayout,
        device: Option<(&DeviceKvMemory, KvLayout)>,
    ) -> Result<RemoteKvStore, ObjstoreError> {
        let (device, device_layout) = match device {
            Some((memory, layout)) => (Some(memory), Some(layout)),
            None => (None, None),
        };
        let shape = match client.call(&Request::PoolShape).map_err(|error| remote_after(client.is_broken(), error))? {
            Reply::PoolShape(shape) => shape,
            other => return Err(unexpected(Kind::PoolShape, &other)),
        };
        shape.check()?;
        if device.is_some() && shape.payload_crcs {
            return Err(ObjstoreError::BadRequest {
                reason: "the pool records payload CRCs, which the client computes on the CPU from its KV memory: not from device memory"
                    .into(),
            });
        }
        let geometry = shape.geometry;
        let block_bytes = 2 * u64::from(geometry.layers) * geometry.object_bytes();
        let devices = shape.devices.len() as u64;
        let depth = u64::from(config.queue_depth);
        let round = |bytes: u64| bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let region_bytes = kv_layout.region_bytes(&geometry, config.kv_blocks)?;
        let kv_bytes = region_bytes
            .iter()
            .try_fold(0u64, |sum, &bytes| sum.checked_add(round(bytes)))
            .ok_or_else(|| ObjstoreError::AddressOverflow { what: format!("{} KV blocks of {block_bytes} bytes", config.kv_blocks) })?;
        let per_device = round(depth * SUBMISSION_ENTRY_BYTES as u64)
            + round(depth * COMPLETION_ENTRY_BYTES as u64)
            + depth.saturating_sub(1) * SCRATCH_PAGE_BYTES;
        let table = objstore::mapping_memory(&geometry, kv_bytes);
        let table_bytes = round(table.sgl_bytes.max(table.prp_packed_bytes));
        let window_kv_bytes = if device.is_some() { 0 } else { kv_bytes };
        let window_bytes = window_kv_bytes
            .checked_add(devices * per_device + table_bytes + WINDOW_SLACK_BYTES)
            .ok_or_else(|| ObjstoreError::AddressOverflow { what: "the window".into() })?;
        let window_len = usize::try_from(window_bytes).map_err(|_| ObjstoreError::AddressOverflow { what: "the window".into() })?;
        let memory = SharedMemory::create("tutti-kv-window", window_len).map_err(HwError::from)?;
        let window_kv_blocks = if device.is_some() { 0 } else { config.kv_blocks };
        let register = Request::RegisterMemory(RegisterMemory { window_bytes, kv_blocks: window_kv_blocks });
        let registered = match call_asking_again_while_busy(&mut client, &register, &[memory.fd()], config.timeout)? {
            (Reply::Registered(registered), _) => registered,
            (other, _) => return Err(unexpected(Kind::RegisterMemory, &other)),
        };
        let window = DmaWindow::new(memory, Iova(registered.iova_base), AddressSpaceId(registered.address_space))?;
        // The KV memory first (at the window's base, its regions back to back; or the device
        // memory's own registration), then each device's rings.
        let (kv, kv_registration, device_base) = match device {
            None => {
                let kv = region_bytes.iter().map(|&bytes| window.allocate(bytes as usize)).collect::<Result<Vec<_>, _>>()?;
                (kv, registered.registration, None)
            }
            Some(device) => {
                let request = Request::RegisterDeviceMemory(device.request(config.kv_blocks));
                match call_asking_again_while_busy(&mut client, &request, &device.descriptors(), config.timeout)? {
                    (Reply::Registered(memory), _) => (Vec::new(), memory.registration, Some(Iova(memory.iova_base))),
                    (other, _) => return Err(unexpected(Kind::RegisterDeviceMemory, &other)),
                }
            }
        };
        let mut rings = Vec::with_capacity(shape.devices.len());
        let mut offsets = Vec::with_capacity(shape.devices.len());
        for _ in &shape.devices {
            let submission = window.allocate(config.queue_depth as usize * SUBMISSION_ENTRY_BYTES)?;
            let completion = window.allocate(config.queue_depth as usize * COMPLETION_ENTRY_BYTES)?;
            let offset = |region: &DmaRegion| region.iova().0 - registered.iova_base;
            offsets.push(RingOffsets { submission_offset: offset(&submission), completion_offset: offset(&completion) });
            rings.push((submission, completion));
        }
        let attach =
            Request::AttachQueues(AttachQueues { registration: registered.registration, depth: config.queue_depth, rings: offsets });
        let (grants, register_fds) = attach_queues(&mut client, &attach, config.timeout)?;
        if grants.len() != shape.devices.len() {
            return Err(ObjstoreError::Remote {
                reason: format!("{} queue grants for {} pool devices", grants.len(), shape.devices.len()),
            });
        }
        let mut pairs = Vec::with_capacity(grants.len());
        let mut sgl_everywhere = true;
        for (device, grant) in grants.iter().enumerate() {
            sgl_everywhere &= grant.sgl;
            let fd = register_fds.get(usize::from(grant.register_fd)).ok_or_else(|| ObjstoreError::Remote {
                reason: format!("queue grant {device} names register page descriptor {} of {}", grant.register_fd, register_fds.len()),
            })?;
            let register_bytes =
                usize::try_from(grant.register_bytes).map_err(|_| ObjstoreError::Remote { reason: "register page size".into() })?;
            let page = SharedMemory::from_fd(
                fd.as_fd()
                    .try_clone_to_owned()
                    .map_err(|source| ObjstoreError::Remote { reason: format!("duplicating a register page descriptor: {source}") })?,
                register_bytes,
            )
            .map_err(HwError::from)?;
            let registers: Arc<dyn RegisterIo> = Arc::new(SharedRegisters::new(page));
            let (submission, completion) = &rings[device];
            let pair = IoQueuePair::attach(
                attach_config(grant, submission, completion),
                (submission.clone(), completion.clone()),
                &window,
                registers,
            )?;
            pairs.push(pair);
        }
        let mode = if sgl_everywhere { DataPointerMode::Sgl } else { DataPointerMode::Prp };
        let layout = match (device_base, device_layout) {
            (Some(base), Some(offsets)) => offset_layout(offsets, base, block_bytes)?,
            _ => kv_layout.layout(&geometry, &kv),
        };
        let registration = KvRegistration::new(geometry, config.kv_blocks, layout, mode)?;
        let dma: Arc<dyn DmaAllocator> = Arc::new(window.clone());
        let executor = CpuExecutor::new(pairs, config.store.iocbs);
        let payload_crcs = shape.payload_crcs;
        let queue_ids = grants.iter().map(|grant| grant.queue_id).collect();
        let data = StoreData::new(shape, registration, dma, executor, config.store)?;
        let slots = RequestSlots::new(config.store.requests_max);
        Ok(RemoteKvStore {
            data,
            client,
            hello: attached,
            registration: kv_registration,
            kv,
            kv_layout,
            block_bytes,
            _rings: rings,
            window,
            payload_crcs,
            crcs: Vec::new(),
            reported: [Transferred::default(); 2],
            queue_ids,
            slots,
            lookup_warnings: 0,
            long_prompt_warned: false,
        })
    }

    /// The NVMe queue ids of this store's queue pairs, one per pool device (for diagnostics:
    /// which of a controller's queues are this process's).
    pub fn queue_ids(&self) -> &[u16] {
        &self.queue_ids
    }

    /// What this store reported moving in `direction` and the daemon counted (at commit and
    /// release, including the releases that follow a failed commit or CRC computation, and a
    /// commit that failed while writing): the same figures this session adds to
    /// `tuttid_bytes_total` and `tuttid_commands_total`, except after a lost connection or a
    /// timed-out commit or release, which the daemon may have counted unseen.
    pub fn reported(&self, direction: Direction) -> Transferred {
        self.reported[direction_index(direction)]
    }

    fn count_reported(&mut self, direction: Direction, transferred: Transferred) {
        let total = &mut self.reported[direction_index(direction)];
        total.bytes += transferred.bytes;
        total.commands += transferred.commands;
    }

    /// What the daemon answered to `Hello` (session id, lease, pool summary).
    pub fn hello_reply(&self) -> &HelloReply {
        &self.hello
    }

    /// The connection, for requests beyond the store's (status, ping, raw requests in tests).
    pub fn client(&mut self) -> &mut Client {
        &mut self.client
    }

    /// Requests sent to the daemon so far: per-layer calls add none.
    pub fn requests_sent(&self) -> u64 {
        self.client.requests_sent()
    }

    /// This store's registration id at the daemon.
    pub fn registration(&self) -> u64 {
        self.registration
    }

    /// The registered window (for tests that need an address inside or outside it).
    pub fn window(&self) -> &DmaWindow {
        &self.window
    }

    /// The data half (its queue: tests drive a raw command through it). Its request handles
    /// are this process's slots, not the daemon's handles the store's calls take.
    pub fn data_mut(&mut self) -> &mut StoreData<CpuExecutor> {
        &mut self.data
    }

    /// Bytes of one engine block: all layers, layer l's K then V (as `write_block` and
    /// `read_block` see a block, whatever the layout).
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// The KV memory's regions in the window, in [`WindowKvLayout`] order (one block-major
    /// region; or per layer, K regions then V regions; or one region per layer).
    pub fn kv_regions(&self) -> &[DmaRegion] {
        &self.kv
    }

    pub fn kv_layout(&self) -> WindowKvLayout {
        self.kv_layout
    }

    /// Calls `each(region, offset in it, offset in `len`, length)` for the pieces of bytes
    /// `offset..offset + len` of engine block `block` (layer l's K, then its V, for every l):
    /// one piece per object touched, found through the registration.
    fn for_each_block_piece(
        &self,
        block: u32,
        offset: usize,
        len: usize,
        mut each: impl FnMut(&DmaRegion, usize, usize, usize) -> Result<(), ObjstoreError>,
    ) -> Result<(), ObjstoreError> {
        if self.kv.is_empty() {
            return Err(ObjstoreError::BadRequest {
                reason: "the KV blocks are the engine's device memory: the engine copies them itself".into(),
            });
        }
        let registration = self.data.table().registration();
        registration.check_block(block)?;
        if offset.checked_add(len).is_none_or(|end| end as u64 > self.block_bytes) {
            return Err(ObjstoreError::BadRequest { reason: format!("{len} bytes at {offset} of a {} byte block", self.block_bytes) });
        }
        let object = registration.geometry().object_bytes() as usize;
        let (mut at, end) = (offset, offset + len);
        while at < end {
            let index = at / object;
            let kind = if index.is_multiple_of(2) { KvKind::Key } else { KvKind::Value };
            let address = registration.object_address((index / 2) as u32, kind, block)?;
            let within = at % object;
            let piece = (object - within).min(end - at);
            let start = address.checked_add(within as u64).ok_or_else(|| ObjstoreError::AddressOverflow { what: "a KV object".into() })?;
            let region = self
                .kv
                .iter()
                .find(|region| region.iova() <= start && start.0 - region.iova().0 + piece as u64 <= region.len() as u64)
                .ok_or_else(|| ObjstoreError::InvalidRegistration {
                    reason: format!("object address {:#x} outside the KV memory", start.0),
                })?;
            each(region, (start.0 - region.iova().0) as usize, at - offset, piece)?;
            at += piece;
        }
        Ok(())
    }

    /// Copies `bytes` into engine block `block` at `offset` (the engine's KV tensors).
    pub fn write_block(&self, block: u32, offset: usize, bytes: &[u8]) -> Result<(), ObjstoreError> {
        self.for_each_block_piece(block, offset, bytes.len(), |region, at, from, len| Ok(region.write(at, &bytes[from..from + len])?))
    }

    /// Copies engine block `block`'s bytes from `offset` into `out`.
    pub fn read_block(&self, block: u32, offset: usize, out: &mut [u8]) -> Result<(), ObjstoreError> {
        self.for_each_block_piece(block, offset, out.len(), |region, at, from, len| Ok(region.read(at, &mut out[from..from + len])?))
    }

    /// The blocks a prepared request moves as the daemon placed them (a store's new blocks
    /// only, each naming its engine block).
    pub fn placements(&self, handle: RequestHandle) -> Result<&[Placement], ObjstoreError> {
        let local = self.slots.local(handle)?;
        self.data.placements(local).map_err(|error| to_daemon(error, local, handle))
    }

    /// The layers of the request `handle` (the daemon's) in flight, oldest first.
    pub fn layers_in_flight(&self, handle: RequestHandle) -> Result<impl Iterator<Item = u32> + '_, ObjstoreError> {
        let local = self.slots.local(handle)?;
        self.data.layers_in_flight(local).map_err(|error| to_daemon(error, local, handle))
    }

    /// Where the run of blocks of `tokens`' prefix from `first_block` cached on every
    /// tensor-parallel rank of this session's world ends (from 0: the longest prefix cached on
    /// every rank; the engine scheduler's question).
    pub fn lookup_all_ranks(&mut self, tokens: &[u32], first_block: usize) -> Result<usize, ObjstoreError> {
        let first_block = wire_first_block(first_block)?;
        let looked_up = self.client.lookup_all_ranks_from(tokens, first_block);
        looked_up.map(|blocks| blocks as usize).map_err(|error| remote_after(self.client.is_broken(), error))
    }

    /// Whether the daemon would reserve `request` as a store, as far as the checks it makes
    /// first go (`KvStore`'s): 1..=full blocks of ids (and at most `PREPARE_BLOCKS_MAX`), each
    /// in the registration and named once. Asked only when the store would be refused here
    /// (its allocation off the common path).
    fn store_is_well_formed(&self, request: &KvRequest<'_>) -> bool {
        let full = request.tokens.len() / self.hello_reply().shape.block_tokens.max(1) as usize;
        let blocks = request.block_ids.len();
        let num_blocks = self.data.table().registration().num_blocks();
        if blocks == 0 || blocks > full || blocks > PREPARE_BLOCKS_MAX || request.block_ids.iter().any(|&id| id >= num_blocks) {
            return false;
        }
        block_named_twice(request.block_ids, &mut Vec::new()).is_none()
    }

    /// Prepares the data path of the daemon's request `handle`: takes a request slot here and,
    /// if the reply answers the request (`consistent`: `reply_checks`), prepares `placements`
    /// in it. On failure the slot is free again and the request is released at the daemon,
    /// except when `handle` names a request this process already holds (`HandleState`): that
    /// one is live (its layers may be moving data) and is left alone; the daemon's new request,
    /// whose handle this process never learned, stays reserved until the session ends.
    fn prepare_data(
        &mut self,
        handle: RequestHandle,
        direction: Direction,
        placements: &[Placement],
        expected_crcs: Option<&[u32]>,
        consistent: Result<(), String>,
    ) -> Result<(), ObjstoreError> {
        let local = match self.slots.take(handle) {
            Ok(local) => local,
            Err(error @ ObjstoreError::HandleState { .. }) => return Err(error),
            Err(error) => {
                self.release_remote(handle, direction, Transferred::default());
                return Err(error);
            }
        };
        if let Err(reason) = consistent {
            self.slots.free(handle);
            self.release_remote(handle, direction, Transferred::default());
            return Err(ObjstoreError::Remote { reason: format!("tuttid's reply does not answer the request: {reason}") });
        }
        if let Err(error) = self.data.prepare(local, direction, placements, expected_crcs) {
            // Nothing stays prepared in the data half after a failed prepare.
            self.slots.free(handle);
            self.release_remote(handle, direction, Transferred::default());
            return Err(to_daemon(error, local, handle));
        }
        Ok(())
    }

    /// Ends the data path of the daemon's request `handle` (slot `local`): the slot is free
    /// once the data half's request ended, and only then (a layer in flight keeps both).
    fn finish_data(&mut self, handle: RequestHandle, local: RequestHandle) -> Result<(), ObjstoreError> {
        self.data.finish(local).map_err(|error| to_daemon(error, local, handle))?;
        self.slots.free(handle);
        Ok(())
    }

    fn prepare_request(request: &KvRequest<'_>, registration: u64, first_block: u32) -> Prepare {
        Prepare { registration, tokens: request.tokens.to_vec(), block_ids: request.block_ids.to_vec(), first_block }
    }

    /// Tells the daemon to drop a request in `direction` whose data path ended (or never
    /// began), with what that moved (best effort: the caller is already failing).
    fn release_remote(&mut self, handle: RequestHandle, direction: Direction, transferred: Transferred) {
        if let Err(error) = self.release_at_daemon(handle, direction, transferred, Vec::new()) {
            tracing::warn!(%error, "releasing a request at tuttid");
        }
    }

    /// `Release` with this process's report ([`release_reporting`]); what the daemon counted of
    /// it is counted in [`Self::reported`] too, whatever the answer.
    fn release_at_daemon(
        &mut self,
        handle: RequestHandle,
        direction: Direction,
        transferred: Transferred,
        corrupt_blocks: Vec<objstore::MismatchedBlock>,
    ) -> Result<(), ObjstoreError> {
        let client = &mut self.client;
        let (counted, result) = release_reporting(&mut |request| client.call(request), handle, transferred, corrupt_blocks);
        if counted {
            self.count_reported(direction, transferred);
        }
        result.map_err(|error| lost_if(self.client.is_broken(), error))
    }
}

/// `Release` with a report, sent through `call`; the request is released at the daemon in
/// every case the connection allows. A report of more corrupt blocks than one frame carries
/// ([`RELEASE_CORRUPT_BLOCKS_MAX`](crate::protocol::RELEASE_CORRUPT_BLOCKS_MAX), fewer than a
/// retrieve may name) reports the first that fit and logs the rest: those stay indexed until a
/// later verified retrieve finds them again. A report the daemon refuses (`BadReport`, or any
/// other refusal of this request) would leave the request reserved there while it is gone here,
/// so the request is then released without a report (nothing counted, nothing evicted) and the
/// refusal is returned. A lost connection ends the session, and with it the request.
///
/// Also returns whether the daemon counted `transferred` (in `tuttid_bytes_total`): it counts a
/// release's report exactly when the release ended the request, even if it then answers an
/// error (the store's release failed), and a refusal that kept the request counts nothing. So
/// after a refusal, the bare release tells which: accepted, the first counted nothing; refused
/// `NotYours`, the request had ended — by this release, or by the `Commit` before it that
/// failed while writing (the daemon counted that commit's report, the same figures).
fn release_reporting(
    call: &mut dyn FnMut(&Request) -> Result<Reply, DaemonError>,
    handle: RequestHandle,
    transferred: Transferred,
    mut corrupt_blocks: Vec<objstore::MismatchedBlock>,
) -> (bool, Result<(), ObjstoreError>) {
    let cap = crate::protocol::RELEASE_CORRUPT_BLOCKS_MAX;
    if corrupt_blocks.len() > cap {
        tracing::warn!(
            request = handle.to_bits(),
            corrupt = corrupt_blocks.len(),
            reported = cap,
            first_unreported = %corrupt_blocks[cap],
            "more corrupt blocks than one Release carries: the rest stay indexed until a verified retrieve finds them again"
        );
        corrupt_blocks.truncate(cap);
    }
    let release = Request::Release { handle: handle.to_bits(), transferred, corrupt_blocks };
    match call(&release) {
        Ok(Reply::Released) => (true, Ok(())),
        Ok(other) => (false, Err(unexpected(Kind::Release, &other))),
        Err(refused @ (DaemonError::Remote { .. } | DaemonError::RequestTooLarge { .. } | DaemonError::Protocol(_))) => {
            let bare = Request::Release { handle: handle.to_bits(), transferred: Transferred::default(), corrupt_blocks: Vec::new() };
            let counted = match call(&bare) {
                Ok(_) => false,
                Err(DaemonError::Remote { code: ErrorCode::NotYours, .. }) => true,
                Err(error) => {
                    tracing::warn!(%error, "releasing a request at tuttid without the report it refused");
                    false
                }
            };
            (counted, Err(remote(refused)))
        }
        Err(error) => (false, Err(remote(error))),
    }
}

fn direction_index(direction: Direction) -> usize {
    match direction {
        Direction::Retrieve => 0,
        Direction::Store => 1,
    }
}

/// The attach configuration of one grant, with this process's rings.
fn attach_config(grant: &QueueGrant, submission: &DmaRegion, completion: &DmaRegion) -> AttachedQueueConfig {
    AttachedQueueConfig {
        layout: DetachedQueueLayout {
            id: QueueId(grant.queue_id),
            depth: grant.depth,
            submission_iova: Iova(grant.submission_iova),
            completion_iova: Iova(grant.completion_iova),
            submission_host_address: submission.host_address(),
            completion_host_address: completion.host_address(),
            submission_doorbell_offset: grant.submission_doorbell_offset as usize,
            completion_doorbell_offset: grant.completion_doorbell_offset as usize,
        },
        namespaces: grant
            .namespaces
            .iter()
            .map(|namespace| Namespace {
                id: NamespaceId(namespace.nsid),
                block_size_bytes: namespace.lba_bytes,
                size_blocks: namespace.size_blocks,
            })
            .collect(),
        data_pointer_mode: if grant.sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp },
        max_transfer_bytes: grant.max_transfer_bytes,
        sgl_dword_lengths: grant.sgl_dword_lengths,
    }
}

/// A first block as tuttid's protocol carries it (a u32): a larger one is a bad request.
pub fn wire_first_block(first_block: usize) -> Result<u32, ObjstoreError> {
    u32::try_from(first_block)
        .map_err(|_| ObjstoreError::BadRequest { reason: format!("first block {first_block} is past any prefix tuttid takes") })
}

impl LayerKvStore for RemoteKvStore {
    /// A daemon that cannot answer is a miss (nothing cached from `first_block`): the safe
    /// answer for an engine, which then computes the blocks; the error is logged.
    fn lookup_from(&mut self, tokens: &[u32], first_block: usize) -> usize {
        // As tuttid and `KvStore` answer it: a start past the prompt counts as its end.
        let first_block = first_block.min(tokens.len() / self.hello_reply().shape.block_tokens.max(1) as usize);
        match wire_first_block(first_block).map_err(|_| None).and_then(|first| self.client.lookup_from(tokens, first).map_err(Some)) {
            Ok(blocks) => blocks as usize,
            Err(error) => {
                match error {
                    // A prompt longer than one Lookup frame carries (262,142 tokens) is never
                    // looked up (nor stored) through tuttid: every key chain starts at the
                    // prompt's first token, and no request continues one. Said once per store.
                    Some(error @ DaemonError::RequestTooLarge { .. }) => {
                        if self.long_prompt_warned {
                            tracing::debug!(%error, "prompt too long to look up at tuttid: answering no cached blocks");
                        } else {
                            self.long_prompt_warned = true;
                            self.lookup_warnings += 1;
                            tracing::warn!(
                                %error,
                                "a prompt over 262,142 tokens is not looked up or cached through tuttid: answering no cached \
                                 blocks (said once)"
                            );
                        }
                    }
                    Some(error) => {
                        self.lookup_warnings += 1;
                        tracing::warn!(%error, "lookup at tuttid failed: answering no cached blocks");
                    }
                    None => {}
                }
                first_block
            }
        }
    }

    fn prepare_retrieve_from(&mut self, request: &KvRequest<'_>, first_block: usize) -> Result<RequestHandle, ObjstoreError> {
        let first_block = wire_first_block(first_block)?;
        let prepare = Request::PrepareRetrieve(Self::prepare_request(request, self.registration, first_block));
        let prepared = match self.client.call(&prepare).map_err(|error| remote_after(self.client.is_broken(), error))? {
            Reply::RetrievePrepared(prepared) => prepared,
            other => return Err(unexpected(Kind::PrepareRetrieve, &other)),
        };
        let handle = RequestHandle::from_bits(prepared.handle);
        let consistent = check_retrieve(request.block_ids, &prepared);
        self.prepare_data(handle, Direction::Retrieve, &prepared.placements, prepared.expected_crcs.as_deref(), consistent)?;
        Ok(handle)
    }

    /// Refused here, before the daemon reserves, when the data half has fewer IOCBs free than
    /// the store could take (`StoreData::store_iocbs_at_most`): the reservation may evict cached
    /// blocks (their headers synced Empty), which releasing it does not bring back, and the data
    /// half would then refuse the store (`NoFreeIocb`), as `KvStore::prepare_store` refuses
    /// before reserving. The index is the daemon's, so the bound counts every block new and a
    /// run of its own: a store sharing blocks, all of them even, that would have fit may be
    /// refused too. So is a store with none of this process's request slots free
    /// (`TooManyRequests`): the slots (`StoreConfig::requests_max`) may be fewer than the
    /// daemon's per session, which would reserve first. A malformed store is sent all the
    /// same: the daemon refuses it (`BadRequest`) before reserving anything, as `KvStore`
    /// checks the request before its IOCBs.
    fn prepare_store(&mut self, request: &KvRequest<'_>) -> Result<StorePlan, ObjstoreError> {
        let slot = self.slots.check_free();
        let most = self.data.store_iocbs_at_most(request.block_ids.len());
        let available = self.data.queue().free_iocbs();
        if (slot.is_err() || most > available) && self.store_is_well_formed(request) {
            slot?;
            return Err(gio_uring::GioError::NoFreeIocb { requested: most, available }.into());
        }
        let prepare = Request::PrepareStore(Self::prepare_request(request, self.registration, 0));
        let prepared = match self.client.call(&prepare).map_err(|error| remote_after(self.client.is_broken(), error))? {
            Reply::StorePrepared(prepared) => prepared,
            other => return Err(unexpected(Kind::PrepareStore, &other)),
        };
        let handle = RequestHandle::from_bits(prepared.handle);
        let consistent = check_store(request.block_ids, &prepared);
        self.prepare_data(handle, Direction::Store, &prepared.placements, None, consistent)?;
        Ok(StorePlan {
            handle,
            new_blocks: prepared.new_blocks as usize,
            shared_blocks: prepared.shared_blocks as usize,
            evicted_slots: prepared.evicted_slots as usize,
        })
    }

    #[inline]
    fn retrieve_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<(), ObjstoreError> {
        let local = self.slots.local(handle)?;
        self.data.retrieve_layer(local, layer, budget).map_err(|error| to_daemon(error, local, handle))
    }

    #[inline]
    fn store_layer(&mut self, handle: RequestHandle, layer: u32, budget: SmBudget) -> Result<(), ObjstoreError> {
        let local = self.slots.local(handle)?;
        self.data.store_layer(local, layer, budget).map_err(|error| to_daemon(error, local, handle))
    }

    fn layers_in_flight_max(&self) -> u32 {
        self.data.layers_in_flight_max()
    }

    fn any_layer_in_flight(&self, handle: RequestHandle) -> Result<bool, ObjstoreError> {
        Ok(self.layers_in_flight(handle)?.next().is_some())
    }

    fn wait(&mut self, handle: RequestHandle, deadline: Instant) -> Result<Option<u32>, ObjstoreError> {
        let local = self.slots.local(handle)?;
        self.data.wait(local, deadline).map_err(|error| to_daemon(error, local, handle))
    }

    fn poll(&mut self, handle: RequestHandle) -> Result<bool, ObjstoreError> {
        let local = self.slots.local(handle)?;
        self.data.poll(local).map_err(|error| to_daemon(error, local, handle))
    }

    /// Every layer must have completed (checked here); the payload CRCs are computed here from
    /// the KV memory, and the daemon flushes, writes the headers with FUA and makes the blocks
    /// visible. A commit refused before it begins (a layer not stored, in flight, or whose latest
    /// write failed: `HandleState`) leaves the request held, as the in-process store's does:
    /// store the layer and commit again, or `finish`. Once begun, the handle is finished either
    /// way. What the layers moved goes with the commit.
    fn commit_store(&mut self, handle: RequestHandle) -> Result<usize, ObjstoreError> {
        let local = self.slots.local(handle)?;
        let daemons = |error| to_daemon(error, local, handle);
        self.data.check_stored(local).map_err(daemons)?;
        // Every layer completed (checked): from here the handle ends either way, here and at
        // the daemon, as the in-process store's commit does.
        let transferred = self.data.transferred(local).map_err(daemons)?;
        let crcs = if self.payload_crcs {
            if let Err(error) = self.data.payload_crcs(local, &mut self.crcs) {
                if let Err(finish) = self.finish_data(handle, local) {
                    tracing::warn!(error = %finish, "finishing a store whose payload CRCs failed");
                }
                self.release_remote(handle, Direction::Store, transferred);
                return Err(daemons(error));
            }
            Some(self.crcs.clone())
        } else {
            None
        };
        let commit = Commit { handle: handle.to_bits(), payload_crcs: crcs, transferred };
        let result = self.client.call(&Request::Commit(commit));
        if let Err(error) = self.finish_data(handle, local) {
            tracing::warn!(%error, "finishing a committed store's data path");
        }
        match result {
            Ok(Reply::Committed { stored }) => {
                self.count_reported(Direction::Store, transferred);
                Ok(stored as usize)
            }
            Ok(other) => Err(unexpected(Kind::Commit, &other)),
            Err(error) => {
                // A refusal before anything was written leaves the reservation: release it (a
                // commit that failed while writing ended it, and the daemon counted its report:
                // the release, refused NotYours, says so and it is counted here too).
                self.release_remote(handle, Direction::Store, transferred);
                Err(remote_after(self.client.is_broken(), error))
            }
        }
    }

    /// Ends the request here, then at the daemon with what it moved and, for a verified
    /// retrieve that found blocks corrupt, those blocks: the daemon evicts them (in one
    /// process `KvStore::wait` evicts at once; here the index is the daemon's).
    fn finish(&mut self, handle: RequestHandle) -> Result<(), ObjstoreError> {
        let local = self.slots.local(handle)?;
        let daemons = |error| to_daemon(error, local, handle);
        let direction = self.data.direction(local).map_err(daemons)?;
        let transferred = self.data.transferred(local).map_err(daemons)?;
        let corrupt_blocks = self.data.mismatched_blocks(local).to_vec();
        // The slot is free from here whatever the daemon answers: the data path has ended.
        self.finish_data(handle, local)?;
        self.release_at_daemon(handle, direction, transferred, corrupt_blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A daemon's side of `Release` for [`release_reporting`]: each request is encoded into a
    /// frame as `Client::call` does (a body over the cap is refused before it is sent), then
    /// answered by `answer`; `released` records the requests the daemon released.
    fn fake_release<'a>(
        released: &'a mut Vec<Request>,
        answer: impl Fn(&Request) -> Result<Reply, DaemonError> + 'a,
    ) -> impl FnMut(&Request) -> Result<Reply, DaemonError> + 'a {
        move |request| {
            let mut frame = Vec::new();
            crate::protocol::encode_frame(&mut frame, request.kind(), 1, |out| request.encode_body(out)).map_err(|error| match error {
                crate::ProtocolError::FrameTooLarge { body_bytes } => {
                    DaemonError::RequestTooLarge { kind: request.kind(), body_bytes, cap_bytes: crate::protocol::BODY_BYTES_MAX }
                }
                other => DaemonError::Protocol(other),
            })?;
            let reply = answer(request)?;
            released.push(request.clone());
            Ok(reply)
        }
    }

    fn corrupt(count: usize) -> Vec<objstore::MismatchedBlock> {
        (0..count)
            .map(|position| objstore::MismatchedBlock {
                position,
                engine_block: position as u32,
                device: 0,
                slot: position as u32,
                expected_crc: 1,
                computed_crc: 2,
            })
            .collect()
    }

    #[test]
    fn a_release_reporting_every_block_of_the_largest_retrieve_releases_the_request() {
        // Goal: a verified retrieve of PREPARE_BLOCKS_MAX blocks that all failed their CRC is
        // still released at the daemon (its report of 22 bytes per block passes the 1 MiB
        // frame): as many blocks as fit are reported, the rest logged; never left reserved.
        let handle = RequestHandle::from_bits(7);
        let mut released = Vec::new();
        let mut call = fake_release(&mut released, |_| Ok(Reply::Released));
        let moved = Transferred { bytes: 4096, commands: 1 };
        let (counted, result) = release_reporting(&mut call, handle, moved, corrupt(crate::protocol::PREPARE_BLOCKS_MAX));
        result.unwrap();
        assert!(counted);
        drop(call);
        assert_eq!(released.len(), 1, "{:?}", released.iter().map(Request::kind).collect::<Vec<_>>());
        let Request::Release { handle: sent, transferred, corrupt_blocks } = &released[0] else { panic!("{:?}", released[0].kind()) };
        assert_eq!((*sent, *transferred), (7, moved));
        assert_eq!(corrupt_blocks.len(), crate::protocol::RELEASE_CORRUPT_BLOCKS_MAX);
        assert_eq!(corrupt_blocks[..], corrupt(crate::protocol::RELEASE_CORRUPT_BLOCKS_MAX)[..]);
    }

    #[test]
    fn a_release_that_ended_the_request_with_an_error_was_counted() {
        // Goal: reported() matches what the daemon counts: a release the daemon answers with an
        // error after it ended the request (its store's release failed), or one following a
        // Commit that failed while writing (the request already gone), was counted there, so
        // it is counted here; the bare release, refused NotYours, is what tells.
        let mut released = Vec::new();
        let mut call = fake_release(&mut released, |request| match request {
            Request::Release { transferred, .. } if *transferred != Transferred::default() => {
                Err(DaemonError::Remote { code: ErrorCode::StoreFailed, message: "releasing the request".into() })
            }
            _ => Err(DaemonError::Remote { code: ErrorCode::NotYours, message: "not a request of this session".into() }),
        });
        let (counted, result) =
            release_reporting(&mut call, RequestHandle::from_bits(3), Transferred { bytes: 4096, commands: 1 }, Vec::new());
        assert!(result.is_err());
        assert!(counted);
    }

    #[test]
    fn a_release_whose_report_fails_is_released_without_it() {
        // Goal: whatever refuses the report — the daemon's BadReport, or any other refusal of
        // the request — the request is then released bare, and the failure returned.
        for code in [ErrorCode::BadReport, ErrorCode::MalformedBody] {
            let handle = RequestHandle::from_bits(9);
            let mut released = Vec::new();
            let mut call = fake_release(&mut released, |request| match request {
                Request::Release { corrupt_blocks, .. } if !corrupt_blocks.is_empty() => {
                    Err(DaemonError::Remote { code, message: "refused".into() })
                }
                _ => Ok(Reply::Released),
            });
            let (counted, result) = release_reporting(&mut call, handle, Transferred { bytes: 4096, commands: 1 }, corrupt(3));
            drop(call);
            let error = result.unwrap_err();
            assert!(error.to_string().contains("refused"), "{error}");
            assert!(!counted, "a refused report that kept the request is not counted by the daemon");
            assert_eq!(
                released,
                vec![Request::Release { handle: 9, transferred: Transferred::default(), corrupt_blocks: Vec::new() }],
                "{code:?}"
            );
        }
    }

    #[test]
    fn device_layout_offsets_move_to_the_registered_base() {
        // Goal: a layout given as offsets in the device range lands at the daemon's IOVA for
        // it (every base moved, strides kept; block-major stride 0 is the pool's block), and
        // an offset that would overflow the IOVA space is an error, not a wrapped address.
        let base = Iova(0x10_0000);
        let paged = KvLayout::PagedPerLayer { layer_bases: vec![Iova(0), Iova(0x2000)], block_stride_bytes: 256 };
        assert_eq!(
            offset_layout(paged, base, 4096).unwrap(),
            KvLayout::PagedPerLayer { layer_bases: vec![Iova(0x10_0000), Iova(0x10_2000)], block_stride_bytes: 256 }
        );
        let major = KvLayout::BlockMajor { base: Iova(0x40), block_stride_bytes: 0 };
        assert_eq!(offset_layout(major, base, 4096).unwrap(), KvLayout::BlockMajor { base: Iova(0x10_0040), block_stride_bytes: 4096 });
        let separate = KvLayout::SeparateKv { key_bases: vec![Iova(0)], value_bases: vec![Iova(u64::MAX)], block_stride_bytes: 128 };
        assert!(matches!(offset_layout(separate, base, 4096), Err(ObjstoreError::AddressOverflow { .. })));
    }

    #[test]
    fn a_daemon_saying_goodbye_is_the_daemon_gone() {
        // Goal: a daemon that shuts down queues ShuttingDown and closes; whether the client
        // reads the goodbye or meets the close first, the store reports `Disconnected` (CI saw
        // `Refused { code: 11 }` once the client learned to read a refusal queued before a
        // close). Other refusals keep their code.
        let classify = |error| match remote(error) {
            ObjstoreError::RemoteFailed { failure, .. } => failure,
            other => panic!("expected a classified failure, got {other:?}"),
        };
        let goodbye = DaemonError::Remote { code: ErrorCode::ShuttingDown, message: "draining".into() };
        assert_eq!(classify(goodbye), RemoteFailure::Disconnected { code: Some(ErrorCode::ShuttingDown.to_u16()) });
        let expired = DaemonError::Remote { code: ErrorCode::LeaseExpired, message: "no frame within the lease".into() };
        assert_eq!(classify(expired), RemoteFailure::Disconnected { code: Some(ErrorCode::LeaseExpired.to_u16()) });
        assert_eq!(classify(DaemonError::Closed), RemoteFailure::Disconnected { code: None });
        let full = DaemonError::Remote { code: ErrorCode::LimitReached, message: "pool full".into() };
        assert_eq!(classify(full), RemoteFailure::Refused { code: ErrorCode::LimitReached.to_u16() });
        // A request over the frame cap was never sent: the caller's, not a lost connection.
        let too_long = DaemonError::RequestTooLarge { kind: Kind::PrepareStore, body_bytes: 1 << 21, cap_bytes: 1 << 20 };
        assert!(matches!(remote(too_long), ObjstoreError::BadRequest { .. }));
        let long_name = DaemonError::ClientNameTooLong { name_bytes: 65, max_bytes: 64 };
        assert!(matches!(remote(long_name), ObjstoreError::BadRequest { .. }));
        // A reply over the cap came from the daemon and left the connection out of step.
        let reply_too_long = DaemonError::Protocol(crate::protocol::ProtocolError::FrameTooLarge { body_bytes: 1 << 21 });
        assert!(!matches!(remote(reply_too_long), ObjstoreError::BadRequest { .. }));
    }

    #[test]
    fn a_connection_the_daemon_ended_is_the_daemon_gone() {
        // Goal: an `Error` the daemon sends only when it ends the connection (under id 0, then
        // it closes: a frame it refused or that timed out, a peer it does not serve) is a lost
        // connection (`Disconnected`: the caller reconnects at once), not a refusal that leaves
        // the connection usable; before, only ShuttingDown and LeaseExpired were, and the caller
        // kept the dead connection for one more failed call. Busy, also a per-request answer,
        // keeps its code. Seen end to end: a stand-in daemon ends a Ping's connection with
        // FrameTimeout.
        use std::os::unix::net::UnixListener;
        let directory = std::env::temp_dir().join(format!("tutti-remote-ended-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).unwrap();
        let socket = directory.join("socket");
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            stream.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            stream.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
            let (mut body, mut fds) = (Vec::new(), Vec::new());
            let waited = crate::frame_io::read_frame(
                &stream,
                &mut body,
                &mut fds,
                Instant::now() + Duration::from_secs(5),
                Duration::from_secs(5),
                &|| false,
            );
            assert!(matches!(waited, Ok(crate::frame_io::ReadOutcome::Frame(_))), "{waited:?}");
            let goodbye = Reply::error(ErrorCode::FrameTimeout, "the rest of a frame: no answer within 2000 ms");
            let mut frame = Vec::new();
            crate::protocol::encode_frame(&mut frame, goodbye.kind(), 0, |out| goodbye.encode_body(out)).unwrap();
            crate::frame_io::write_frame(&stream, &frame).unwrap();
        });
        let mut client = Client::connect(&socket, Duration::from_secs(2)).unwrap();
        let ended = client.ping().unwrap_err();
        daemon.join().unwrap();
        std::fs::remove_dir_all(&directory).unwrap();
        assert!(matches!(ended, DaemonError::Remote { code: ErrorCode::FrameTimeout, .. }), "{ended:?}");
        assert!(client.is_broken());
        let classify = |error| match remote(error) {
            ObjstoreError::RemoteFailed { failure, .. } => failure,
            other => panic!("expected a classified failure, got {other:?}"),
        };
        assert_eq!(classify(ended), RemoteFailure::Disconnected { code: Some(ErrorCode::FrameTimeout.to_u16()) });
        for code in [
            ErrorCode::BadMagic,
            ErrorCode::UnsupportedVersion,
            ErrorCode::FrameTooLarge,
            ErrorCode::UnknownKind,
            ErrorCode::PermissionDenied,
        ] {
            let ended = classify(DaemonError::Remote { code, message: String::new() });
            assert_eq!(ended, RemoteFailure::Disconnected { code: Some(code.to_u16()) }, "{code}");
        }
        let busy = DaemonError::Remote { code: ErrorCode::Busy, message: "64 clients".into() };
        assert_eq!(classify(busy), RemoteFailure::Refused { code: ErrorCode::Busy.to_u16() });
    }
}
