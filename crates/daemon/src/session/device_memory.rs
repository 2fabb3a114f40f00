//! `RegisterDeviceMemory` in a session: KV memory the daemon reaches only by copies (GPU memory
//! through CUDA IPC, a memfd stand-in; `crate::gpu_memory` imports it). A registration holds its
//! mapping in the devices' DMA space, its claim on the allocation and the client's dma-buf, and
//! is given back with the windows ([`Holdings::release`], after the queue pairs were deleted).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nvme_driver::hw::{CopiedRegion, HwError};

use super::{lock, refused, Holdings, SessionLimits, StoreState};
use crate::gpu_memory::{Claim, DeviceMemoryService, VFIO_REFUSAL};
use crate::protocol::{DeviceMemoryKind, ErrorCode, RegisterDeviceMemory, Registered, Reply};

/// One registered range of device memory (`crate::gpu_memory`: GPU memory through CUDA IPC, a
/// memfd stand-in): its mapping in the devices' DMA space (every translation a controller made
/// holds it too), its claim on the allocation, the dma-buf the client sent. Dropped with the
/// windows, after the session's queue pairs were deleted.
pub(super) struct DeviceRegistration {
    pub(super) id: u64,
    pub(super) region: CopiedRegion,
    pub(super) kv_blocks: u32,
    /// Host memory the daemon mapped for it (a memfd stand-in's size; 0 for GPU memory): counted
    /// with the windows against `window_bytes_max`.
    pub(super) host_bytes: u64,
    _claim: Claim,
    _dma_buf: Option<OwnedFd>,
}

impl Holdings {
    /// `RegisterDeviceMemory`: imports the memory (`crate::gpu_memory`), claims its range, and
    /// gives it an IOVA in the pool devices' one DMA space, which only software controllers can
    /// take ([`VFIO_REFUSAL`] otherwise). Before `AttachQueues`: each queue pair's restriction
    /// covers the device memory registered when it was created.
    #[allow(clippy::too_many_arguments)] // the session's context, as for `register`
    pub fn register_device_memory(
        &mut self,
        request: RegisterDeviceMemory,
        fds: &mut Vec<OwnedFd>,
        store: &Mutex<StoreState>,
        limits: &SessionLimits,
        block_bytes: u64,
        next_id: &AtomicU64,
        service: &DeviceMemoryService,
        session: u64,
    ) -> Reply {
        if let Err(refusal) = service.check_kind(request.kind) {
            return refused(refusal);
        }
        if self.queue_pairs() > 0 {
            return Reply::error(
                ErrorCode::BadRequest,
                "register device memory before AttachQueues: a queue pair reaches the memory registered when it was created",
            );
        }
        if self.registrations() as usize >= limits.registrations_max {
            return Reply::error(ErrorCode::LimitReached, format!("a session registers at most {} windows", limits.registrations_max));
        }
        // A memfd stand-in is host memory the daemon maps: capped with the windows.
        let host_bytes = if request.kind == DeviceMemoryKind::Memfd { request.allocation_bytes } else { 0 };
        let held = self.host_bytes_held();
        if held.saturating_add(host_bytes) > limits.window_bytes_max {
            return Reply::error(
                ErrorCode::LimitReached,
                format!("{host_bytes} more bytes over the session's {held}: the cap is {}", limits.window_bytes_max),
            );
        }
        let kv_bytes = u64::from(request.kv_blocks).checked_mul(block_bytes);
        if request.kv_blocks == 0 || kv_bytes.is_none_or(|bytes| bytes > request.length_bytes) {
            return Reply::error(
                ErrorCode::BadRequest,
                format!(
                    "{} KV blocks of {block_bytes} bytes do not fit {} bytes of device memory",
                    request.kv_blocks, request.length_bytes
                ),
            );
        }
        let dma = {
            let store = lock(store);
            if store.emulators.iter().any(Option::is_none) {
                return Reply::error(ErrorCode::Unsupported, VFIO_REFUSAL);
            }
            let pool = store.control.pool();
            let dma = Arc::clone(pool.target(0).controller.dma());
            if (1..pool.device_count()).any(|device| pool.target(device).controller.dma().address_space() != dma.address_space()) {
                return Reply::error(
                    ErrorCode::Unsupported,
                    "the pool's devices are in several DMA spaces: memory cannot be mapped for all",
                );
            }
            dma
        };
        // Imported outside the pool lock: opening a CUDA IPC handle may take milliseconds.
        let imported = match service.import(&request, fds) {
            Ok(imported) => imported,
            Err(refusal) => return refused(refusal),
        };
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        let claim = match service.claim(&imported, session, id) {
            Ok(claim) => claim,
            Err(refusal) => return refused(refusal),
        };
        let region = match dma.map_copied(Arc::clone(&imported.memory)) {
            Ok(region) => region,
            Err(error @ HwError::CopiedUnsupported { .. }) => {
                return Reply::error(ErrorCode::Unsupported, format!("{error}: {VFIO_REFUSAL}"))
            }
            Err(error) => return Reply::error(ErrorCode::StoreFailed, format!("mapping the device memory for the devices: {error}")),
        };
        tracing::info!(registration = id, session, iova = %region.iova(), memory = %region.describe(), "device memory registered");
        let reply = Registered { registration: id, iova_base: region.iova().0, address_space: dma.address_space().0 };
        self.device_memory.push(DeviceRegistration {
            id,
            region,
            kv_blocks: request.kv_blocks,
            host_bytes,
            _claim: claim,
            _dma_buf: imported.dma_buf,
        });
        Reply::Registered(reply)
    }
}
