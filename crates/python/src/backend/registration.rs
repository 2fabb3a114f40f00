//! Registering a store's KV memory: caller memory mapped for an in-process pool's devices,
//! device memory registered with tuttid, or memory tutti allocates (`allocate_kv`: DMA memory
//! in-process, tuttid's window when attached).

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::{DataPointerMode, DmaAllocator, DmaRegion, Iova};
use objstore::{cpu_executor_for, KvLayout as StoreLayout, KvRegistration, KvStore, Pool};
use tutti_daemon::client::{RemoteKvStore, WindowKvLayout};

use super::close::DEVICE_RELEASE_WAIT;
use super::{closed, key_seed, Allocation, Backend, StoreState};
use crate::device_memory::{self, DeviceHold};
use crate::errors::{ErrorClass, Failure};
use crate::ffi::{CallerMemory, QueuesGone};
use crate::memory::{Keep, KeptForGood};
use crate::tensor::{CheckedLayout, Device, LayoutKind};

impl StoreState {
    /// The pool's DMA allocator and data pointer mode (in-process, before registration).
    fn local_dma(pool: &Pool) -> (Arc<dyn DmaAllocator>, DataPointerMode) {
        let sgl = (0..pool.device_count()).all(|device| pool.target(device).controller.data_pointer_mode() == DataPointerMode::Sgl);
        (pool.target(0).controller.dma().clone(), if sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp })
    }

    /// In-process: builds the `KvStore` over the pool with `layout` (IOVAs) registered.
    fn build_local(&mut self, layout: StoreLayout, num_blocks: u32) -> Result<(), Failure> {
        let Backend::LocalOpen { .. } = &self.backend else {
            return Err(Failure::new(ErrorClass::InvalidState, "KV memory is registered already (once per store)"));
        };
        let Backend::LocalOpen { pool, emulators, locks, config, queue_depth } = std::mem::replace(&mut self.backend, Backend::Closed)
        else {
            unreachable!("matched above")
        };
        let (dma, mode) = Self::local_dma(&pool);
        // The registration and the executor first: their refusals leave the pool open for
        // another try. A failure of `KvStore::new` itself consumes the pool: the store is then
        // closed.
        let prepared = KvRegistration::new(*pool.geometry(), num_blocks, layout, mode)
            .and_then(|registration| Ok((registration, cpu_executor_for(&pool, queue_depth, &config)?)));
        let (registration, executor) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                self.backend = Backend::LocalOpen { pool, emulators, locks, config, queue_depth };
                return Err(Failure::from(error));
            }
        };
        match KvStore::new(pool, registration, dma, executor, config) {
            Ok(mut store) => {
                if let Some((fingerprint, rank, world)) = &self.key_space {
                    store.set_key_seed(key_seed(fingerprint, *rank, *world)?);
                }
                // Before any request is prepared, which is when the store accepts it (each
                // request's IOCB lanes are decided at its prepare).
                store.set_layers_in_flight_max(self.layers_in_flight_max)?;
                self.backend = Backend::Local { store: Box::new(store), emulators, locks };
                Ok(())
            }
            Err(error) => Err(Failure::from(error)),
        }
    }

    /// `register_kv`: caller memory mapped for the pool's devices (in-process), or device
    /// memory registered with tuttid (CUDA tensors, a stand-in; `device_memory`). What a
    /// refusal leaves of `keeps` (consumed DLPack exports, whose deleter takes the GIL) goes to
    /// `released`, dropped after the store's lock is let go, as every release is.
    /// `stand_in`: the stand-in holding the layout's first byte (`device_memory::stand_in_of`,
    /// looked up with the GIL held).
    pub fn register(
        &mut self,
        checked: CheckedLayout,
        keeps: Vec<Keep>,
        stand_in: Option<device_memory::StandIn>,
        timeout: Duration,
    ) -> Result<(), Failure> {
        let mut keeps = keeps;
        let registered = self.register_with(checked, &mut keeps, stand_in, timeout);
        self.released.append(&mut keeps);
        registered
    }

    /// `register`: takes `keeps` (leaving it empty) only on the routes that keep or release
    /// them themselves; a refusal before that leaves them to the caller.
    fn register_with(
        &mut self,
        checked: CheckedLayout,
        keeps: &mut Vec<Keep>,
        stand_in: Option<device_memory::StandIn>,
        timeout: Duration,
    ) -> Result<(), Failure> {
        // Closed first: `registered` outlives the close, and the same memory again must not be
        // taken as registered (nor the layout attached again) by a store that is gone.
        if self.is_closed() {
            return Err(closed());
        }
        if let Some(registered) = &self.registered {
            return if *registered == checked {
                Ok(()) // the same memory again (an engine handing back an allocation)
            } else {
                Err(Failure::new(ErrorClass::InvalidState, "KV memory is registered already (once per store), and it is other memory"))
            };
        }
        // Memory another store's close kept for good, whatever object it came through (a
        // KvBuffer, a numpy or torch view, a stand-in's or a CUDA tensor): the old queue or
        // tuttid may still write it, and this store would commit and serve those bytes. On
        // every device: CUDA pointers share this process's address space (unified addressing),
        // so a host range never matches a device one (`DeviceHold::release`).
        if let Some(index) =
            checked.tensors.iter().position(|tensor| crate::memory::kept_for_good_overlap(tensor.address, tensor.extent_bytes))
        {
            return Err(Failure::new(
                ErrorClass::UnsupportedMemory,
                format!(
                    "tensor {index} of the layout is memory a closed store kept for good (a layer was still in flight at \
                     its close): a device may still write it; allocate the KV cache again (this store's allocate_kv, or new GPU memory)"
                ),
            ));
        }
        match &self.backend {
            Backend::LocalOpen { .. } if checked.device != Device::Cpu => Err(Failure::new(
                ErrorClass::UnsupportedMemory,
                format!(
                    "the tensors are on {}: an in-process store reaches only CPU memory; attach to tuttid started with \
                     --device-memory cuda (Store.attach) to register GPU memory",
                    checked.device
                ),
            )),
            Backend::LocalOpen { .. } => self.register_caller_memory(checked, std::mem::take(keeps)),
            Backend::RemoteAttached { .. } => match device_memory::export(&checked, stand_in)? {
                Some(range) => self.register_device_memory(checked, std::mem::take(keeps), range, timeout),
                None => Err(Failure::new(
                    ErrorClass::UnsupportedMemory,
                    "tuttid cannot map CPU memory this process allocated: allocate the KV cache with store.allocate_kv(num_blocks, kind) \
                     and build the engine's tensors over its buffers, or register CUDA tensors (tuttid started with --device-memory cuda)",
                )),
            },
            Backend::Closed => Err(closed()),
            Backend::Local { .. } | Backend::Remote { .. } => unreachable!("a registered store has `registered` set"),
        }
    }

    /// Device memory (`device_memory::export` made `range` of `checked`'s span) registered with
    /// tuttid, the layout as offsets in it; the session's data path set up over it. A refusal
    /// (tuttid started without --device-memory, a pool with a vfio: device) is raised as
    /// UnsupportedMemory with tuttid's reason; it ends the session (the store is closed then).
    fn register_device_memory(
        &mut self,
        checked: CheckedLayout,
        keeps: Vec<Keep>,
        range: device_memory::DeviceRange,
        timeout: Duration,
    ) -> Result<(), Failure> {
        let Backend::RemoteAttached { client, hello, mut config } = std::mem::replace(&mut self.backend, Backend::Closed) else {
            unreachable!("register matched RemoteAttached")
        };
        config.kv_blocks = checked.num_blocks;
        config.timeout = timeout;
        let session = hello.session;
        let layout = store_layout(&checked, &device_memory::offsets(&checked, range.start));
        let connected = RemoteKvStore::with_client_and_device_memory(client, hello, &config, &range.memory, layout);
        self.touch_daemon();
        let daemon = self.daemon.clone().unwrap_or(device_memory::AttachedDaemon { socket: Default::default(), process: None });
        let hold = DeviceHold { keeps, tensors: checked.tensors.clone(), holder: range.holder, daemon, session };
        match connected.and_then(|mut store| {
            // Before any request is prepared (see `build_local`); a refusal drops the store,
            // which ends the session like any failure here.
            store.data_mut().set_layers_in_flight_max(self.layers_in_flight_max)?;
            Ok(store)
        }) {
            Ok(store) => {
                self.backend = Backend::Remote { store: Box::new(store) };
                self.device_memory = Some(hold);
                self.registered = Some(checked);
                Ok(())
            }
            Err(error) => {
                // The connection is gone (dropped with the store or by the set-up), so tuttid
                // ends the session. No command was issued, but RegisterDeviceMemory may have
                // succeeded before the step that failed (AttachQueues, layers in flight): tuttid
                // then holds its import of the allocation (CUDA IPC) until the session ended, and
                // CUDA leaves freeing memory another process has open undefined. So the tensors
                // and what holds the allocation go as at close: once tuttid no longer lists the
                // session, kept for good (and counted) if it does not say so in time.
                let release_wait = DEVICE_RELEASE_WAIT.max(timeout);
                let deadline = Instant::now().checked_add(release_wait).unwrap_or_else(Instant::now);
                let (kept, keeps) = hold.release(true, deadline);
                self.leaked_tensors += kept;
                self.released.extend(keeps);
                let failure = Failure::from(&error);
                if failure.code.as_deref() == Some("Unsupported") {
                    return Err(Failure {
                        class: ErrorClass::UnsupportedMemory,
                        message: format!("tuttid refused the KV memory as device memory: {}", failure.message),
                        ..failure
                    });
                }
                Err(failure)
            }
        }
    }

    /// `register_kv` with caller memory (in-process): maps each tensor, registers the layout.
    fn register_caller_memory(&mut self, checked: CheckedLayout, keeps: Vec<Keep>) -> Result<(), Failure> {
        let dma = match &self.backend {
            Backend::LocalOpen { pool, .. } => Self::local_dma(pool).0,
            _ => unreachable!("register matched LocalOpen"),
        };
        let mut mapped = Vec::with_capacity(keeps.len());
        let mut keeps = keeps.into_iter();
        for (tensor, keep) in checked.tensors.iter().zip(keeps.by_ref()) {
            match crate::ffi::map_caller_memory(&dma, tensor.address, tensor.extent_bytes, keep) {
                Ok(memory) => mapped.push(memory),
                Err((error, keep)) => {
                    // This one, those mapped before it and those not reached yet: all dropped
                    // once the lock is let go (`released`).
                    self.released.push(keep);
                    for memory in mapped {
                        self.released.extend(CallerMemory::release(memory, &QueuesGone::never_used()));
                    }
                    self.released.extend(keeps);
                    return Err(Failure::from(error));
                }
            }
        }
        self.released.extend(keeps);
        let iovas: Vec<Iova> = mapped.iter().map(CallerMemory::iova).collect();
        let layout = store_layout(&checked, &iovas);
        if let Err(failure) = self.build_local(layout, checked.num_blocks) {
            for memory in mapped {
                self.released.extend(memory.release(&QueuesGone::never_used()));
            }
            return Err(failure);
        }
        self.caller_memory = mapped;
        self.registered = Some(checked);
        Ok(())
    }

    /// `allocate_kv`: allocates `num_blocks` blocks in layout `kind` and registers them; returns
    /// the regions (what the KvBuffers hand out) and the flag the close sets should it keep
    /// them for good (each KvBuffer's).
    pub fn allocate(&mut self, kind: LayoutKind, num_blocks: u32, timeout: Duration) -> Result<(Vec<DmaRegion>, KeptForGood), Failure> {
        // Closed first (`registered` outlives the close): StaleRequest, as every call after it.
        if self.is_closed() {
            return Err(closed());
        }
        if self.registered.is_some() {
            return Err(Failure::new(ErrorClass::InvalidState, "KV memory is registered already (once per store)"));
        }
        if num_blocks == 0 {
            return Err(Failure::new(ErrorClass::InvalidArgument, "allocate_kv(0 blocks): expected at least 1"));
        }
        let allocated = match &mut self.backend {
            Backend::LocalOpen { pool, .. } => {
                let geometry = *pool.geometry();
                let (dma, _) = Self::local_dma(pool);
                let sizes = region_bytes(kind, &geometry, num_blocks)?;
                let regions = sizes
                    .iter()
                    .map(|&bytes| dma.allocate(bytes as usize).and_then(|region| region.subregion(0, bytes as usize)))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|error| Failure::new(ErrorClass::Device, format!("allocating {num_blocks} KV blocks: {error}")))?;
                let iovas: Vec<Iova> = regions.iter().map(DmaRegion::iova).collect();
                let checked = allocation_layout(kind, &geometry, num_blocks, &regions);
                let layout = store_layout(&checked, &iovas);
                self.build_local(layout, num_blocks)?;
                let kept_for_good = KeptForGood::default();
                self.allocation =
                    Some(Allocation { regions: regions.clone(), checked: checked.clone(), kept_for_good: kept_for_good.clone() });
                self.registered = Some(checked);
                (regions, kept_for_good)
            }
            Backend::RemoteAttached { .. } => {
                let Backend::RemoteAttached { client, hello, mut config } = std::mem::replace(&mut self.backend, Backend::Closed) else {
                    unreachable!("matched above")
                };
                config.kv_blocks = num_blocks;
                config.timeout = timeout;
                let geometry = crate::geometry::of_hello(&hello.shape)?;
                let window = match kind {
                    LayoutKind::Separate => WindowKvLayout::SeparateKv,
                    LayoutKind::Fused => WindowKvLayout::FusedPerLayer,
                    LayoutKind::Paged => WindowKvLayout::PagedPerLayer,
                    LayoutKind::BlockMajor => WindowKvLayout::BlockMajor,
                };
                // A failure here leaves the session gone (the client is consumed): the store is
                // closed and says so.
                let mut store = RemoteKvStore::with_client(client, hello, &config, window)?;
                self.touch_daemon();
                // Before any request is prepared (see `build_local`).
                store.data_mut().set_layers_in_flight_max(self.layers_in_flight_max)?;
                // The window's regions are page-rounded: hand out exactly the KV bytes.
                let sizes = region_bytes(kind, &geometry, num_blocks)?;
                let regions = store
                    .kv_regions()
                    .iter()
                    .zip(&sizes)
                    .map(|(region, &bytes)| region.subregion(0, bytes as usize))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(Failure::from)?;
                let checked = allocation_layout(kind, &geometry, num_blocks, &regions);
                self.backend = Backend::Remote { store: Box::new(store) };
                let kept_for_good = KeptForGood::default();
                self.allocation =
                    Some(Allocation { regions: regions.clone(), checked: checked.clone(), kept_for_good: kept_for_good.clone() });
                self.registered = Some(checked);
                (regions, kept_for_good)
            }
            Backend::Closed => return Err(closed()),
            Backend::Local { .. } | Backend::Remote { .. } => unreachable!("a registered store has `registered` set"),
        };
        Ok(allocated)
    }
}

/// Sizes of the regions `allocate_kv` makes for `kind` (as tuttid's window lays them out).
fn region_bytes(kind: LayoutKind, geometry: &objstore::ModelGeometry, num_blocks: u32) -> Result<Vec<u64>, Failure> {
    let unit = kind.unit_bytes(geometry);
    let per_tensor = match kind {
        LayoutKind::Fused => 2 * unit,
        _ => unit,
    };
    let bytes = per_tensor
        .checked_mul(u64::from(num_blocks))
        .filter(|&bytes| usize::try_from(bytes).is_ok())
        .ok_or_else(|| Failure::new(ErrorClass::InvalidArgument, format!("{num_blocks} KV blocks of {geometry} overflow")))?;
    Ok(vec![bytes; kind.tensor_count(geometry.layers)])
}

/// The checked layout of an allocation (host addresses of `regions`).
fn allocation_layout(kind: LayoutKind, geometry: &objstore::ModelGeometry, num_blocks: u32, regions: &[DmaRegion]) -> CheckedLayout {
    let unit = kind.unit_bytes(geometry);
    let extent = if kind == LayoutKind::Fused { 2 * unit * u64::from(num_blocks) } else { unit * u64::from(num_blocks) };
    CheckedLayout {
        kind,
        num_blocks,
        block_stride_bytes: unit,
        device: crate::tensor::Device::Cpu,
        tensors: regions
            .iter()
            .map(|region| crate::tensor::PlacedTensor { address: region.host_address() as u64, extent_bytes: extent })
            .collect(),
    }
}

/// objstore's layout over the tensors' IOVAs.
fn store_layout(checked: &CheckedLayout, iovas: &[Iova]) -> StoreLayout {
    let stride = checked.block_stride_bytes;
    match checked.kind {
        LayoutKind::Separate => {
            let (keys, values) = iovas.split_at(iovas.len() / 2);
            StoreLayout::SeparateKv { key_bases: keys.to_vec(), value_bases: values.to_vec(), block_stride_bytes: stride }
        }
        LayoutKind::Fused => StoreLayout::FusedPerLayer { layer_bases: iovas.to_vec(), block_stride_bytes: stride },
        LayoutKind::Paged => StoreLayout::PagedPerLayer { layer_bases: iovas.to_vec(), block_stride_bytes: stride },
        LayoutKind::BlockMajor => StoreLayout::BlockMajor { base: iovas[0], block_stride_bytes: stride },
    }
}
