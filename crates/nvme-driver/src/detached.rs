//! Queue pairs driven by another agent: the controller creates the queues, but a GPU kernel (or
//! any other submitter) writes the SQ entries, rings the doorbells and polls the CQ.
//!
//! The host only creates and deletes the queues. It never reads or writes their rings after
//! creation: the agent that owns them does, through the raw addresses this type exposes.

//!
//! The other half lives here too: [`IoQueuePair::attach`] turns a detached pair's layout, in
//! another process that has the rings' memory and the register page mapped, into an ordinary
//! host-driven [`IoQueuePair`] (what the CPU executor drives).

use std::sync::Arc;

use crate::datapath::{DataPointerMode, SCRATCH_BYTES, TRANSFER_BYTES_MAX};
use crate::error::NvmeError;
use crate::gate::QueueFate;
use crate::hw::{DmaAllocator, DmaRegion, RegisterIo};
use crate::io::{IoQueuePair, PairOwner};
use crate::namespace::Namespace;
use crate::queue::{doorbell_offsets, QueuePair, QUEUE_DEPTH_MAX};
use crate::spec::registers::{self, Capabilities};
use crate::spec::{COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::teardown::AdminShared;
use crate::types::{Iova, QueueId};

/// The block sizes the driver computes with (LBADS 9..=16, as bring-up accepts from Identify).
const BLOCK_SIZE_BYTES_MIN: u32 = 512;
const BLOCK_SIZE_BYTES_MAX: u32 = 65536;

/// Where a detached queue pair lives and how to ring it; everything a GPU kernel needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DetachedQueueLayout {
    pub id: QueueId,
    /// Entries in each ring.
    pub depth: u32,
    /// Device (IOVA) addresses of the rings, as programmed into the controller.
    pub submission_iova: Iova,
    pub completion_iova: Iova,
    /// Host virtual addresses of the rings (for `cuMemHostRegister` when they are host memory).
    pub submission_host_address: usize,
    pub completion_host_address: usize,
    /// Byte offsets of the SQ tail and CQ head doorbells within BAR0.
    pub submission_doorbell_offset: usize,
    pub completion_doorbell_offset: usize,
}

/// An I/O queue pair the host created but does not drive. Deleted on drop (bounded by the admin
/// timeout).
///
/// # The agent's contract
///
/// The host's doorbell gate (see [`crate::IoQueuePair::ring_doorbell`]) cannot reach another
/// agent: a GPU kernel writes BAR0 directly, and nothing the host does stops it. So the agent
/// must have stopped — no kernel running on these rings, no doorbell write in flight — before
/// this pair is dropped and before [`crate::Controller::reset`] (or the controller's drop) is
/// called. After a reset the queue id is handed out again, and a late doorbell write from the
/// agent would make the controller run another pair's SQ slots; after a drop, the rings may be
/// freed. The GPU executor drains its stream before either.
///
/// Dropping deletes the queues and frees the rings only when that is known to be safe: if the
/// deletion fails, or a reset since creation never confirmed the controller stopped, the rings
/// and the queue id are kept for good (leaked, counted, logged at error level). Rings the caller
/// supplied are kept mapped that way, but the caller still owns the memory behind them and must
/// not reuse or free it either unless [`DetachedQueuePair::delete`] returned `Ok`.
pub struct DetachedQueuePair {
    layout: DetachedQueueLayout,
    submission: DmaRegion,
    completion: DmaRegion,
    admin: Arc<AdminShared>,
    /// The controller generation this pair was created in (see `gate.rs`).
    generation: u64,
    /// Set by [`DetachedQueuePair::delete`], so that drop does not delete twice.
    deleted: bool,
    /// The submission queue is gone on the controller (a deletion got that far).
    sq_deleted: bool,
}

impl std::fmt::Debug for DetachedQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DetachedQueuePair").field("layout", &self.layout).finish()
    }
}

impl DetachedQueuePair {
    /// Checks the rings the caller supplied can hold `depth` entries and are page aligned.
    pub(crate) fn validate_rings(depth: u32, submission: &DmaRegion, completion: &DmaRegion) -> Result<(), NvmeError> {
        let checks = [
            (submission, depth as usize * SUBMISSION_ENTRY_BYTES, "submission ring"),
            (completion, depth as usize * COMPLETION_ENTRY_BYTES, "completion ring"),
        ];
        for (region, needed, what) in checks {
            if region.len() < needed {
                return Err(NvmeError::Unsupported {
                    reason: format!("{what} holds {} bytes, {depth} entries need {needed}", region.len()),
                });
            }
            if region.iova().0 % 4096 != 0 {
                return Err(NvmeError::Unsupported { reason: format!("{what} at {} is not page aligned", region.iova()) });
            }
        }
        Ok(())
    }

    /// Checks that the rings are this controller's DMA memory and apart: `dma` (the controller's
    /// space) must map each ring's IOVA range, as far as the controller uses it, to the very
    /// host memory the region is, and the two rings must not share an IOVA or a host byte.
    /// A region from another pool (two identity pools hand out the same IOVAs) or a stale
    /// clone of one whose IOVA was reused would otherwise point the controller at other
    /// memory; one region given twice would have the controller write completions over the
    /// commands. Called after [`DetachedQueuePair::validate_rings`] (the sizes are checked).
    pub(crate) fn check_rings_in(
        dma: &dyn DmaAllocator,
        depth: u32,
        submission: &DmaRegion,
        completion: &DmaRegion,
    ) -> Result<(), NvmeError> {
        let (submission_bytes, completion_bytes) = (depth as usize * SUBMISSION_ENTRY_BYTES, depth as usize * COMPLETION_ENTRY_BYTES);
        for (region, bytes, ring) in [(submission, submission_bytes, "submission ring"), (completion, completion_bytes, "completion ring")]
        {
            // One mapping covers the whole range (translate finds no range spanning two), and
            // within a mapping IOVA and host address advance together: equal first bytes mean
            // every byte the controller reaches is this region's.
            let mapped = dma.translate(region.iova(), bytes).map(|mapped| mapped.host_address());
            if mapped.ok() != Some(region.host_address()) {
                return Err(NvmeError::RingNotDeviceMemory { ring, iova: region.iova(), host_address: region.host_address() });
            }
        }
        // Half-open ranges in u128: no sum of a u64 or usize start and a length can overflow.
        let apart = |a: u128, a_bytes: usize, b: u128, b_bytes: usize| a + a_bytes as u128 <= b || b + b_bytes as u128 <= a;
        let iovas_apart = apart(u128::from(submission.iova().0), submission_bytes, u128::from(completion.iova().0), completion_bytes);
        let hosts_apart = apart(submission.host_address() as u128, submission_bytes, completion.host_address() as u128, completion_bytes);
        if !(iovas_apart && hosts_apart) {
            return Err(NvmeError::RingsOverlap {
                submission: submission.iova(),
                submission_bytes,
                completion: completion.iova(),
                completion_bytes,
            });
        }
        Ok(())
    }

    pub(crate) fn new(
        layout: DetachedQueueLayout,
        submission: DmaRegion,
        completion: DmaRegion,
        admin: Arc<AdminShared>,
        generation: u64,
    ) -> Self {
        Self { layout, submission, completion, admin, generation, deleted: false, sq_deleted: false }
    }

    pub fn layout(&self) -> DetachedQueueLayout {
        self.layout
    }

    /// False once the controller was reset (or dropped): the queues no longer exist on it, or, if
    /// that reset never saw the controller stop, may still. Waits for a reset in progress on
    /// another thread as [`IoQueuePair::controller_was_reset`] does.
    pub fn is_live(&self) -> bool {
        self.admin.gate.fate(self.generation) == QueueFate::Live
    }

    /// Deletes the queues now and reports the outcome (dropping does the same, but can only
    /// log). `Ok` means the controller no longer uses the rings: their memory may be reused.
    /// On an error the pair comes back; dropping it then leaks its rings.
    pub fn delete(mut self) -> Result<(), UndeletedDetachedQueuePair> {
        match self.admin.retire_queue_pair(self.layout.id, self.generation, &mut self.sq_deleted) {
            Ok(()) => {
                self.deleted = true;
                Ok(())
            }
            Err(source) => Err(UndeletedDetachedQueuePair { source, pair: Box::new(self) }),
        }
    }
}

/// A detached queue pair whose deletion failed: the controller may still use its rings.
#[derive(Debug, thiserror::Error)]
#[error("deleting detached {} failed: {source}", pair.layout.id)]
pub struct UndeletedDetachedQueuePair {
    pub source: NvmeError,
    pub pair: Box<DetachedQueuePair>,
}

impl Drop for DetachedQueuePair {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        if let Err(error) = self.admin.retire_queue_pair(self.layout.id, self.generation, &mut self.sq_deleted) {
            self.admin.leak_queue_pair(self.layout.id, [self.submission.clone(), self.completion.clone()], &error);
        }
    }
}

/// Where an attached pair's rings and doorbells are, and what it may do I/O on: everything a
/// client process gets from the daemon besides the memory itself.
#[derive(Debug, Clone)]
pub struct AttachedQueueConfig {
    pub layout: DetachedQueueLayout,
    /// Namespaces the daemon lets this client use (id, LBA size, size in blocks).
    pub namespaces: Vec<Namespace>,
    pub data_pointer_mode: DataPointerMode,
    /// The controller's per-command transfer limit (MDTS), as the daemon's controller computed it.
    pub max_transfer_bytes: u64,
    /// The controller requires SGL Data Blocks of whole dwords (Identify SGLS bits 1:0 = 10b), as
    /// the daemon's controller read it: this pair then refuses other lengths, as a pair the
    /// controller made itself does, rather than sending commands the controller would fail.
    pub sgl_dword_lengths: bool,
}

impl IoQueuePair {
    /// Drives, from this process, an I/O queue pair another process (the daemon) created with
    /// [`crate::Controller::create_detached_queue_pair`]: `rings` are this process's regions of
    /// the SQ and CQ (at the layout's IOVAs, e.g. allocated from a [`crate::hw::DmaWindow`]),
    /// `dma` gives the per-slot scratch pages (PRP lists, SGL segments, DSM ranges) and must be
    /// in the same device address space, `registers` is the controller's register page mapped
    /// here ([`crate::hw::SharedRegisters`]). Submit, doorbell and reap then work exactly as for
    /// a pair this process's own controller made. Attach once per created queue: the pair starts
    /// from an empty SQ and CQ (head = tail = 0, phase 1), as the controller does.
    ///
    /// Checked here: the queue id (an I/O queue's, not the admin queue's 0), the depth, the ring
    /// sizes and alignment, that the rings are at the IOVAs the controller was given, that the
    /// doorbell offsets are the ones the register page's own CAP.DSTRD gives for the queue id
    /// (so a corrupt layout cannot make this pair ring the admin queue's or another queue's
    /// doorbell or write outside the page), and that the namespaces and the
    /// transfer limit are ones a controller's bring-up could have produced (see
    /// `check_grant`): the config comes off the daemon's wire.
    ///
    /// # The attach contract
    ///
    /// This pair's doorbell gate cannot see the daemon's controller generation: nothing here
    /// notices a reset of that controller. So, as for [`DetachedQueuePair`]'s agent, the daemon
    /// deletes (or lets a reset delete) a client's queues only after the client is gone or was
    /// told to stop and confirmed it rings no more doorbells, and a controller reset requires
    /// every client detached first; otherwise a late doorbell from this pair lands on whichever
    /// queue got its id next. The client never deletes queues: [`IoQueuePair::delete`] on an
    /// attached pair only says whether a command of its own is still in flight (`Ok` when none
    /// is), and dropping it deletes nothing. Dropping it with commands in
    /// flight keeps (leaks, logged at error level) its rings and scratch pages, since the
    /// controller may still read or write them; with nothing in flight they are freed. The
    /// caller must keep its own clones of the rings until the daemon reports the queues deleted.
    pub fn attach(
        config: AttachedQueueConfig,
        rings: (DmaRegion, DmaRegion),
        dma: &dyn DmaAllocator,
        registers: Arc<dyn RegisterIo>,
    ) -> Result<IoQueuePair, NvmeError> {
        let AttachedQueueConfig { layout, namespaces, data_pointer_mode, max_transfer_bytes, sgl_dword_lengths } = config;
        check_grant(&namespaces, max_transfer_bytes)?;
        // Queue id 0 is the admin queue, never a detached pair's: its doorbells would agree with
        // the id below, and this pair would then ring the admin SQ tail and CQ head.
        if layout.id.0 == 0 {
            return Err(NvmeError::Unsupported { reason: format!("{} is the admin queue, not an I/O queue to attach", layout.id) });
        }
        let depth = layout.depth;
        if !(2..=QUEUE_DEPTH_MAX).contains(&depth) {
            return Err(NvmeError::InvalidQueueDepth { requested: depth, max: QUEUE_DEPTH_MAX });
        }
        let (submission, completion) = rings;
        DetachedQueuePair::validate_rings(depth, &submission, &completion)?;
        if submission.iova() != layout.submission_iova || completion.iova() != layout.completion_iova {
            return Err(NvmeError::Unsupported {
                reason: format!(
                    "rings at {} / {} are not the ones {} was created with ({} / {})",
                    submission.iova(),
                    completion.iova(),
                    layout.id,
                    layout.submission_iova,
                    layout.completion_iova
                ),
            });
        }
        let stride_log2 = Capabilities(registers.read64(registers::CAP)).doorbell_stride_log2();
        let doorbells = doorbell_offsets(layout.id, stride_log2, registers.len())?;
        if doorbells != (layout.submission_doorbell_offset, layout.completion_doorbell_offset) {
            return Err(NvmeError::Unsupported {
                reason: format!(
                    "{} doorbells at {:#x} / {:#x}, but CAP.DSTRD puts them at {:#x} / {:#x}",
                    layout.id, layout.submission_doorbell_offset, layout.completion_doorbell_offset, doorbells.0, doorbells.1
                ),
            });
        }
        let scratch = dma.allocate((depth as usize - 1) * SCRATCH_BYTES)?;
        let queue = QueuePair::from_regions(layout.id, depth, [submission, completion, scratch], registers, doorbells);
        let mut pair = IoQueuePair::new(queue, PairOwner::Attached, data_pointer_mode, max_transfer_bytes, namespaces, Vec::new());
        if sgl_dword_lengths {
            pair.require_dword_sgl_lengths();
        }
        Ok(pair)
    }
}

/// Checks an attach's namespaces and transfer limit as bring-up checks Identify data: every
/// block size a power of two in 512..=65536 (LBADS 9..=16; 0 would divide by zero when a
/// transfer is planned), and a limit that holds the largest block and is at most
/// [`TRANSFER_BYTES_MAX`] (2 MiB, what `Controller` caps MDTS at). With blocks of at least 512
/// bytes, 2 MiB is 4096 blocks, so no command can need more than NLB's 65536: the NLB bound
/// 65536 × block is never the tighter one.
fn check_grant(namespaces: &[Namespace], max_transfer_bytes: u64) -> Result<(), NvmeError> {
    let mut largest_block_bytes = BLOCK_SIZE_BYTES_MIN;
    for namespace in namespaces {
        let block_size_bytes = namespace.block_size_bytes;
        if !block_size_bytes.is_power_of_two() || !(BLOCK_SIZE_BYTES_MIN..=BLOCK_SIZE_BYTES_MAX).contains(&block_size_bytes) {
            return Err(NvmeError::InvalidNamespaceBlockSize { namespace: namespace.id, block_size_bytes });
        }
        largest_block_bytes = largest_block_bytes.max(block_size_bytes);
    }
    if !(u64::from(largest_block_bytes)..=TRANSFER_BYTES_MAX).contains(&max_transfer_bytes) {
        return Err(NvmeError::InvalidMaxTransfer {
            max_transfer_bytes,
            block_size_bytes: largest_block_bytes,
            limit_bytes: TRANSFER_BYTES_MAX,
        });
    }
    Ok(())
}

/// Drop of an attached pair: nothing to delete (the daemon does); keep the memory the
/// controller may still use when commands are in flight.
pub(crate) fn drop_attached(queue: &QueuePair) {
    let in_flight = queue.in_flight();
    if in_flight == 0 {
        return;
    }
    let bytes: usize = queue.regions().into_iter().map(DmaRegion::leak).sum();
    tracing::error!(
        queue = %queue.id(),
        in_flight,
        bytes,
        "attached queue pair dropped with commands in flight: its rings and scratch pages are kept (leaked), the controller may still use them"
    );
}
