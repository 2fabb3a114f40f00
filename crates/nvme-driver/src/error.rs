//! The driver's error type: every failure names the queue, command and status it concerns.

use crate::hw::HwError;
use crate::namespace::RefusedNamespace;
use crate::spec::identify::IdentifyError;
use crate::spec::NvmeStatus;
use crate::types::{CommandId, Iova, NamespaceId, QueueId};

/// Errors from the NVMe driver.
#[derive(Debug, thiserror::Error)]
pub enum NvmeError {
    #[error(transparent)]
    Hardware(#[from] HwError),

    #[error("the controller stopped responding: register reads return all ones (device removed or link down)")]
    DeviceGone,

    #[error("controller fatal status (CSTS.CFS=1) {context}; reset the controller")]
    ControllerFatal { context: &'static str },

    /// A wait for CSTS ran out of its bound; `bound` names the field that set it: CAP.TO (a
    /// disable, or an enable), CRTO.CRWMT (an enable, when larger than CAP.TO), or the shutdown
    /// bound (RTD3E, at least CAP.TO and 1 s) for CSTS.SHST.
    #[error("controller did not reach {wanted} within {timeout_ms} ms ({bound}); CSTS={csts:#x}")]
    ReadyTimeout { wanted: &'static str, timeout_ms: u64, bound: ReadyBoundSource, csts: u32 },

    #[error("controller is unsupported: {reason}")]
    Unsupported { reason: String },

    #[error("invalid Identify data: {0}")]
    Identify(#[from] IdentifyError),

    #[error("{queue} {command_id} (opcode {opcode:#04x}) failed: {status}")]
    Command { queue: QueueId, command_id: CommandId, opcode: u8, status: NvmeStatus },

    /// Nothing completed by a deadline; `command_id` is the oldest command outstanding.
    #[error("{queue} {command_id} timed out after {waited_ms} ms ({outstanding} commands outstanding)")]
    Timeout { queue: QueueId, command_id: CommandId, waited_ms: u64, outstanding: usize },

    #[error("{queue}: completion for {command_id} does not match any command in flight (stale, duplicated or corrupted)")]
    UnexpectedCompletion { queue: QueueId, command_id: CommandId },

    #[error("{queue}: completion names submission queue {reported}, expected {expected}")]
    WrongSubmissionQueue { queue: QueueId, reported: u16, expected: u16 },

    #[error("{queue}: completion reports SQ head {reported}, outside {head}..={tail} (the last head reported up to the tail published), modulo the depth, and outside the window of any command in flight it names (past its entry up to that tail)")]
    InvalidSubmissionQueueHead { queue: QueueId, reported: u32, head: u32, tail: u32 },

    /// A completion names `command_id`, a command in flight, with an SQ head that has not
    /// passed the command's entry: SQHD counts the entries the controller consumed (§4.6), so
    /// the entry at SQ index `sq_index` can complete only once the head lies past it.
    #[error("{queue}: completion for {command_id} reports SQ head {reported}, which has not passed the command's entry at SQ index {sq_index}: the controller completed a command it has not fetched")]
    CompletionBeforeFetch { queue: QueueId, command_id: CommandId, sq_index: u32, reported: u32 },

    /// A completion named `command_id`, a command in flight, but broke the queue protocol
    /// otherwise (`reason`: its SQ id, its SQ head, or a head that has not passed the command's
    /// entry). The command's outcome is unknown, so its slot and the memory it names stay
    /// reserved until the pair is deleted or the controller reset, and the pair is failed
    /// ([`NvmeError::QueueFailed`]).
    #[error("{queue}: the completion for {command_id} (opcode {opcode:#04x}, tag {tag:#x}) breaks the queue protocol ({reason}): the command's outcome is unknown, so its slot and the memory it names stay reserved until the queue pair is deleted or the controller reset, and the pair takes no new command")]
    CommandOutcomeUnknown { queue: QueueId, command_id: CommandId, opcode: u8, tag: u64, reason: Box<NvmeError> },

    /// The pair saw a completion that broke the queue protocol (wrong SQ id, impossible SQ
    /// head, a command completed before it was fetched) and takes no new command.
    #[error("{queue} failed: the controller posted a completion that breaks the queue protocol, so the pair takes no new command ({unknown_outcomes} command(s) whose outcome is unknown still hold their slots): delete it and create another, or reset the controller")]
    QueueFailed { queue: QueueId, unknown_outcomes: usize },

    #[error("{queue} is full ({depth} entries): back-pressure, reap completions and retry")]
    QueueFull { queue: QueueId, depth: u32 },

    /// A request needs more commands than the pair ever holds at once (depth − 1): unlike
    /// [`NvmeError::QueueFull`] it never fits, however many completions are reaped.
    #[error("{queue}: the request needs {commands} commands, more than the {capacity} a queue pair of this depth holds at once: split it, or use a deeper queue pair")]
    TransferTooLarge { queue: QueueId, commands: u64, capacity: usize },

    #[error("{queue} still has {outstanding} command(s) in flight (an earlier command timed out and has not completed): nothing was submitted, and the late command's buffer is left alone; retry once it completes, or reset the controller")]
    QueueBusy { queue: QueueId, outstanding: usize },

    #[error("the doorbells of {queue} would lie at {offset:#x}, outside BAR0 ({bar_bytes} bytes): CAP.DSTRD is too large for this BAR")]
    DoorbellOutsideBar { queue: QueueId, offset: usize, bar_bytes: usize },

    /// A ring given for a detached queue pair is not memory of this controller's DMA space at
    /// its IOVA: the controller would read commands from, or write completions into, whatever
    /// its space maps there (another pool's IOVAs name this space's other memory, or none).
    #[error("the {ring} at {iova} (host {host_address:#x}) is not this controller's DMA memory: its DMA space maps that IOVA range to other memory, or to none")]
    RingNotDeviceMemory { ring: &'static str, iova: Iova, host_address: usize },

    /// The SQ and CQ given for a detached queue pair overlap (by IOVA or in host memory): the
    /// controller would write completions over the commands.
    #[error("the submission ring ({submission} +{submission_bytes} bytes) and the completion ring ({completion} +{completion_bytes} bytes) overlap: the controller would write completions over the commands")]
    RingsOverlap { submission: Iova, submission_bytes: usize, completion: Iova, completion_bytes: usize },

    #[error("{queue} belongs to a controller generation that was reset; create a new queue pair")]
    QueueStale { queue: QueueId },

    /// A reset waited its bound for a doorbell write in progress on another thread (a thread
    /// stopped inside it) and gave up. The controller was not touched (once re-enabled, a late
    /// write could land on a queue id a new pair holds); the queue pairs created before are
    /// stale and keep their rings.
    #[error("a controller reset waited {waited_ms} ms for a doorbell write in progress on another thread and gave up: the controller was left as it was, and the queue pairs created before are stale and keep (leak) their rings until a later reset succeeds; retry the reset once that thread runs again")]
    ResetBlockedByDoorbellWrite { waited_ms: u64 },

    /// A reset or teardown since the pair was created could not confirm the controller stopped:
    /// a disable that ran out CAP.TO, an enable under way that never finished, a doorbell write
    /// it gave up on ([`NvmeError::ResetBlockedByDoorbellWrite`], the controller untouched), a
    /// failed function reset, a device gone. That call's error says which.
    #[error("{queue}: a reset or teardown since this queue pair was created could not confirm the controller stopped (see that call's error): the queues may still be live, so their rings are kept; reset the controller successfully first")]
    QueueMaybeLive { queue: QueueId },

    #[error("this controller uses shadow doorbells (ControllerConfig::shadow_doorbells) and reads I/O doorbells from their page, which a detached pair's agent does not write: bring the controller up without them to create detached pairs")]
    ShadowDoorbellsActive,

    #[error("Doorbell Buffer Config got no answer that says whether it took effect (its admin command timed out or failed unanswered): no queue pair could ring this controller reliably, so none is created until a reset succeeds")]
    ShadowDoorbellsUnknown,

    #[error("{queue} has no slot in the one-page shadow doorbell buffer at a doorbell stride of {stride_bytes} bytes (queues 1..={last_queue} fit): create fewer queue pairs, or bring the controller up without shadow doorbells")]
    NoShadowDoorbellSlot { queue: QueueId, stride_bytes: usize, last_queue: u16 },

    /// The last bring-up (a [`crate::Controller::reset`]) stopped at `stage` without finishing:
    /// the queue ids, the grant and the Identify data of before may not hold for the controller
    /// now, so no queue pair is created until a reset succeeds.
    #[error("the controller's last reset stopped at bring-up stage {stage:?} without finishing: no queue pair is created until a reset succeeds")]
    ControllerNotReady { stage: crate::BringUpStage },

    /// [`crate::Controller::shutdown`] was called: a shut-down controller executes no command
    /// until it is reset (NVMe 2.0 §3.6.1: CC.EN 1 → 0), so no queue pair is created until a
    /// reset succeeds. After a reset that failed, creation is refused with
    /// [`NvmeError::ControllerNotReady`] instead (checked first).
    #[error("the controller was shut down (CC.SHN): it executes no command until a reset, so no queue pair is created until one succeeds")]
    ControllerShutDown,

    #[error("no free I/O queue identifier: the controller granted {granted} I/O queue pairs")]
    NoQueueAvailable { granted: u16 },

    #[error("requested queue depth {requested} outside 2..={max} (CAP.MQES)")]
    InvalidQueueDepth { requested: u32, max: u32 },

    #[error("{namespace} does not exist on this controller")]
    UnknownNamespace { namespace: NamespaceId },

    #[error("{0}")]
    UnsupportedNamespaceFormat(RefusedNamespace),

    #[error("{namespace} has {block_size_bytes}-byte blocks: the driver uses power-of-two block sizes in 512..=65536 (LBADS 9..=16)")]
    InvalidNamespaceBlockSize { namespace: NamespaceId, block_size_bytes: u32 },

    #[error("a per-command transfer limit of {max_transfer_bytes} bytes is unusable: it must hold one {block_size_bytes}-byte block and stay within {limit_bytes} bytes (one PRP list page)")]
    InvalidMaxTransfer { max_transfer_bytes: u64, block_size_bytes: u32, limit_bytes: u64 },

    #[error("{blocks} blocks in one command: NLB is 16 bits, so one command moves 1..=65536 blocks")]
    InvalidBlockCount { blocks: u64 },

    #[error("{namespace}: LBA range {start}+{blocks} outside the namespace's {size_blocks} blocks")]
    LbaOutOfRange { namespace: NamespaceId, start: u64, blocks: u64, size_blocks: u64 },

    #[error("transfer of {bytes} bytes is not a multiple of the {block_size_bytes}-byte LBA size")]
    UnalignedTransfer { bytes: u64, block_size_bytes: u32 },

    #[error("buffer segment {index} ({reason}) cannot be described by {mode}")]
    UnsupportedLayout { index: usize, reason: &'static str, mode: &'static str },

    #[error("empty transfer: no buffers or zero length")]
    EmptyTransfer,
}

impl NvmeError {
    /// True for conditions a caller handles by reaping completions and retrying (not failures).
    pub fn is_backpressure(&self) -> bool {
        matches!(self, NvmeError::QueueFull { .. })
    }

    /// The NVMe status, if this error is a failed command.
    pub fn status(&self) -> Option<NvmeStatus> {
        match self {
            NvmeError::Command { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// What set the bound a [`NvmeError::ReadyTimeout`] ran out (a byte, not a string: the error
/// travels inside every crate's error type, which must stay small).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadyBoundSource {
    /// CAP.TO: every wait for CSTS.RDY = 0, a wait for RDY = 1 where CRTO does not raise it, and
    /// the wait before a disable for an enable of the driver's that already ran out CRTO.CRWMT.
    CapTo,
    /// CRTO.CRWMT, larger than CAP.TO on a controller with CAP.CRMS.CRWMS set (RDY = 1 only).
    CrtoCrwmt,
    /// The shutdown bound (RTD3E up to 60 s, at least CAP.TO and 1 s), for CSTS.SHST.
    Shutdown,
}

impl std::fmt::Display for ReadyBoundSource {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            ReadyBoundSource::CapTo => "CAP.TO",
            ReadyBoundSource::CrtoCrwmt => "CRTO.CRWMT",
            ReadyBoundSource::Shutdown => "the shutdown bound: RTD3E up to 60 s, at least CAP.TO and 1 s",
        })
    }
}
