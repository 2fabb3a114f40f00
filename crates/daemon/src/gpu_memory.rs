//! KV memory the daemon reaches only by copies: GPU memory an engine registers through CUDA IPC,
//! or its software stand-in, a client's memfd (docs/tuttid.md, "GPU memory").
//!
//! A client names an allocation (`RegisterDeviceMemory`); the [`DeviceMemoryService`] opens it
//! in the daemon (`cuIpcOpenMemHandle` in the daemon's own context, or mapping the memfd) as a
//! [`CopiedMemory`]; the pool's DMA space gives it an IOVA (`DmaAllocator::map_copied`); the
//! software controllers inside the daemon then move the client's commands' data with the
//! memory's own copies (`cuMemcpyDtoH` / `cuMemcpyHtoD`; `memcpy` for the stand-in). The
//! emulator's data path is the same for both: nothing in it knows CUDA.
//!
//! What the daemon checks (the client is untrusted): the kind is one this daemon imports; every
//! pool device is a software controller ([`VFIO_REFUSAL`] otherwise); the range lies in the
//! allocation as the daemon itself sees it once imported (the driver's size, the memfd's size),
//! not as the client claims; no two registrations overlap, in this session ([`ErrorCode::BadRequest`])
//! or another ([`ErrorCode::NotYours`]: memory someone else registered), windows included: a
//! window's memfd is claimed as bytes `0..window_bytes` of that memfd ([`DeviceMemoryService::claim_window`],
//! keyed as a memfd stand-in is), so no byte of a memfd is ever both one session's window (its
//! rings, its mapping table) and another's device memory, or in two sessions' windows (other
//! bytes of one memfd may be registered separately: nothing is shared). What it cannot check: a
//! CUDA IPC handle is a bearer capability, and the driver does not say which process exported
//! it, so a client holding another process's handle bytes can register that memory if nobody
//! registered it first. The socket's owner-only mode and peer-credential check are the boundary
//! (every client of one daemon is trusted as much as the daemon, as for the IOMMU).

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard};

use nvme_driver::hw::{CopiedMemory, DmaAllocator, DmaPool, DmaRegion, HwError, SharedMemory};

use crate::protocol::{DeviceMemoryKind, ErrorCode, RegisterDeviceMemory};

/// Why GPU memory cannot be registered on a pool with a `vfio:` device, as the daemon answers it.
pub const VFIO_REFUSAL: &str = "GPU memory on a vfio: device needs its IOMMU domain to map GPU memory for the SSD's \
     peer-to-peer DMA, and no kernel interface this daemon can use does: VFIO type1 (VFIO_IOMMU_MAP_DMA) maps a \
     process's virtual addresses of host pages, iommufd's IOMMU_IOAS_MAP_FILE takes memfds and only VFIO's own \
     dma-bufs, not a GPU's (cuMemGetHandleForAddressRange); the routes that exist leave VFIO (GPUDirect Storage: \
     nvidia-fs.ko with the kernel NVMe driver; BaM: its own kernel module over nvidia_p2p_get_pages). Register \
     host memory (RegisterMemory) on this pool, or run the pool on emu: devices (docs/tuttid.md, GPU memory)";

/// Which device memory this daemon imports (`tuttid --device-memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceMemoryImport {
    /// None: `RegisterDeviceMemory` is `Unsupported`.
    #[default]
    Off,
    /// Clients' sealed memfds, reached by copies (the stand-in for GPU memory; tests).
    Memfd,
    /// GPU memory through CUDA IPC (needs the `cuda` feature and a CUDA driver).
    Cuda,
}

impl DeviceMemoryImport {
    fn kind(self) -> Option<DeviceMemoryKind> {
        match self {
            DeviceMemoryImport::Off => None,
            DeviceMemoryImport::Memfd => Some(DeviceMemoryKind::Memfd),
            DeviceMemoryImport::Cuda => Some(DeviceMemoryKind::CudaIpc),
        }
    }
}

pub(crate) use crate::report::Refusal;

/// Identifies an allocation across registrations: two registrations of one allocation carry the
/// same key, whichever request made them (a window or device memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocationKey {
    /// A memfd (a window, or the device-memory stand-in): its device and inode, the same for
    /// every descriptor of it in any process (and not reused while the daemon maps it).
    File { device: u64, inode: u64 },
    /// GPU memory: the GPU and the imported allocation's base, which the driver returns again
    /// for a handle this context opened already.
    Gpu { ordinal: u64, base: u64 },
}

impl AllocationKey {
    /// The key of the file behind `fd` (`fstat`).
    pub fn of_file(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<AllocationKey> {
        #[cfg(test)]
        FILES_KEYED.with(|keyed| keyed.set(keyed.get() + 1));
        let metadata = File::from(fd.try_clone_to_owned()?).metadata()?;
        Ok(AllocationKey::File { device: metadata.dev(), inode: metadata.ino() })
    }
}

#[cfg(test)]
thread_local! {
    /// Files [`AllocationKey::of_file`] reached on this thread (a test's count of what got as
    /// far as its dup, fstat and close).
    static FILES_KEYED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// One imported registration, before it is mapped.
pub struct Imported {
    pub memory: Arc<dyn CopiedMemory>,
    pub key: AllocationKey,
    /// The registered bytes, as offsets in the allocation.
    pub start: u64,
    pub end: u64,
    /// The range's dma-buf, where the client sent one: kept with the registration (the handle an
    /// IOMMU import would take; the software controller does not need it).
    pub dma_buf: Option<OwnedFd>,
}

struct ClaimEntry {
    key: AllocationKey,
    start: u64,
    end: u64,
    session: u64,
    registration: u64,
    /// What the registration is, for the refusal's message.
    what: &'static str,
}

/// A registration's hold on its range of an allocation; released when dropped (with the
/// registration, after its session's queue pairs were deleted; never, for a registration kept
/// for good).
pub struct Claim {
    claims: Arc<Mutex<Vec<ClaimEntry>>>,
    registration: u64,
}

impl Drop for Claim {
    fn drop(&mut self) {
        lock(&self.claims).retain(|entry| entry.registration != self.registration);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The daemon's device-memory import: which kind it takes, the GPUs it opened, and every
/// registered range, windows' included (for the overlap check).
pub struct DeviceMemoryService {
    import: DeviceMemoryImport,
    claims: Arc<Mutex<Vec<ClaimEntry>>>,
    /// Memfds are mapped here, a DMA space no device uses: the controllers reach them only
    /// through the copies, never by translating into host memory.
    private_space: DmaPool,
    #[cfg(feature = "cuda")]
    gpus: Mutex<Vec<Arc<tutti_cuda_ipc::Gpu>>>,
}

impl DeviceMemoryService {
    /// A service importing `import`. `Cuda` needs this build's `cuda` feature and a loadable
    /// driver (checked here, so a daemon that cannot import says so at start).
    pub fn new(import: DeviceMemoryImport) -> Result<DeviceMemoryService, String> {
        if import == DeviceMemoryImport::Cuda {
            #[cfg(not(feature = "cuda"))]
            return Err("--device-memory cuda: this tuttid was built without the `cuda` feature (tools/cuda-build.sh builds it)".into());
            #[cfg(feature = "cuda")]
            if !tutti_cuda_ipc::driver_available() {
                return Err(tutti_cuda_ipc::CudaIpcError::NoDriver.to_string());
            }
        }
        Ok(DeviceMemoryService {
            import,
            claims: Arc::new(Mutex::new(Vec::new())),
            private_space: DmaPool::identity(),
            #[cfg(feature = "cuda")]
            gpus: Mutex::new(Vec::new()),
        })
    }

    /// Checks that this daemon takes `kind`.
    pub fn check_kind(&self, kind: DeviceMemoryKind) -> Result<(), Refusal> {
        match self.import.kind() {
            Some(taken) if taken == kind => Ok(()),
            Some(taken) => Err((ErrorCode::Unsupported, format!("this daemon imports {taken:?} device memory, not {kind:?}"))),
            None => Err((
                ErrorCode::Unsupported,
                "this daemon imports no device memory: start it with --device-memory cuda (GPU memory through CUDA IPC)".into(),
            )),
        }
    }

    /// Opens the memory a request names (its descriptors in `fds`), checked against the
    /// allocation as the daemon sees it.
    pub fn import(&self, request: &RegisterDeviceMemory, fds: &mut Vec<OwnedFd>) -> Result<Imported, Refusal> {
        self.check_kind(request.kind)?;
        match request.kind {
            DeviceMemoryKind::Memfd => self.import_memfd(request, fds),
            DeviceMemoryKind::CudaIpc => self.import_cuda(request, fds),
        }
    }

    /// Enters `imported`'s range for `registration` of `session`, unless it overlaps a range
    /// registered before (device memory or a window).
    pub fn claim(&self, imported: &Imported, session: u64, registration: u64) -> Result<Claim, Refusal> {
        self.claim_range(ClaimEntry {
            key: imported.key,
            start: imported.start,
            end: imported.end,
            session,
            registration,
            what: "device memory",
        })
    }

    /// Enters a window's memfd, bytes `0..window.len()` (what the daemon maps), for
    /// `registration` of `session`, unless they overlap a range registered before (device
    /// memory or a window). Keyed as a memfd registered as device memory is, so either finds
    /// the other.
    pub fn claim_window(&self, window: &SharedMemory, session: u64, registration: u64) -> Result<Claim, Refusal> {
        let key = AllocationKey::of_file(window.fd().as_fd())
            .map_err(|error| (ErrorCode::StoreFailed, format!("fstat of the window's memfd in the daemon: {error}")))?;
        self.claim_range(ClaimEntry { key, start: 0, end: window.len() as u64, session, registration, what: "a window" })
    }

    fn claim_range(&self, entry: ClaimEntry) -> Result<Claim, Refusal> {
        let mut claims = lock(&self.claims);
        if let Some(other) = claims.iter().find(|other| other.key == entry.key && other.start < entry.end && entry.start < other.end) {
            let what = format!(
                "bytes {}..{} of this allocation overlap bytes {}..{} of registration {} ({})",
                entry.start, entry.end, other.start, other.end, other.registration, other.what
            );
            return Err(if other.session == entry.session {
                (ErrorCode::BadRequest, format!("{what} of this session"))
            } else {
                (ErrorCode::NotYours, format!("{what}, another session's: memory another client registered"))
            });
        }
        let registration = entry.registration;
        claims.push(entry);
        Ok(Claim { claims: Arc::clone(&self.claims), registration })
    }

    fn import_memfd(&self, request: &RegisterDeviceMemory, fds: &mut Vec<OwnedFd>) -> Result<Imported, Refusal> {
        if fds.len() != 1 {
            return Err((ErrorCode::BadRequest, format!("a memfd registration takes one descriptor (the memfd), got {}", fds.len())));
        }
        let bad = |message: String| (ErrorCode::BadRequest, message);
        let allocation_bytes =
            usize::try_from(request.allocation_bytes).map_err(|_| bad(format!("an allocation of {} bytes", request.allocation_bytes)))?;
        let fd = fds.remove(0);
        // Checked as a sealed memfd first (F_GET_SEALS answers without I/O): only then keyed,
        // whose dup, fstat and close could block this connection's thread on another file (a
        // hung FUSE or NFS mount) before it was refused.
        let memory = SharedMemory::from_fd(fd, allocation_bytes).map_err(|error| bad(format!("the device memory descriptor: {error}")))?;
        let key = AllocationKey::of_file(memory.fd().as_fd())
            .map_err(|error| (ErrorCode::StoreFailed, format!("fstat of the memfd in the daemon: {error}")))?;
        // The memfd's real size bounds the range: `from_fd` checked it holds the claimed size.
        let (start, end) = range_in(request, request.allocation_bytes)?;
        let window = self
            .private_space
            .map_shared(&memory)
            .map_err(|error| (ErrorCode::StoreFailed, format!("mapping the memfd in the daemon: {error}")))?;
        let view = window.subregion(start as usize, (end - start) as usize).map_err(|error| bad(error.to_string()))?;
        Ok(Imported { memory: Arc::new(MemfdMemory { view }), key, start, end, dma_buf: None })
    }

    #[cfg(not(feature = "cuda"))]
    fn import_cuda(&self, _request: &RegisterDeviceMemory, _fds: &mut Vec<OwnedFd>) -> Result<Imported, Refusal> {
        // `new` refuses DeviceMemoryImport::Cuda in this build, so check_kind refused already.
        Err((ErrorCode::Unsupported, "this tuttid was built without the `cuda` feature".into()))
    }

    #[cfg(feature = "cuda")]
    fn import_cuda(&self, request: &RegisterDeviceMemory, fds: &mut Vec<OwnedFd>) -> Result<Imported, Refusal> {
        use tutti_cuda_ipc::{Gpu, ImportedMemory};
        if fds.len() > 1 {
            return Err((
                ErrorCode::BadRequest,
                format!("a CUDA IPC registration takes at most one descriptor (its dma-buf), got {}", fds.len()),
            ));
        }
        let (start, end) = range_in(request, request.allocation_bytes)?;
        let gpu = {
            let mut gpus = lock(&self.gpus);
            match gpus.iter().find(|gpu| gpu.uuid() == request.device_uuid) {
                Some(gpu) => Arc::clone(gpu),
                None => {
                    let gpu = Gpu::open_by_uuid(&request.device_uuid).map_err(|error| cuda_refusal(REGISTRATION_GPU, error))?;
                    tracing::info!(ordinal = gpu.ordinal(), name = gpu.name(), "opened a GPU for CUDA IPC imports");
                    gpus.push(Arc::clone(&gpu));
                    gpu
                }
            }
        };
        let imported =
            ImportedMemory::open(&gpu, &request.handle, start, end - start).map_err(|error| cuda_refusal(CUDA_IPC_HANDLE, error))?;
        let dma_buf = match fds.pop() {
            None => None,
            Some(fd) => Some(check_dma_buf(fd, end - start)?),
        };
        let key = AllocationKey::Gpu { ordinal: gpu.ordinal() as u64, base: imported.imported_base() };
        Ok(Imported { memory: Arc::new(imported), key, start, end, dma_buf })
    }
}

/// What a CUDA failure in `import_cuda` was doing: opening the GPU the client named.
#[cfg(feature = "cuda")]
const REGISTRATION_GPU: &str = "the registration's GPU";
/// ... opening the client's handle in that GPU's context.
#[cfg(feature = "cuda")]
const CUDA_IPC_HANDLE: &str = "the CUDA IPC handle";

/// What `cuIpcOpenMemHandle` answers for a handle that does not open (forged, stale: its
/// allocation freed or its exporter gone; or one of this process's own), as `tutti_cuda_ipc`
/// names a `CUresult` (its `Debug` name, cudarc's `cudaError_enum` variant).
#[cfg(feature = "cuda")]
const HANDLE_REFUSALS: [&str; 6] = [
    "CUDA_ERROR_INVALID_VALUE",
    "CUDA_ERROR_INVALID_HANDLE",
    "CUDA_ERROR_ALREADY_MAPPED",
    // Documented answers of cuIpcOpenMemHandle to what the client sent: an exporter that died or
    // lives in another IPC namespace (MAP_FAILED), an allocation on a GPU this one cannot or may
    // no more reach as a peer (the registration named another GPU than the allocation's).
    "CUDA_ERROR_MAP_FAILED",
    "CUDA_ERROR_TOO_MANY_PEERS",
    "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
];

/// The answer to a failed CUDA import, by whose fault it is: what the client sent
/// ([`ErrorCode::BadRequest`]: a handle `cuIpcOpenMemHandle` refuses ([`HANDLE_REFUSALS`]), a
/// range outside the allocation, a GPU this machine does not have) or the daemon's own CUDA
/// context ([`ErrorCode::StoreFailed`]: retaining or making it current, a sticky error such as
/// `CUDA_ERROR_ILLEGAL_ADDRESS`, out of memory while importing, any other call), or a kind the
/// daemon cannot import ([`ErrorCode::Unsupported`]).
#[cfg(feature = "cuda")]
fn cuda_refusal(context: &str, error: tutti_cuda_ipc::CudaIpcError) -> Refusal {
    use tutti_cuda_ipc::CudaIpcError;
    match &error {
        CudaIpcError::NoDriver | CudaIpcError::DriverTooOld { .. } => (ErrorCode::Unsupported, format!("{context}: {error}")),
        CudaIpcError::Cuda { call: "cuIpcOpenMemHandle", result } if HANDLE_REFUSALS.contains(&result.as_str()) => {
            (ErrorCode::BadRequest, format!("{context} does not open (another process's allocation, still alive?): {error}"))
        }
        CudaIpcError::Cuda { .. } | CudaIpcError::NoSuchDevice { .. } => {
            (ErrorCode::StoreFailed, format!("{context}: the daemon's CUDA context failed, not the request: {error}"))
        }
        CudaIpcError::NoDeviceWithUuid { .. }
        | CudaIpcError::OutsideAllocation { .. }
        | CudaIpcError::ZeroLength
        | CudaIpcError::NotIpcCapable
        // The client named a GPU that does not hold its memory.
        | CudaIpcError::WrongDevice { .. } => (ErrorCode::BadRequest, format!("{context}: {error}")),
    }
}

/// A dma-buf of the registered range: `/proc/self/fdinfo` must call it a dma-buf (an `exp_name:`
/// line, the exporting driver) of at least the range's size (a `size:` line; exporters may round
/// up to their granularity). Logged with its exporter.
#[cfg(feature = "cuda")]
fn check_dma_buf(fd: OwnedFd, length_bytes: u64) -> Result<OwnedFd, Refusal> {
    use std::os::fd::AsRawFd;
    let bad = |message: String| (ErrorCode::BadRequest, message);
    let path = format!("/proc/self/fdinfo/{}", fd.as_raw_fd());
    let info = std::fs::read_to_string(&path).map_err(|error| bad(format!("the descriptor sent as a dma-buf ({path}): {error}")))?;
    let field = |name: &str| info.lines().find_map(|line| line.strip_prefix(name).map(str::trim));
    let Some(exporter) = field("exp_name:") else {
        return Err(bad("the descriptor sent as a dma-buf is not one (no exp_name in its fdinfo)".into()));
    };
    let size = field("size:").and_then(|size| size.parse::<u64>().ok());
    match size {
        Some(size) if size >= length_bytes => {
            tracing::info!(exporter, size, length_bytes, "a registration's dma-buf");
            Ok(fd)
        }
        _ => Err(bad(format!("the dma-buf ({exporter}) holds {size:?} bytes, the registration {length_bytes}"))),
    }
}

/// The request's range in an allocation of `allocation_bytes`: `(start, end)`, non-empty.
fn range_in(request: &RegisterDeviceMemory, allocation_bytes: u64) -> Result<(u64, u64), Refusal> {
    let end = request.offset_bytes.checked_add(request.length_bytes);
    match end {
        Some(end) if request.length_bytes > 0 && end <= allocation_bytes => Ok((request.offset_bytes, end)),
        _ => Err((
            ErrorCode::BadRequest,
            format!(
                "{} bytes at offset {} do not lie in the allocation of {allocation_bytes} bytes",
                request.length_bytes, request.offset_bytes
            ),
        )),
    }
}

/// A client's memfd range, reached only by copies (the host-backed [`CopiedMemory`]).
struct MemfdMemory {
    view: DmaRegion,
}

impl CopiedMemory for MemfdMemory {
    fn len(&self) -> usize {
        self.view.len()
    }

    fn read(&self, offset: usize, destination: &mut [u8]) -> Result<(), HwError> {
        self.view.read(offset, destination)
    }

    fn write(&self, offset: usize, source: &[u8]) -> Result<(), HwError> {
        self.view.write(offset, source)
    }

    fn describe(&self) -> String {
        format!("{} bytes of a client's memfd, reached by copies", self.view.len())
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_that_is_not_a_dma_buf_is_refused() {
        // Goal: what a client sends as its range's dma-buf is checked: a memfd (or any file
        // without a dma-buf exporter) is refused, naming why. (No dma-buf exporter exists on a
        // machine without a GPU or /dev/udmabuf, so the accepting side runs on the GPU machine.)
        let memory = SharedMemory::create("not-a-dma-buf", 1 << 20).unwrap();
        let refused = check_dma_buf(memory.fd().try_clone_to_owned().unwrap(), 1 << 20).expect_err("refused");
        assert_eq!(refused.0, ErrorCode::BadRequest);
        assert!(refused.1.contains("is not one"), "{}", refused.1);
    }

    #[test]
    fn cuda_failures_in_the_daemon_are_not_the_clients_bad_request() {
        // Goal: only what the client sent is its BadRequest: a handle cuIpcOpenMemHandle does not
        // open (INVALID_VALUE, INVALID_HANDLE, ALREADY_MAPPED, MAP_FAILED, TOO_MANY_PEERS,
        // PEER_ACCESS_UNSUPPORTED) and a range outside the
        // allocation. The daemon's own CUDA context failing (retaining or making it current, a
        // sticky ILLEGAL_ADDRESS, out of memory while importing, any other call) is StoreFailed
        // and does not send the client looking for "another process's allocation".
        use tutti_cuda_ipc::CudaIpcError;
        let cuda = |call: &'static str, result: &str| CudaIpcError::Cuda { call, result: result.into() };
        for daemon_side in [
            cuda("cuCtxSetCurrent", "CUDA_ERROR_ILLEGAL_ADDRESS"),
            cuda("cuDevicePrimaryCtxRetain", "CUDA_ERROR_OUT_OF_MEMORY"),
            cuda("cuIpcOpenMemHandle", "CUDA_ERROR_OUT_OF_MEMORY"),
            cuda("cuIpcOpenMemHandle", "CUDA_ERROR_ILLEGAL_ADDRESS"),
            cuda("cuMemGetAddressRange", "CUDA_ERROR_INVALID_VALUE"),
            cuda("cuDeviceGetCount", "CUDA_ERROR_NOT_INITIALIZED"),
        ] {
            let described = daemon_side.to_string();
            let (code, message) = cuda_refusal(CUDA_IPC_HANDLE, daemon_side);
            assert_eq!(code, ErrorCode::StoreFailed, "{described}: {message}");
            assert!(!message.contains("still alive"), "{message}");
        }
        for handle in [
            "CUDA_ERROR_INVALID_VALUE",
            "CUDA_ERROR_INVALID_HANDLE",
            "CUDA_ERROR_ALREADY_MAPPED",
            "CUDA_ERROR_MAP_FAILED",
            "CUDA_ERROR_TOO_MANY_PEERS",
            "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        ] {
            let (code, message) = cuda_refusal(CUDA_IPC_HANDLE, cuda("cuIpcOpenMemHandle", handle));
            assert_eq!(code, ErrorCode::BadRequest, "{message}");
            assert!(message.contains(handle) && message.contains("still alive"), "{message}");
        }
        let outside = CudaIpcError::OutsideAllocation { offset_bytes: 0, length_bytes: 1 << 30, allocation_bytes: 1 << 20 };
        assert_eq!(cuda_refusal(CUDA_IPC_HANDLE, outside).0, ErrorCode::BadRequest);
        let unknown_gpu = CudaIpcError::NoDeviceWithUuid { uuid: "GPU-0".into() };
        assert_eq!(cuda_refusal(REGISTRATION_GPU, unknown_gpu).0, ErrorCode::BadRequest);
        assert_eq!(cuda_refusal(REGISTRATION_GPU, CudaIpcError::NoDriver).0, ErrorCode::Unsupported);
    }
}

#[cfg(test)]
mod memfd_tests {
    use super::*;

    fn memfd_request(allocation_bytes: u64) -> RegisterDeviceMemory {
        RegisterDeviceMemory {
            kind: DeviceMemoryKind::Memfd,
            handle: [0; 64],
            device_uuid: [0; 16],
            allocation_bytes,
            offset_bytes: 0,
            length_bytes: allocation_bytes,
            kv_blocks: 4,
        }
    }

    #[test]
    fn a_descriptor_that_is_not_a_memfd_is_refused_before_anything_else_touches_it() {
        // Goal: a client's descriptor for the memfd stand-in is checked as a sealed memfd
        // (F_GET_SEALS, answered without I/O) before anything else the daemon does with it:
        // keying it (a dup, an fstat and a close, which on a hung FUSE or NFS file would block
        // the connection's thread) comes only after. A pipe is refused as BadRequest without
        // being keyed; a sealed memfd is keyed once.
        let service = DeviceMemoryService::new(DeviceMemoryImport::Memfd).unwrap();
        let keyed = || FILES_KEYED.with(std::cell::Cell::get);
        let (reader, _writer) = std::io::pipe().unwrap();
        let mut fds = vec![OwnedFd::from(reader)];
        let before = keyed();
        match service.import(&memfd_request(1 << 20), &mut fds) {
            Err((code, message)) => {
                assert_eq!(code, ErrorCode::BadRequest, "{message}");
                assert!(message.contains("device memory descriptor"), "{message}");
            }
            Ok(_) => panic!("a pipe was imported as a memfd"),
        }
        assert_eq!(keyed(), before, "the pipe was keyed (dup, fstat, close) before it was refused");
        let memory = SharedMemory::create("keyed-memfd", 1 << 20).unwrap();
        let mut fds = vec![memory.fd().try_clone_to_owned().unwrap()];
        let before = keyed();
        let Ok(imported) = service.import(&memfd_request(1 << 20), &mut fds) else { panic!("the sealed memfd was refused") };
        assert_eq!(keyed(), before + 1, "the memfd is keyed once");
        assert_eq!(imported.key, AllocationKey::of_file(memory.fd().as_fd()).unwrap());
    }
}
