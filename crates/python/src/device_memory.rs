//! KV memory tuttid reaches only by copies (docs/python.md, "GPU memory"): an engine's CUDA
//! tensors, exported through CUDA IPC (`tutti_cuda_ipc`, feature `cuda`), or their CPU
//! stand-in, a [`DeviceMemoryStandIn`] (a sealed memfd mapped here, which tuttid started with
//! `--device-memory memfd` maps and copies to and from as it copies GPU memory).
//!
//! A registered layout becomes one range: from its lowest tensor's first byte to its highest
//! tensor's end ([`CheckedLayout::span`]). That range must lie in one allocation (one
//! `cudaMalloc`: vLLM 0.32 allocates all layers' KV as one; or one stand-in), which the daemon
//! opens once; the layout's tensors are offsets in it (`RemoteKvStore::with_client_and_device_memory`).
//! Nothing here holds unsafe code: the CUDA calls are `tutti_cuda_ipc`'s.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use nvme_driver::hw::{AddressSpaceId, DmaWindow, SharedMemory};
use nvme_driver::{DmaAllocator, DmaRegion, Iova};
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use tutti_daemon::client::DeviceKvMemory;
use tutti_daemon::peer::PeerProcess;
use tutti_daemon::Client;

use crate::errors::{ErrorClass, Failure};
use crate::ffi::{self, DLPACK_CPU};
use crate::memory::Keep;
use crate::tensor::{CheckedLayout, Device};

/// Bytes of a page: a stand-in's size is rounded up to it (memfds are page sized).
const PAGE_BYTES: u64 = 4096;
/// The largest stand-in: host memory tuttid maps too (its per-session cap applies as well).
const STAND_IN_BYTES_MAX: u64 = 1 << 40;

/// The live stand-ins: (first byte, length, the memfd). Registration finds the one holding a
/// layout's range here, as the CUDA driver finds the allocation holding a device pointer.
static STAND_INS: Mutex<Vec<(u64, u64, Weak<SharedMemory>)>> = Mutex::new(Vec::new());

fn stand_ins() -> std::sync::MutexGuard<'static, Vec<(u64, u64, Weak<SharedMemory>)>> {
    STAND_INS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The CPU stand-in for GPU memory (module stub: `DeviceMemoryStandIn`): `nbytes` of a sealed
/// memfd mapped in this process. Tensors over it (its `__dlpack__`, numpy, torch) registered
/// with a store attached to tuttid go the GPU route: tuttid (`--device-memory memfd`) maps the
/// memfd and reaches it only by copies. With an in-process store it is plain CPU memory.
#[pyclass(frozen, module = "tutti")]
pub struct DeviceMemoryStandIn {
    region: DmaRegion,
    /// Dropped in a forked child, the region is leaked without taking the DMA pool's lock.
    owner: crate::process::OwningProcess,
}

impl Drop for DeviceMemoryStandIn {
    fn drop(&mut self) {
        if !self.owner.is_current() {
            std::mem::forget(self.region.clone());
        }
    }
}

#[pymethods]
impl DeviceMemoryStandIn {
    #[new]
    fn new(nbytes: u64) -> PyResult<DeviceMemoryStandIn> {
        if nbytes == 0 || nbytes > STAND_IN_BYTES_MAX {
            return Err(Failure::new(
                ErrorClass::InvalidArgument,
                format!("DeviceMemoryStandIn({nbytes}): expected 1..={STAND_IN_BYTES_MAX} bytes"),
            )
            .into());
        }
        let rounded = nbytes.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let device = |error: String| PyErr::from(Failure::new(ErrorClass::Device, format!("creating a {rounded}-byte stand-in: {error}")));
        let memory = SharedMemory::create("tutti-device-stand-in", rounded as usize).map_err(|error| device(error.to_string()))?;
        // A window of this process's own, only to address the mapping (no device uses it).
        let window = DmaWindow::new(Arc::clone(&memory), Iova(0), AddressSpaceId(0)).map_err(|error| device(error.to_string()))?;
        let region = window
            .allocate(rounded as usize)
            .and_then(|region| region.subregion(0, nbytes as usize))
            .map_err(|error| device(error.to_string()))?;
        let mut live = stand_ins();
        live.retain(|(_, _, memory)| memory.strong_count() > 0);
        live.push((region.host_address() as u64, nbytes, Arc::downgrade(&memory)));
        Ok(DeviceMemoryStandIn { region, owner: crate::process::OwningProcess::current() })
    }

    #[getter]
    fn address(&self) -> u64 {
        self.region.host_address() as u64
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.region.len() as u64
    }

    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Py<PyAny>>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream; // host memory: no stream
        let versioned = ffi::accepts_versioned(py, max_version);
        if copy == Some(true) || dl_device.is_some_and(|(device_type, _)| device_type != DLPACK_CPU) {
            return Err(PyBufferError::new_err("a DeviceMemoryStandIn is handed out in place, as CPU memory"));
        }
        ffi::export_dlpack(py, &self.region, versioned)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (DLPACK_CPU, 0)
    }

    /// `numpy.from_dlpack(self)`.
    fn numpy<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.py().import("numpy")?.call_method1("from_dlpack", (slf,))
    }

    fn __repr__(&self) -> String {
        format!("DeviceMemoryStandIn(address={:#x}, nbytes={})", self.region.host_address(), self.region.len())
    }
}

/// What keeps the exported allocation's side alive for the registration's life: the
/// stand-in's memfd, or the GPU's retained context.
pub enum Holder {
    StandIn(Arc<SharedMemory>),
    #[cfg(feature = "cuda")]
    Gpu(Arc<tutti_cuda_ipc::Gpu>),
}

/// A layout's range, ready to register with tuttid: the request's fields, where the range
/// starts (the address its tensors' offsets count from), and what to hold.
pub struct DeviceRange {
    pub memory: DeviceKvMemory,
    pub start: u64,
    pub holder: Holder,
}

/// Why the range of `checked` is not one allocation, as the error says it.
fn not_one_allocation(what: &str, start: u64, len: u64, allocation: String) -> Failure {
    Failure::new(
        ErrorClass::UnsupportedMemory,
        format!(
            "the registered tensors span {start:#x}..{:#x} ({len} bytes), which is not inside one {what} ({allocation}): \
             tuttid opens one allocation per registration; allocate the KV cache as one tensor and register views \
             over it (vLLM 0.32 allocates all layers as one)",
            start + len
        ),
    )
}

/// A live stand-in holding the first byte of a layout's span (`stand_in_of`): where it starts,
/// its length, and its memfd.
pub struct StandIn {
    first: u64,
    bytes: u64,
    memory: Arc<SharedMemory>,
}

/// The live stand-in holding the first byte of `checked`'s span, when it is CPU memory (what
/// `export` takes). Only with the GIL held (`_py`): the list of live stand-ins is a static
/// lock, and one a thread held across a fork (`os.fork` needs the GIL) would stay held for good
/// in the child, whose next `DeviceMemoryStandIn(n)` would wait for it for ever.
pub fn stand_in_of(_py: Python<'_>, checked: &CheckedLayout) -> Option<StandIn> {
    if checked.device != Device::Cpu {
        return None;
    }
    let (start, _) = checked.span()?;
    let live = stand_ins();
    let (first, bytes, memory) = live.iter().find(|(first, bytes, _)| start < first + bytes && start >= *first)?;
    Some(StandIn { first: *first, bytes: *bytes, memory: memory.upgrade()? })
}

/// The device-memory range of `checked` on a store attached to tuttid: `Ok(None)` for CPU
/// memory that is no stand-in (the caller refuses it as before: tuttid cannot map it).
/// `stand_in` is the stand-in holding CPU memory's first byte (`stand_in_of`, looked up before
/// the GIL was released; None for other memory).
pub fn export(checked: &CheckedLayout, stand_in: Option<StandIn>) -> Result<Option<DeviceRange>, Failure> {
    let (start, len) = checked.span().ok_or_else(|| Failure::new(ErrorClass::InvalidArgument, "a layout without tensors"))?;
    match &checked.device {
        Device::Cpu => export_stand_in(start, len, stand_in),
        Device::Cuda(ordinal) => export_cuda(*ordinal, start, len).map(Some),
        Device::Other(name) => Err(Failure::new(ErrorClass::UnsupportedMemory, format!("memory on {name} cannot be registered"))),
    }
}

fn export_stand_in(start: u64, len: u64, stand_in: Option<StandIn>) -> Result<Option<DeviceRange>, Failure> {
    let Some(StandIn { first, bytes, memory }) = stand_in else { return Ok(None) };
    if start < first || start >= first + bytes {
        return Ok(None); // not the stand-in holding this span (the caller looked up another)
    }
    if start + len > first + bytes {
        return Err(not_one_allocation("DeviceMemoryStandIn", start, len, format!("the stand-in at {first:#x} holds {bytes} bytes")));
    }
    let kv = DeviceKvMemory::memfd(&memory, start - first, len)
        .map_err(|error| Failure::new(ErrorClass::Device, format!("duplicating the stand-in's memfd: {error}")))?;
    Ok(Some(DeviceRange { memory: kv, start, holder: Holder::StandIn(memory) }))
}

#[cfg(feature = "cuda")]
fn export_cuda(ordinal: i32, start: u64, len: u64) -> Result<DeviceRange, Failure> {
    use tutti_cuda_ipc::CudaIpcError;
    let cuda = |error: CudaIpcError| {
        let class = match error {
            CudaIpcError::NoDriver | CudaIpcError::NotIpcCapable | CudaIpcError::NoSuchDevice { .. } => ErrorClass::UnsupportedMemory,
            // The tensor's device ordinal names another GPU than the one holding its memory.
            CudaIpcError::WrongDevice { .. } => ErrorClass::InvalidArgument,
            _ => ErrorClass::Device,
        };
        Failure::new(class, format!("registering CUDA memory of cuda:{ordinal}: {error}"))
    };
    let gpu = tutti_cuda_ipc::Gpu::open(ordinal).map_err(cuda)?;
    let export = match tutti_cuda_ipc::export_range(&gpu, start, len) {
        Ok(export) => export,
        Err(CudaIpcError::OutsideAllocation { offset_bytes, allocation_bytes, .. }) => {
            let allocation = format!(
                "the cudaMalloc allocation holding its first byte is {allocation_bytes} bytes and it starts {offset_bytes} bytes in"
            );
            return Err(not_one_allocation("CUDA allocation", start, len, allocation));
        }
        Err(error) => return Err(cuda(error)),
    };
    Ok(DeviceRange { memory: DeviceKvMemory::cuda(export), start, holder: Holder::Gpu(gpu) })
}

#[cfg(not(feature = "cuda"))]
fn export_cuda(ordinal: i32, _start: u64, _len: u64) -> Result<DeviceRange, Failure> {
    Err(Failure::new(
        ErrorClass::UnsupportedMemory,
        format!("memory on cuda:{ordinal}: this build of tutti has no CUDA support (the wheel builds it with the `cuda` feature)"),
    ))
}

/// The tuttid a session attached to: its socket, and the process that answered there.
#[derive(Debug, Clone)]
pub struct AttachedDaemon {
    pub socket: PathBuf,
    /// The daemon process (`Client::daemon_process`), so that another tuttid started at the same
    /// path later (while this one drains, or after it left its socket file behind) is not asked
    /// about this one's sessions: it lists none of them. `None` when it could not be told apart
    /// (another pid namespace): whatever daemon answers at the path is then taken for it. When
    /// it is `Some`, a daemon answering there that cannot be identified is not taken for it.
    pub process: Option<PeerProcess>,
}

/// Bytes of a Unix socket address's path, its terminating NUL included (`sun_path`, Linux).
const SUN_PATH_BYTES: usize = 108;

impl AttachedDaemon {
    /// The daemon attached to at `socket`, which is made absolute against the current
    /// directory now (without touching the file system), so that a directory the engine
    /// changes to before the close does not turn the daemon's socket into a file not found (a
    /// daemon gone). A path that made absolute no longer fits a socket address stays relative:
    /// with a daemon that could not be identified, nothing found or answering at it then says
    /// anything (`reach`), so such a store's device memory is kept for good at its close.
    pub fn new(socket: PathBuf, process: Option<PeerProcess>) -> AttachedDaemon {
        let socket = match std::path::absolute(&socket) {
            Ok(absolute) if absolute.as_os_str().len() < SUN_PATH_BYTES => absolute,
            _ => socket,
        };
        AttachedDaemon { socket, process }
    }
}

/// What a registration of device memory holds until tuttid can no longer reach the memory.
pub struct DeviceHold {
    pub keeps: Vec<crate::memory::Keep>,
    /// The registered tensors: recorded as kept for good (`crate::memory::record_kept_for_good`)
    /// when `keeps` are, so that no other store of this process registers that memory again
    /// through any object over it (a stand-in's numpy view is CPU memory an in-process store
    /// would map).
    pub tensors: Vec<crate::tensor::PlacedTensor>,
    pub holder: Holder,
    pub daemon: AttachedDaemon,
    pub session: u64,
}

impl DeviceHold {
    /// Lets go of the tensors once tuttid ended the session (it closes its import of the
    /// allocation then: CUDA leaves freeing memory another process still has open undefined),
    /// polling its status until `deadline`; kept for good (and logged) if it did not, or if
    /// `may_release` is false (a layer was still in flight and the session did not end
    /// cleanly). Returns the tensors kept and what keeps the released ones alive (for the
    /// caller to drop outside the store's lock).
    pub fn release(self, may_release: bool, deadline: Instant) -> (usize, Vec<Keep>) {
        let gone = may_release && session_gone(&self.daemon, self.session, deadline);
        if gone {
            drop(self.holder);
            return (0, self.keeps);
        }
        let kept = self.keeps.len();
        tracing::error!(tensors = kept, session = self.session, "tutti: registered device memory kept for good: tuttid may still reach it");
        // Listed before the keeps are forgotten: from then on no store of this process
        // registers that memory again. CUDA addresses can be listed with host ones: under
        // unified addressing (every 64-bit CUDA process) a device pointer is a range of this
        // process's virtual address space no host mapping gets, and kept memory is never freed,
        // so its range is never handed out again; a stand-in's is its memfd's mapping here.
        for tensor in &self.tensors {
            crate::memory::record_kept_for_good(tensor.address, tensor.extent_bytes);
        }
        std::mem::forget(self.keeps);
        std::mem::forget(self.holder);
        (kept, Vec::new())
    }
}

/// Whether `daemon` no longer lists `session`, asked until `deadline` (every 10 ms).
fn session_gone(daemon: &AttachedDaemon, session: u64, deadline: Instant) -> bool {
    poll_status(daemon, deadline, |status| !status.clients.iter().any(|client| client.session == session))
}

/// tuttid's count of client queue pairs it could not delete, asked before a session with a
/// layer in flight is ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeakCount {
    /// No daemon is left at the socket (its file is gone): none is left to move bytes.
    NoDaemon,
    Counted(u64),
    /// tuttid did not answer by the deadline (paused, overloaded, draining): nothing can be
    /// concluded.
    NoAnswer,
}

/// What connecting to tuttid's socket says about the daemon.
enum Reached {
    Daemon(Client),
    /// The daemon attached to has exited (its queue pairs, mappings and imports of the memory
    /// ended with its process), whatever is at its socket path now. Or, for a daemon that could
    /// not be identified, its socket file is gone: tuttid removes it only once its drain
    /// released every session (`server.rs`).
    Gone,
    /// Nothing can be concluded by the deadline: the connection is refused while the socket
    /// file exists (a draining daemon has closed its listener but is still releasing sessions,
    /// whose in-flight reads may still write the memory; or a daemon that died without removing
    /// it: the two look alike from here), or connecting failed some other way. Always, for a
    /// daemon that could not be identified at a relative socket path (resolved against a
    /// current directory that may have changed since the attach: `AttachedDaemon::new`).
    Unknown(String),
}

/// Connects to `daemon` at its socket, asking again every 10 ms while the connection is refused
/// and the socket file exists, or while another daemon (or one that cannot be identified)
/// answers there and the one attached to still runs (it may be draining, its sessions'
/// commands still in flight), until `deadline`.
fn reach(daemon: &AttachedDaemon, deadline: Instant) -> Reached {
    reach_with(daemon, deadline, Client::daemon_process)
}

/// [`reach`], the answering daemon identified by `identify` (a test's stand-in for one that
/// cannot be identified).
fn reach_with(daemon: &AttachedDaemon, deadline: Instant, identify: impl Fn(&Client) -> Option<PeerProcess>) -> Reached {
    let socket = &daemon.socket;
    if daemon.process.is_none() && socket.is_relative() {
        // Resolved against the current directory, which may have changed since the attach
        // (`AttachedDaemon::new`), and the daemon attached to could not be identified: neither
        // a socket file not found there nor a daemon answering there (another tuttid whose
        // socket has that relative name) says anything of it. The memory is kept.
        return Reached::Unknown(format!(
            "the socket path {} is relative and the daemon attached to could not be identified: the current directory may \
             have changed since the attach, and whatever is at that path now is not known to be that daemon",
            socket.display()
        ));
    }
    loop {
        let timeout = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        let error = match Client::connect(socket, timeout) {
            // A daemon that cannot be identified (another pid namespace, its /proc entry
            // unreadable) is not known to be the one attached to: as another one.
            Ok(client) => match (&daemon.process, identify(&client)) {
                (Some(ours), theirs) if theirs.as_ref() != Some(ours) => {
                    if ours.has_exited() {
                        return Reached::Gone;
                    }
                    if Instant::now() >= deadline {
                        let answering = theirs.map_or_else(
                            || "a tuttid that cannot be identified".to_string(),
                            |theirs| format!("tuttid pid {}", theirs.pid()),
                        );
                        return Reached::Unknown(format!(
                            "{answering} answers at {} while the daemon this session attached to (pid {}) still runs: \
                             its sessions may still move bytes",
                            socket.display(),
                            ours.pid()
                        ));
                    }
                    drop(client);
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                _ => return Reached::Daemon(client),
            },
            Err(error) => error,
        };
        // The daemon attached to has exited: its queue pairs, mappings and imports of the memory
        // ended with its process, whatever its socket file says (one killed leaves it behind).
        let exited = daemon.process.as_ref().is_some_and(PeerProcess::has_exited);
        match &error {
            tutti_daemon::DaemonError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                // Removed while the attached daemon still runs: not necessarily by its drain
                // (which removes it once every session is released) — another start or an
                // operator may have removed a draining daemon's file. Asked again until it exits.
                // (Not at a relative path with the daemon unidentified: refused above.)
                let Some(ours) = daemon.process.as_ref().filter(|_| !exited) else {
                    return Reached::Gone;
                };
                if Instant::now() >= deadline {
                    return Reached::Unknown(format!(
                        "{} is gone while the daemon this session attached to (pid {}) still runs: its sessions may still move bytes",
                        socket.display(),
                        ours.pid()
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            tutti_daemon::DaemonError::Io { source, .. } if source.kind() == std::io::ErrorKind::ConnectionRefused => {
                if exited {
                    return Reached::Gone;
                }
                if Instant::now() >= deadline {
                    return Reached::Unknown(format!(
                        "{error} while its socket file exists: a daemon draining its sessions, or one that died without removing it"
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            _ => return Reached::Unknown(error.to_string()),
        }
    }
}

pub fn leaked_queue_pairs(daemon: &AttachedDaemon, deadline: Instant) -> LeakCount {
    let mut client = match reach(daemon, deadline) {
        Reached::Daemon(client) => client,
        Reached::Gone => return LeakCount::NoDaemon,
        Reached::Unknown(reason) => {
            tracing::warn!(%reason, "tutti: asking tuttid for its leaked queue pairs");
            return LeakCount::NoAnswer;
        }
    };
    match status_by(&mut client, deadline) {
        Ok(status) => LeakCount::Counted(status.leaked_queue_pairs),
        Err(error) => {
            tracing::warn!(%error, "tutti: asking tuttid for its leaked queue pairs");
            LeakCount::NoAnswer
        }
    }
}

/// Asks tuttid's status on `client` within what is left of `deadline` (at least 100 ms, as
/// [`reach_with`] connects): a client keeps the timeout it connected with for every later call,
/// so a request sent just before the deadline on a connection made at the start (a status poll
/// reuses one), or on one whose connect took most of the time left, would wait that whole
/// timeout again: close, its store's lock held, ran up to about twice the bound it states.
fn status_by(client: &mut Client, deadline: Instant) -> Result<tutti_daemon::protocol::StatusReply, tutti_daemon::DaemonError> {
    client.set_timeout(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100)));
    client.status()
}

/// Whether tuttid ended `session` and deleted its queue pairs: the session is no longer listed
/// and no queue pair was leaked since tuttid counted `leaked_before` (another session's leak in
/// between also answers false: then the memory is kept, the safe side; so does a daemon gone
/// before its count could be compared).
pub fn session_ended_cleanly(daemon: &AttachedDaemon, session: u64, leaked_before: u64, deadline: Instant) -> bool {
    let mut clean = false;
    let gone = poll_status(daemon, deadline, |status| {
        clean = status.leaked_queue_pairs == leaked_before;
        !status.clients.iter().any(|client| client.session == session)
    });
    gone && clean
}

/// Asks tuttid's status until `done` accepts one or `deadline` passes (every 10 ms); false if
/// nothing could be concluded by then. A daemon whose socket file is gone counts as done (it
/// removes the file only after releasing every session, and never while one is kept for good);
/// a refused connection while the file
/// exists does not (see [`Reached::Unknown`]), nor does a connection that breaks: the daemon is
/// asked again on a new one until the deadline.
fn poll_status(daemon: &AttachedDaemon, deadline: Instant, mut done: impl FnMut(&tutti_daemon::protocol::StatusReply) -> bool) -> bool {
    loop {
        match reach(daemon, deadline) {
            Reached::Gone => return true,
            Reached::Unknown(reason) => {
                tracing::warn!(%reason, "tutti: asking tuttid whether the session ended");
                return false;
            }
            Reached::Daemon(mut client) => loop {
                match status_by(&mut client, deadline) {
                    Ok(status) if done(&status) => return true,
                    Ok(_) => {}
                    Err(error) => {
                        tracing::warn!(%error, "tutti: asking tuttid whether the session ended");
                        break;
                    }
                }
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(10));
            },
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The tensors' addresses as offsets from the range's start (what the daemon client moves to
/// the IOVA the daemon gives the range).
pub fn offsets(checked: &CheckedLayout, start: u64) -> Vec<Iova> {
    checked.tensors.iter().map(|tensor| Iova(tensor.address - start)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{LayoutKind, PlacedTensor};

    fn layout(device: Device, tensors: &[(u64, u64)]) -> CheckedLayout {
        CheckedLayout {
            kind: LayoutKind::Paged,
            num_blocks: 4,
            block_stride_bytes: 256,
            tensors: tensors.iter().map(|&(address, extent_bytes)| PlacedTensor { address, extent_bytes }).collect(),
            device,
        }
    }

    #[test]
    fn a_layout_inside_a_stand_in_exports_its_span_and_one_across_its_end_is_refused() {
        // Goal: the stand-in is found by address as the CUDA driver finds an allocation; the
        // range is the layout's span, its offset in the memfd is the span's start; a layout
        // that runs past the stand-in's end is an UnsupportedMemory naming the fix; CPU memory
        // that is no stand-in is left to the caller (None).
        pyo3::Python::initialize();
        let stand_in = DeviceMemoryStandIn::new(64 << 10).unwrap();
        let base = stand_in.address();
        let export = |checked: &CheckedLayout| pyo3::Python::attach(|py| export(checked, stand_in_of(py, checked)));
        let range = export(&layout(Device::Cpu, &[(base + 0x2000, 0x1000), (base + 0x1000, 0x1000)])).unwrap().unwrap();
        assert_eq!((range.start, range.memory.offset_bytes, range.memory.length_bytes), (base + 0x1000, 0x1000, 0x2000));
        assert_eq!(offsets(&layout(Device::Cpu, &[(base + 0x2000, 1), (base + 0x1000, 1)]), base + 0x1000), [Iova(0x1000), Iova(0)]);
        let across = export(&layout(Device::Cpu, &[(base + 0xf000, 0x2000)])).err().unwrap();
        assert_eq!(across.class, ErrorClass::UnsupportedMemory);
        assert!(across.message.contains("not inside one DeviceMemoryStandIn"), "{}", across.message);
        let elsewhere = vec![0u8; 8192];
        assert!(export(&layout(Device::Cpu, &[(elsewhere.as_ptr() as u64, 4096)])).unwrap().is_none());
        drop((stand_in, range));
        assert!(export(&layout(Device::Cpu, &[(base + 0x1000, 0x1000)])).unwrap().is_none(), "a dropped stand-in is forgotten");
    }

    #[test]
    fn registering_a_stand_in_never_waits_for_the_stand_ins_lock_with_the_gil_released() {
        // Goal: the list of live stand-ins is looked up only with the GIL held (`stand_in_of`,
        // before `register_kv` releases it), so that no thread holds its lock across a fork
        // (os.fork needs the GIL): a child would otherwise wait for ever in
        // `DeviceMemoryStandIn(n)`. Here this thread holds that lock while another registers a
        // layout over a stand-in with a store attached to tuttid (its connection detached:
        // the registration fails as Disconnected): it answers within 2 s. Before, the
        // registration looked the stand-in up, and dup'ed its memfd, under that lock with the
        // GIL released: it waited until the lock was let go.
        pyo3::Python::initialize();
        let stand_in = DeviceMemoryStandIn::new(64 << 10).unwrap();
        let checked = layout(Device::Cpu, &[(stand_in.address(), 0x1000)]);
        let client = Client::detached("the store's own connection").unwrap();
        let mut state = crate::backend::test_store::attached_state(client, Duration::from_secs(2));
        let found = pyo3::Python::attach(|py| stand_in_of(py, &checked)); // as register_kv, with the GIL held
        assert!(found.is_some(), "the layout is over the stand-in");
        let held = stand_ins();
        let (answer, answered) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let registered = state.register(checked, Vec::new(), found, Duration::from_secs(2));
            let _ = answer.send(registered.err().map(|failure| failure.class));
        });
        let refused = answered.recv_timeout(Duration::from_secs(2));
        drop(held);
        assert_eq!(refused.expect("register waited for the stand-ins' lock"), Some(ErrorClass::Disconnected));
        drop(stand_in);
    }

    #[test]
    fn a_relative_socket_path_not_found_is_no_proof_the_daemon_is_gone() {
        // Goal: a session attached through a relative socket path whose daemon cannot be
        // identified (another pid namespace): the path is resolved against the current
        // directory, which the engine may have changed since the attach, so a file not found
        // there says nothing of the daemon: nothing is concluded (NoAnswer), and the memory it
        // may still write is not handed back. The attach records the path made absolute when
        // it fits a socket address, so this applies only to one too long for that. Before, the
        // relative path's NotFound read as "no daemon left" (NoDaemon), a session ended cleanly.
        let relative = PathBuf::from(format!("tutti-python-relative-socket-test-{}/tuttid.sock", std::process::id()));
        let daemon = AttachedDaemon { socket: relative.clone(), process: None };
        let counted = leaked_queue_pairs(&daemon, Instant::now() + Duration::from_millis(100));
        assert!(matches!(counted, LeakCount::NoAnswer), "{counted:?}");
        let attached = AttachedDaemon::new(relative.clone(), None);
        assert!(attached.socket.is_absolute(), "{}", attached.socket.display());
        assert!(attached.socket.ends_with(&relative), "{}", attached.socket.display());
        let long = PathBuf::from("d".repeat(120));
        assert_eq!(AttachedDaemon::new(long.clone(), None).socket, long, "too long for a socket address made absolute: kept");
    }

    #[test]
    fn a_refused_connection_while_the_socket_file_exists_is_no_proof_the_daemon_is_gone() {
        // Goal: a draining tuttid has closed its listener but still releases its sessions (their
        // in-flight reads may still write the memory) and removes its socket file only after:
        // a refused connection with the file present must not read as "no daemon"; once the
        // file is gone (removed while we wait, or absent), it does.
        let directory = std::env::temp_dir().join(format!("tutti-python-socket-test-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let socket = directory.join("tuttid.sock");
        let _ = std::fs::remove_file(&socket);
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        let daemon = AttachedDaemon { socket: socket.clone(), process: None };
        assert!(socket.exists(), "a dropped listener leaves its file, as a draining tuttid's");
        let soon = || Instant::now() + Duration::from_millis(150);
        assert_eq!(leaked_queue_pairs(&daemon, soon()), LeakCount::NoAnswer);
        assert!(!session_gone(&daemon, 7, soon()));
        let started = Instant::now();
        let removed = {
            let socket = socket.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                std::fs::remove_file(socket).unwrap();
            })
        };
        assert!(session_gone(&daemon, 7, Instant::now() + Duration::from_secs(10)), "the file went while we waited");
        assert!(started.elapsed() >= Duration::from_millis(200) && started.elapsed() < Duration::from_secs(5));
        removed.join().unwrap();
        assert_eq!(leaked_queue_pairs(&daemon, soon()), LeakCount::NoDaemon);
        assert!(session_gone(&daemon, 7, soon()));
        // Something at the path that is no socket: nothing can be concluded either.
        std::fs::write(&socket, b"not a socket").unwrap();
        assert_eq!(leaked_queue_pairs(&daemon, soon()), LeakCount::NoAnswer);
        assert!(!session_gone(&daemon, 7, soon()));
        std::fs::remove_dir_all(&directory).unwrap();
    }

    #[test]
    fn another_daemon_at_the_socket_speaks_for_the_attached_one_only_once_it_has_exited() {
        // Goal: a session's daemon is the process that answered at attach. Another tuttid serving
        // the same path later (started while the attached one drains, or after its socket file
        // was removed) lists none of the first one's sessions; while the attached daemon still
        // runs, that must not read as "the session ended" (its in-flight reads may still write
        // the memory), nor its leak count stand for the attached one's. Once the attached daemon
        // has exited, its queue pairs and mappings went with it. A daemon that could not be
        // identified is taken to be whichever answers, as before.
        use objstore::{FormatParams, ModelGeometry};
        use tutti_daemon::pool_open::{open_pool, PoolOptions};
        use tutti_devices::{DeviceKind, DeviceSpec};
        let directory = std::env::temp_dir().join(format!("tutti-python-other-daemon-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).unwrap();
        let socket = directory.join("tuttid.sock");
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let opened = open_pool(&PoolOptions {
            specs: vec![DeviceSpec::parse("emu:mem:64m", &DeviceKind::ALL).unwrap()],
            namespace: 1,
            emu_lba_bytes: 4096,
            emu_create_bytes: None,
            format: Some(FormatParams::new(geometry)),
            overwrite: false,
            lock_dir: directory.join("locks"),
            client_queue_pairs: 2,
            emu_doorbell_relay: false,
        })
        .unwrap();
        let server = tutti_daemon::Server::bind(tutti_daemon::ServerConfig::new(socket.clone()), opened).unwrap();
        let stop = server.stop_handle();
        let serving = std::thread::spawn(move || server.serve().map(|_| ()).map_err(|error| error.to_string()));
        let soon = || Instant::now() + Duration::from_millis(300);
        // The daemon in this process is the one that answers.
        let answering = Client::connect(&socket, Duration::from_secs(5)).unwrap().daemon_process().expect("this process");
        assert_eq!(answering.pid(), std::process::id());
        let ours = AttachedDaemon { socket: socket.clone(), process: Some(answering) };
        assert!(session_gone(&ours, 7, soon()), "the attached daemon lists no session 7");
        assert_eq!(leaked_queue_pairs(&ours, soon()), LeakCount::Counted(0));
        // Attached to another process, which still runs.
        let mut attached = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let other = AttachedDaemon { socket: socket.clone(), process: PeerProcess::of(attached.id()) };
        assert!(other.process.is_some());
        let started = Instant::now();
        assert!(!session_gone(&other, 7, soon()), "another daemon's status spoke for the one attached to");
        assert!(started.elapsed() >= Duration::from_millis(300), "asked until the deadline");
        assert_eq!(leaked_queue_pairs(&other, soon()), LeakCount::NoAnswer);
        assert!(!session_ended_cleanly(&other, 7, 0, soon()));
        attached.kill().unwrap();
        attached.wait().unwrap();
        assert!(session_gone(&other, 7, soon()), "the attached daemon has exited");
        assert_eq!(leaked_queue_pairs(&other, soon()), LeakCount::NoDaemon);
        // Not identified: whichever daemon answers is asked.
        let unknown = AttachedDaemon { socket: socket.clone(), process: None };
        assert!(session_gone(&unknown, 7, soon()));
        // Not identified, through a relative path (one kept relative: too long made absolute):
        // resolved against a current directory that may have changed since the attach, the
        // daemon answering there is not known to be the one attached to: nothing concluded.
        let up = std::env::current_dir().unwrap().components().count() - 1;
        let relative = std::iter::repeat_n(std::path::Path::new(".."), up).collect::<PathBuf>().join(socket.strip_prefix("/").unwrap());
        assert!(relative.is_relative() && relative.exists(), "{}", relative.display());
        let unknown_relative = AttachedDaemon { socket: relative, process: None };
        assert!(!session_gone(&unknown_relative, 7, soon()), "a daemon at a relative path spoke for the one attached to");
        assert_eq!(leaked_queue_pairs(&unknown_relative, soon()), LeakCount::NoAnswer);
        stop.stop();
        serving.join().unwrap().unwrap();
        // The socket file gone (here the daemon in this process drained and removed it; the case
        // that matters: another start removed a draining daemon's file) while the attached
        // daemon still runs: nothing concluded until it exits. Unidentified: gone, as before.
        assert!(!socket.exists());
        let mut attached = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let running = AttachedDaemon { socket: socket.clone(), process: PeerProcess::of(attached.id()) };
        assert!(!session_gone(&running, 7, soon()), "a removed socket file spoke for a daemon still running");
        assert_eq!(leaked_queue_pairs(&running, soon()), LeakCount::NoAnswer);
        assert_eq!(leaked_queue_pairs(&unknown, soon()), LeakCount::NoDaemon);
        // A socket file left behind (refusing) by a daemon that has exited: gone.
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        assert!(!session_gone(&running, 7, soon()), "refused while the attached daemon runs");
        attached.kill().unwrap();
        attached.wait().unwrap();
        assert!(session_gone(&running, 7, soon()), "the attached daemon exited, its socket file left behind");
        assert!(!session_gone(&unknown, 7, soon()), "unidentified: a refusing file concludes nothing, as before");
        std::fs::remove_dir_all(&directory).unwrap();
    }

    /// A stand-in tuttid listening on `listener`: it answers every Status request with a status
    /// listing session `session` until `answering_for` has passed since it started, then reads
    /// requests without answering, every connection kept open (a daemon that stalls: paused,
    /// overloaded). Stops accepting once `stop` is set and one more connection comes.
    fn stalling_daemon(
        listener: std::os::unix::net::UnixListener,
        session: u64,
        answering_for: Duration,
        stop: Arc<std::sync::atomic::AtomicBool>,
    ) -> std::thread::JoinHandle<()> {
        use std::io::{Read, Write};
        use tutti_daemon::protocol::{encode_frame, ClientStatus, FrameHeader, PoolShape, Reply, StatusReply, HEADER_BYTES};
        let status = StatusReply {
            daemon_pid: std::process::id(),
            uptime_ms: 0,
            shape: PoolShape { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16, blocks_per_slot: 1 },
            devices: Vec::new(),
            metadata_fenced: Vec::new(),
            pool: Default::default(),
            connections: 1,
            clients: vec![ClientStatus {
                session,
                pid: std::process::id(),
                uid: 0,
                name: "worker".into(),
                tp_rank: 0,
                tp_world: 1,
                requests: 0,
                idle_ms: 0,
                registrations: 1,
                queue_pairs: 1,
                requests_in_flight: 1,
                doorbells_relayed: 0,
                doorbells_dropped: 0,
                awaiting_exit: false,
                kept: false,
                retiring: false,
            }],
            leaked_queue_pairs: 0,
            leaked_windows: 0,
            leaked_window_bytes: 0,
            leaked_requests: 0,
            relay: Default::default(),
        };
        let started = Instant::now();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                if stop.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                let status = status.clone();
                std::thread::spawn(move || loop {
                    // Until the client closes the connection.
                    let mut header = [0u8; HEADER_BYTES];
                    if stream.read_exact(&mut header).is_err() {
                        return;
                    }
                    let Ok(header) = FrameHeader::decode(&header) else { return };
                    let mut body = vec![0; header.body_bytes as usize];
                    if stream.read_exact(&mut body).is_err() {
                        return;
                    }
                    if started.elapsed() >= answering_for {
                        continue;
                    }
                    let reply = Reply::Status(status.clone());
                    let mut frame = Vec::new();
                    encode_frame(&mut frame, reply.kind(), header.request_id, |out| reply.encode_body(out)).unwrap();
                    if stream.write_all(&frame).is_err() {
                        return;
                    }
                });
            }
        })
    }

    #[test]
    fn a_status_request_near_the_deadline_waits_only_what_is_left_of_it() {
        // Goal: a client keeps the timeout it connected with for every later request, so the
        // status polls, which reuse one connection, set it to what is left of their deadline
        // before each request: a tuttid that answers (the session still listed) and then
        // stalls made the request sent just before the deadline wait its whole timeout again,
        // and a close, its store's lock held, ran up to about twice the bound it states.
        let directory = std::env::temp_dir().join(format!("tutti-python-stalling-daemon-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).unwrap();
        let socket = directory.join("tuttid.sock");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let serving = stalling_daemon(listener, 7, Duration::from_millis(1900), stop.clone());
        let daemon = AttachedDaemon { socket: socket.clone(), process: None };
        let started = Instant::now();
        assert!(!session_ended_cleanly(&daemon, 7, 0, started + Duration::from_secs(2)), "session 7 is still listed");
        let took = started.elapsed();
        // Before: the request sent at about 1.9 s waited the 2 s the client connected with (about
        // 3.9 s in all); the margin is wide for a loaded machine.
        assert!(took < Duration::from_secs(3), "a 2 s poll took {took:?}");
        stop.store(true, std::sync::atomic::Ordering::Release);
        drop(std::os::unix::net::UnixStream::connect(&socket));
        serving.join().unwrap();
        std::fs::remove_dir_all(&directory).unwrap();
    }

    #[test]
    fn cuda_memory_without_a_driver_or_support_is_a_typed_refusal() {
        // Goal: on a machine without libcuda (or a build without the feature) a CUDA layout is
        // an UnsupportedMemory that says why, never a panic.
        let failure = export(&layout(Device::Cuda(0), &[(0x7f00_0000_0000, 4096)]), None).err().unwrap();
        assert_eq!(failure.class, ErrorClass::UnsupportedMemory);
        #[cfg(feature = "cuda")]
        if !tutti_cuda_ipc::driver_available() {
            assert!(failure.message.contains("no CUDA driver could be loaded"), "{}", failure.message);
        }
        #[cfg(not(feature = "cuda"))]
        assert!(failure.message.contains("no CUDA support"), "{}", failure.message);
    }

    #[test]
    fn an_unidentified_daemon_at_the_socket_does_not_speak_for_the_attached_one_while_it_runs() {
        // Goal: a daemon at the socket that cannot be identified (another pid namespace, its
        // /proc entry unreadable) may be another one than the daemon this session attached to;
        // while the attached one still runs (it may be draining, its sessions' reads still
        // writing the memory) nothing is concluded by the deadline (Unknown), and once it has
        // exited its queue pairs went with it (Gone). Before, whichever daemon answered was
        // taken for the attached one, and its status (none of our sessions) released the memory.
        let directory = std::env::temp_dir().join(format!("tutti-python-unidentified-daemon-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).unwrap();
        let socket = directory.join("tuttid.sock");
        // Connections queue in its backlog: enough for a connect to succeed.
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let mut attached = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let daemon = AttachedDaemon { socket: socket.clone(), process: PeerProcess::of(attached.id()) };
        assert!(daemon.process.is_some());
        let unidentified = |_: &Client| None;
        let started = Instant::now();
        let reached = reach_with(&daemon, started + Duration::from_millis(300), unidentified);
        let took = started.elapsed();
        attached.kill().unwrap();
        attached.wait().unwrap();
        match reached {
            Reached::Unknown(reason) => assert!(reason.contains(&attached.id().to_string()), "{reason}"),
            Reached::Daemon(_) => panic!("an unidentified daemon was taken for the attached one, still running"),
            Reached::Gone => panic!("the attached daemon was taken for gone while it ran"),
        }
        assert!(took >= Duration::from_millis(300), "asked until the deadline, not {took:?}");
        assert!(took < Duration::from_secs(3), "the wait was not bounded by its deadline: {took:?}");
        let reached = reach_with(&daemon, Instant::now() + Duration::from_millis(300), unidentified);
        std::fs::remove_dir_all(&directory).unwrap();
        assert!(matches!(reached, Reached::Gone), "the attached daemon has exited");
    }

    #[test]
    fn device_memory_kept_for_good_is_refused_to_every_later_registration() {
        // Goal: a release that keeps the tensors for good (a layer in flight at close, or a
        // failed registration tuttid did not confirm ending) lists their memory as kept for
        // good, as a close that leaks caller memory does: an in-process store then refuses a
        // numpy view of a stand-in tuttid may still write. Before, the keeps were forgotten
        // unlisted and such a view was accepted.
        let memory = SharedMemory::create("tutti-test-kept", 4096).unwrap();
        let bytes = vec![0u8; 8192];
        let address = bytes.as_ptr() as u64;
        std::mem::forget(bytes); // never reused while listed
        let hold = DeviceHold {
            keeps: vec![Keep::Objects(Vec::new())],
            tensors: vec![crate::tensor::PlacedTensor { address: address + 4096, extent_bytes: 4096 }],
            holder: Holder::StandIn(memory),
            daemon: AttachedDaemon { socket: PathBuf::from("/nonexistent/tuttid.sock"), process: None },
            session: 7,
        };
        assert!(!crate::memory::kept_for_good_overlap(address, 8192), "not listed before");
        let (kept, released) = hold.release(false, Instant::now());
        assert_eq!((kept, released.len()), (1, 0));
        assert!(crate::memory::kept_for_good_overlap(address + 4096, 4096), "the tensor's memory is listed");
        assert!(!crate::memory::kept_for_good_overlap(address, 4096), "only the tensor's memory");
    }
}
