//! The one error type of gio-uring.

use crate::abi::NvmeStatus;
use crate::types::{DeviceIndex, IocbId, IovaRange, LayerIndex};

/// Why an IOCTX was refused when its IOCB was filled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IoctxFault {
    #[error("{device} does not exist (the device table has {device_count})")]
    UnknownDevice { device: DeviceIndex, device_count: usize },
    #[error("zero length")]
    ZeroLength,
    #[error("{block_count} blocks exceed the NVMe limit of 65536 per command")]
    TooManyBlocks { block_count: u32 },
    #[error("namespace {nsid} is not the namespace {expected_nsid} of the device")]
    WrongNamespace { nsid: u32, expected_nsid: u32 },
    #[error("{data_bytes} data bytes do not equal {block_count} blocks of {block_bytes} bytes")]
    LengthMismatch { data_bytes: u32, block_count: u32, block_bytes: u32 },
    #[error("blocks {first_lba}..+{block_count} at layer {layer} exceed capacity {capacity_blocks}")]
    LbaOutOfRange { first_lba: u64, block_count: u32, layer: u32, capacity_blocks: u64 },
    #[error("{what} {range} at layer {layer} is outside registered memory")]
    OutsideRegisteredMemory { what: &'static str, range: IovaRange, layer: u32 },
    #[error("the device does not support SGL data pointers")]
    SglUnsupported,
    #[error("SGL segment of {desc_bytes} bytes is not a non-zero multiple of 16")]
    BadSglSegment { desc_bytes: u32 },
    #[error("address arithmetic overflows at layer {layer}")]
    AddressOverflow { layer: u32 },
    /// Staged DMA mode copies `data_iova..+data_bytes`, so the SSD must move exactly that range:
    /// an SGL segment may scatter the data, a PRP list may name any pages (the executor does not
    /// read lists), and a PRP2 other than the page after the data's first page at every layer
    /// (layer 0, and a descriptor stride equal to `mem_stride_bytes`) moves other bytes.
    #[error(
        "staged DMA mode needs contiguous data: no SGL segment, no PRP list, and PRP2 the page after the data's first page at \
         every layer"
    )]
    StagedScatteredData,
    #[error("data {range} is not inside one staging buffer at the first and last layer")]
    OutsideStaging { range: IovaRange },
    /// `desc_iova` 0 means "no descriptor" in the record (kernels/gio_abi.h): an SGL segment
    /// or PRP2 there would be built as an inline data block, or as no PRP2.
    #[error("{what} at IOVA 0, which the record reads as \"no descriptor\"")]
    DescriptorAtZero { what: &'static str },
    /// PRP2 must name what the controller reads or writes through it: nothing for data inside
    /// one memory page, the rest of the data (page aligned) for two pages, a PRP list of 8
    /// bytes per page after the first (8-byte aligned) for more, at every layer.
    #[error(
        "PRP2 does not fit the transfer: {reason} (the data spans {pages_min}..={pages_max} memory pages over the layers; PRP2 \
         {prp2:?})"
    )]
    PrpMismatch { reason: &'static str, pages_min: u64, pages_max: u64, prp2: Option<IovaRange> },
    /// More data than the device moves in one command (its MDTS, given with
    /// `DeviceTable::with_max_transfer_bytes`): the controller would refuse it (Invalid Field)
    /// at every issue.
    #[error("{data_bytes} data bytes exceed the device's largest transfer of {max_transfer_bytes} bytes (MDTS)")]
    TransferTooLarge { data_bytes: u32, max_transfer_bytes: u64 },
    /// The data address (PRP1, or an SGL data block) is not dword aligned at some layer: the
    /// controller would refuse it (PRP Offset Invalid) at that layer's issue.
    #[error("data address {data_iova:#x} at layer {layer} is not a multiple of 4")]
    UnalignedData { data_iova: u64, layer: u32 },
    /// Force Unit Access asked of a Read. The executors disagree on it (the CPU executor builds
    /// a Read without FUA, the GPU kernel copies the flag into any command), so one request
    /// would behave differently on each: FUA is taken for writes only.
    #[error("force_unit_access is for writes; this IOCB reads")]
    ForceUnitAccessOnRead,
    /// A record in shared memory names a descriptor kind the ABI does not define
    /// (`gio_descriptor_kind_is_valid` in kernels/gio_abi.h).
    #[error("descriptor kind {kind} is not one the ABI defines")]
    UnknownDescriptorKind { kind: u8 },
}

/// Errors of gio-uring. Every variant says which queue object it concerns.
#[derive(Debug, thiserror::Error)]
pub enum GioError {
    #[error("invalid queue configuration: {reason}")]
    InvalidConfig { reason: String },
    #[error("cannot allocate {len_bytes} bytes of shared ring memory")]
    OutOfMemory { len_bytes: usize },
    #[error("{id} does not exist (queue depth {depth})")]
    UnknownIocb { id: IocbId, depth: u32 },
    #[error("only {available} free IOCBs, {requested} requested")]
    NoFreeIocb { requested: usize, available: usize },
    #[error("{id} is {state}, which does not allow {operation}")]
    WrongState { id: IocbId, state: &'static str, operation: &'static str },
    #[error("{id}: IOCTX count {count} outside 1..={max}")]
    BadIoctxCount { id: IocbId, count: usize, max: u32 },
    #[error("{id}: layer count must be at least 1")]
    ZeroLayerCount { id: IocbId },
    #[error("{id}, IOCTX {index}: {fault}")]
    InvalidIoctx { id: IocbId, index: u32, fault: IoctxFault },
    #[error("{id}: layer {} is outside the {layer_count} layers it was filled for", layer.0)]
    LayerOutOfRange { id: IocbId, layer: LayerIndex, layer_count: u32 },
    #[error("{id} appears twice in one issue")]
    DuplicateIssue { id: IocbId },
    #[error("issue of {count} IOCBs: the ids must number 1..={depth}")]
    BadIssueSize { count: usize, depth: u32 },
    #[error("{id} waits on {found:?} but the other IOCBs of this issue wait on {expected:?}")]
    MixedDependencies { id: IocbId, expected: crate::types::Dependency, found: crate::types::Dependency },
    #[error("SM budget must be at least 1")]
    ZeroSmBudget,
    /// Back-pressure, not a failure: nothing was issued; reap completions and retry.
    #[error("submission queue full: {free} free slots, {needed} needed (back-pressure, retry)")]
    SubmissionQueueFull { free: u32, needed: u32 },
    #[error("{ring} ring corrupt: head {head}, tail {tail}, depth {depth}")]
    RingCorrupt { ring: &'static str, head: u32, tail: u32, depth: u32 },
    /// Line 0 of an issued IOCB, read back from shared memory by an executor, is not what the
    /// queue wrote there (or, for the CPU executors, not what `fill_iocb` validated): another
    /// agent overwrote it. The IOCB is not run.
    #[error("{id}: line 0 read back from shared memory is corrupt: {field} = {value} ({expected})")]
    CorruptIocb { id: IocbId, field: &'static str, value: u64, expected: &'static str },
    /// A CQE the queue does not trust. One that matches nothing in flight is dropped; one that
    /// names the issue in flight with impossible fields (a status no executor may post, a
    /// failed IOCTX outside the IOCB) ends that issue as timed out, so it is not left in flight.
    #[error("completion for {id} (issue {issue_seq}) refused: {reason}")]
    UnexpectedCompletion { id: IocbId, issue_seq: u32, reason: &'static str },
    #[error("completion queue full: the executor cannot post a completion for {id}")]
    CompletionQueueFull { id: IocbId },
    #[error("timed out after {waited_ms} ms waiting for {id}")]
    WaitTimeout { id: IocbId, waited_ms: u128 },
    #[error("executor {executor}: {reason}")]
    Executor { executor: &'static str, reason: String },
    /// A worker thread of [`crate::cpu_workers::CpuWorkers`] has ended (it panicked: see the
    /// log) while the executor was in use. Reported once per worker, by `poll`. The IOCTXs dealt
    /// to it never complete, so their IOCBs stay in flight for good: each wait for one times
    /// out, and nothing ends them, since `QueuePairReset::reset` fails naming the worker (so the
    /// object store's `abandon_in_flight` fails too, and `finish` refuses their requests), and
    /// teardown (`retire_queue_pairs`) answers `Some(false)`, so the memory they name is kept
    /// for good, even after the executor is dropped. An issue that needs the worker ends at once
    /// as TIMEOUT; the others run. Nothing rebuilds the executor: only dropping it (with its
    /// queue) and building another gives a usable one.
    #[error("executor cpu-workers: worker {worker} has stopped: its IOCTXs never complete and no reset can replace its queue pairs")]
    WorkerStopped { worker: usize },
    /// `issue_io` published the issue and the executor then failed: the IOCBs are in flight, not
    /// back to where they were. Each still completes exactly once (at once, once launches ahead
    /// of it retire, or after a reset of the CPU executor's queue pairs), so wait for (or reap)
    /// every one before `put_iocb`, and keep what they name until then.
    #[error("the executor failed on an issue of {count} IOCBs already published: they stay in flight until each completes: {source}")]
    SubmitFailed { count: u32, source: Box<GioError> },
    /// Teardown ([`crate::Executor::retire_queue_pairs`]) deleted the executor's NVMe queue
    /// pairs: it runs no more I/O. An issue after it ends each of its IOCBs at once as timed
    /// out (one CQE each) and reports this through `SubmitFailed`.
    #[error("executor {executor}: its queue pairs were retired (teardown); it runs no more I/O")]
    QueuePairsRetired { executor: &'static str },
    /// No usable CUDA driver: libcuda is absent, or cuInit found no device. GPU tests skip on it.
    #[error("no CUDA driver: {reason}")]
    NoCudaDriver { reason: String },
    #[error("CUDA driver call {call} failed: {result}")]
    Cuda { call: &'static str, result: String },
    #[error("cannot read kernel image {path}: {source}")]
    KernelImage { path: std::path::PathBuf, source: std::io::Error },
    /// No kernel image of this ABI version in the kernel directory (image names carry it).
    #[error(
        "no I/O kernel image of ABI version {abi_version} in {dir}: looked for {looked_for}{}; tools/cuda-build.sh builds them",
        other_kernel_versions(.other_versions)
    )]
    KernelImageMissing { dir: std::path::PathBuf, abi_version: u32, looked_for: String, other_versions: Vec<String> },
    /// The loaded kernel image carries another ABI version than these crates (or none).
    #[error(
        "kernel image {path} {}, not {expected}: it reads the shared records differently; rebuild it with tools/cuda-build.sh",
        kernel_abi_found(.found)
    )]
    KernelAbiMismatch { path: std::path::PathBuf, expected: u32, found: Option<u32> },
    #[error("{token:?} is not an event this executor created")]
    UnknownEvent { token: crate::types::EventToken },
    #[error("NVMe driver: {context}: {source}")]
    Nvme { context: String, source: nvme_driver::NvmeError },
    /// The CUDA executor's reset could not delete a detached queue pair: the controller may still
    /// use its rings, so they are kept (never reused or freed) and no work runs until a later
    /// reset deletes the pair (or the controller was reset).
    #[error(
        "gio device {device}: deleting detached NVMe {queue} failed: {source}; its rings are kept, never reused or freed, and the next          reset retries the deletion"
    )]
    UndeletedQueuePair { device: usize, queue: nvme_driver::QueueId, source: nvme_driver::NvmeError },
    /// A feature that needs a component that does not exist yet; never reported as success.
    #[error("unsupported: {what}")]
    Unsupported { what: &'static str },
}

/// How an issued IOCB ended, when it did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IocbFailure {
    #[error("IOCTX {ioctx_index} failed with NVMe status {status}")]
    Nvme { ioctx_index: u32, status: NvmeStatus },
    #[error("the executor refused IOCTX {ioctx_index}")]
    InvalidIoctx { ioctx_index: u32 },
    /// The IOCB was ended as timed out: a wait of the GPU executor's kernel ran out, or a reset
    /// or teardown ended it. `ioctx_index` is the IOCB's `failed_ioctx`, as both executors record
    /// it: the first IOCTX that failed (for any reason, the expired wait's included) before the
    /// IOCB ended, not necessarily an unfinished one; `None` when none had failed.
    #[error("the executor timed out (first failed IOCTX {ioctx_index:?})")]
    Timeout { ioctx_index: Option<u32> },
    /// A controller posted a completion that breaks the queue protocol, by the rule of
    /// nvme-driver's reap that the GPU executor's kernel applies (`gio_completion_verdict` in
    /// kernels/gio_kernel_rules.h): one naming another submission queue, one whose SQ head lies
    /// outside the commands in flight, or one completing a command not yet published or not yet
    /// fetched. The executor resets its queue pairs. `ioctx_index`: the first failed IOCTX, if any.
    #[error(
        "a controller posted a completion that breaks the queue protocol (another submission queue, an SQ head outside the \
         commands in flight, or a command not yet published or fetched; first failed IOCTX {ioctx_index:?})"
    )]
    ControllerFault { ioctx_index: Option<u32> },
}

/// The tail of [`GioError::KernelImageMissing`]'s message: the images of other ABI versions found.
fn other_kernel_versions(names: &[String]) -> String {
    if names.is_empty() {
        String::new()
    } else {
        format!("; found only {}, built for another ABI version (an old kernel directory)", names.join(", "))
    }
}

/// What [`GioError::KernelAbiMismatch`]'s image says of its ABI version.
fn kernel_abi_found(found: &Option<u32>) -> String {
    match found {
        Some(version) => format!("was built for ABI version {version}"),
        None => "has no gio_abi_version (built before ABI version 3)".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iocb_failures_say_which_ioctx_they_name_and_every_fault_the_kernel_reports() {
        // Goal: the messages say what the executors record. A timed-out IOCB names the first
        // IOCTX recorded as failed (failed_ioctx), not an unfinished one; a controller fault is
        // any completion that breaks the queue protocol (another SQ, an SQ head outside the
        // commands in flight, a command not yet published or fetched), not only another SQ.
        let timeout = IocbFailure::Timeout { ioctx_index: Some(3) }.to_string();
        assert!(timeout.contains("first failed IOCTX Some(3)") && !timeout.contains("unfinished"), "{timeout}");
        let fault = IocbFailure::ControllerFault { ioctx_index: None }.to_string();
        assert!(fault.contains("another submission queue") && fault.contains("SQ head") && fault.contains("not yet"), "{fault}");
    }
}
