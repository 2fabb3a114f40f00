//! The runtime an engine drives at layer boundaries. It owns the object store and the policy;
//! the engine says what it knows (a request begins, a layer begins or ends, prefill ends, a
//! decode step begins) and the runtime decides and issues every read and write.
//!
//! Mapping the policy onto the store: the policy counts IOCBs of the table's size
//! (`iocb_bytes`, one size across the cost rows), as the simulator does for the same request,
//! and the views are built alike, but they are not the same views: the runtime's I/O moves in
//! whole layers, the simulator's in the IOCBs the policy issued. A read layer one plan splits
//! over two windows (2 IOCBs on 2 SMs, 1 on 4) goes here whole, on the largest budget its
//! issues named (4), as one kernel, at the boundary; the simulator runs two jobs, on 2 and 4
//! SMs, from their offsets. So a later view shows here whole layers waiting and in flight
//! (`outstanding_read_iocbs` a multiple of a layer's, a kernel per layer, entries by the layers'
//! budgets), there the IOCBs left of each job (a kernel per job, or one per budget while queued
//! kernels hide the latency; entries by the jobs' budgets), and the decisions may differ.
//! The store moves a layer whole (it reissues one request's IOCBs per layer), so a layer's reads
//! are handed over when the policy first issues any of them, and writes are released in whole layers once the policy's
//! write grants (carried forward while smaller than the oldest layer, with the time of windows
//! too short for one IOCB) cover them, each layer priced with its own command latency; only a
//! flush (naive, no-overlap: a write issued without waiting for reads) releases every ready
//! layer at once. Offsets inside a layer are not timed: what the policy
//! issues at a boundary is handed to the executor at that boundary, FIFO per direction, one
//! layer of each direction at a time (one write layer across all queued stores, oldest first);
//! later layers wait in the runtime and go when the previous one completed (checked at every
//! call, and while the engine waits for KV). Each goes on the SM budget the policy chose for it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use gio_uring::{Executor, QueuePairReset, SmBudget};
use objstore::{KvRequest, KvStore, ObjstoreError, RequestHandle};
use scheduler::policy::{IoPolicy, LayerView, QueueView, ReadsOnBudget};
use scheduler::table::{IoKind, ModelIdentity, Profile};

use crate::config::{PolicyChoice, RuntimeConfig, WriteQueueFullAction, IO_TIMEOUT_MAX};
use crate::error::{store_error, FinishError, Result, RuntimeError};
use crate::events::{EventLog, IoDirection, IoEvent, IoEventKind, RuntimeCounters};
use crate::writes::{PendingStore, WriteQueue};

mod progress;

/// Names one request from `begin_prefill` to `end_prefill`; refused afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefillId(u64);

impl PrefillId {
    pub fn get(self) -> u64 {
        self.0
    }
}

/// What `begin_prefill` decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillStart {
    pub id: PrefillId,
    /// Leading blocks whose KV the runtime reads (the engine computes only the rest).
    pub cached_blocks: usize,
    /// Engine blocks whose data the write queue holds until committed (see `Runtime::releasable`).
    pub queued_blocks: usize,
}

#[derive(Debug)]
struct Prefill {
    id: u64,
    input_tokens: u32,
    prefix_tokens: u32,
    retrieve: Option<RequestHandle>,
    /// The retrieve's target engine blocks, held (not `releasable`) until the prefill ends: the
    /// device writes them while its reads are in flight.
    read_targets: Vec<u32>,
    next_layer: u32,
    in_layer: Option<u32>,
    /// The policy asked, at the layer begun, that every read land before it goes on.
    wait_for_all: bool,
    /// A layer whose plan was applied but not handed over (the issue failed): its
    /// `wait_for_all`. A retry of its `begin_layer` issues what waits without planning again.
    planned: Option<(u32, bool)>,
    /// The layer begun has had its KV waited for (`wait_layer_kv`).
    kv_resident: bool,
    /// No table entry for this request: all reads at once, writes left to decode steps.
    fallback: bool,
    kv_wait: Duration,
}

/// The reads of the running prefill.
#[derive(Debug)]
struct Reads {
    /// Per layer, IOCBs (the policy's unit) not issued yet.
    unissued_iocbs: Vec<u32>,
    iocbs_per_layer: u32,
    /// Issued by the policy, waiting for the previous layer (or a write) to complete.
    waiting: VecDeque<u32>,
    in_flight: Option<u32>,
    done: Vec<bool>,
    /// Per layer, the SM budget the policy issued it with (the largest, when several of its
    /// issues came before the layer was handed over); the table's largest until decided.
    budgets: Vec<u32>,
    /// The layers waiting and in flight by budget, as the views show them
    /// (`LayerView::outstanding_reads_by_budget`): rebuilt for each view, with room for one
    /// entry per layer reserved at construction, so that no view allocates.
    by_budget: Vec<ReadsOnBudget>,
}

impl Reads {
    /// No prefill's reads: every layer done, on `largest_budget`, with the room `by_budget`
    /// needs reserved (one entry per layer: the layers waiting are distinct).
    fn new(layers: usize, largest_budget: u32) -> Reads {
        Reads {
            unissued_iocbs: vec![0; layers],
            iocbs_per_layer: 0,
            waiting: VecDeque::with_capacity(layers),
            in_flight: None,
            done: vec![true; layers],
            budgets: vec![largest_budget; layers],
            by_budget: Vec::with_capacity(layers),
        }
    }

    /// Issued by the policy and not completed, in the policy's IOCBs.
    fn outstanding_iocbs(&self) -> u32 {
        self.outstanding_layers().saturating_mul(self.iocbs_per_layer)
    }

    /// The layers waiting and in flight: handed over a layer at a time, each pays the command
    /// latency (`LayerView::outstanding_read_kernels`).
    fn outstanding_layers(&self) -> u32 {
        self.waiting.len() as u32 + u32::from(self.in_flight.is_some())
    }

    /// Rebuilds `by_budget` (`LayerView::outstanding_reads_by_budget`): the layers waiting and in
    /// flight, each a kernel of `iocbs_per_layer` on the budget it goes (went) over on, summed
    /// per budget. A run-ahead layer the policy placed partly in a window of few free SMs goes
    /// whole on those; priced on the table's largest, the next plan placed writes into time it
    /// still took. Each budget is priced on its own rows: the rows need not be monotone across
    /// budgets, so pricing all on one budget (the smallest) took a layer on a larger budget for
    /// the smaller's faster rows. Empty when none is outstanding.
    fn price_by_budget(&mut self) -> &[ReadsOnBudget] {
        self.by_budget.clear();
        for &layer in self.in_flight.iter().chain(self.waiting.iter()) {
            let Some(&sm_budget) = self.budgets.get(layer as usize) else { continue };
            match self.by_budget.iter_mut().find(|reads| reads.sm_budget == sm_budget) {
                Some(reads) => {
                    reads.iocbs = reads.iocbs.saturating_add(self.iocbs_per_layer);
                    reads.kernels += 1;
                }
                None => self.by_budget.push(ReadsOnBudget { sm_budget, iocbs: self.iocbs_per_layer, kernels: 1 }),
            }
        }
        &self.by_budget
    }

    /// The policy issued (some of) layer `layer`'s reads on `budget` SMs: the whole layer waits
    /// to be handed over, with the largest budget any of its issues asked for.
    fn decide(&mut self, layer: u32, budget: u32) {
        let index = layer as usize;
        let Some(unissued) = self.unissued_iocbs.get_mut(index) else { return };
        if *unissued > 0 {
            *unissued = 0;
            self.waiting.push_back(layer);
            self.budgets[index] = budget;
        } else if self.waiting.contains(&layer) {
            self.budgets[index] = self.budgets[index].max(budget);
        }
    }
}

/// What the policy is shown before layer `layer` of a prefill of `input_tokens` (of which
/// `prefix_tokens` cached) begins (`reads`: mutable to rebuild the entries by budget).
fn layer_view<'a>(
    profile: &'a Profile,
    reads: &'a mut Reads,
    writes: &WriteQueue,
    input_tokens: u32,
    prefix_tokens: u32,
    layer: u32,
) -> LayerView<'a> {
    reads.price_by_budget();
    let reads: &'a Reads = reads;
    LayerView {
        table: profile,
        input_tokens,
        prefix_tokens,
        layer,
        unissued_read_iocbs: &reads.unissued_iocbs,
        outstanding_read_iocbs: reads.outstanding_iocbs(),
        outstanding_read_kernels: reads.outstanding_layers(),
        outstanding_reads_by_budget: &reads.by_budget,
        outstanding_write_iocbs: writes.outstanding_iocbs(),
        outstanding_write_kernels: writes.outstanding_layers(),
        in_flight_write_iocbs: writes.in_flight_iocbs(),
        in_flight_write_sm_budget: writes.in_flight_sm_budget(),
        queued_write_iocbs: writes.queued_iocbs(),
    }
}

fn queue_view<'a>(profile: &'a Profile, reads: &'a mut Reads, writes: &WriteQueue, context_tokens: u32) -> QueueView<'a> {
    QueueView {
        table: profile,
        context_tokens,
        outstanding_read_iocbs: reads.outstanding_iocbs(),
        outstanding_reads_by_budget: reads.price_by_budget(),
        outstanding_write_iocbs: writes.outstanding_iocbs(),
        // Handed over a layer at a time: each pays the command latency.
        outstanding_write_kernels: writes.outstanding_layers(),
        in_flight_write_iocbs: writes.in_flight_iocbs(),
        in_flight_write_sm_budget: writes.in_flight_sm_budget(),
        queued_write_iocbs: writes.queued_iocbs(),
    }
}

/// See the module documentation.
pub struct Runtime<E: Executor> {
    store: KvStore<E>,
    profile: Profile,
    config: RuntimeConfig,
    policy: Box<dyn IoPolicy>,
    block_tokens: u32,
    layers: u32,
    kv_bytes_per_token_per_layer: u64,
    iocb_bytes: u64,
    read_budget: SmBudget,
    write_budget: SmBudget,
    prefill: Option<Prefill>,
    reads: Reads,
    writes: WriteQueue,
    next_request: u64,
    /// The request whose store `make_room` is forcing: counted in `stores_forced` when it commits.
    forcing: Option<u64>,
    /// An executor error (`progress::executor_error`) a poll met that no live I/O has been
    /// failed with yet (a retiring request's poll or wait, or `pump`'s peek starting the layers
    /// a call handed over): gio-uring reports one once, to whichever poll meets it first, and a
    /// layer whose own polls will never see it would wait a whole `io_timeout` instead.
    /// `advance` hands it to the live I/O (see there); with none, it waits for the next, or for
    /// `begin_prefill`, which returns it. The first is kept; later ones are logged only.
    /// `abandon_in_flight` forgets it (logged): it concerned the queue pairs the reset replaces.
    ///
    /// Nothing else ends it, however long ago it was met: only a claim reports it, once. So it
    /// can outlive what it concerned: the read in flight may fail with its own error from the
    /// same fault (a stopped worker's issue ending as TIMEOUT: `ReadFailed`, `LayerIo`) and the
    /// next `begin_prefill` is then refused for the kept one too; a GPU executor that reset
    /// itself and recovered still has its next live I/O failed, or, with none meanwhile, a much
    /// later `begin_prefill` refused, once; and one kept when the engine drains fails that
    /// `drain` (or `finish`, `FinishError`) if a write is in flight then. Each is reported
    /// once (`Store` "poll the executor", or the read's `ReadFailed`): a retry goes on. No
    /// rule tells a stale error from a live one (a successful poll says nothing of the error a
    /// worker reported once, and a failed read need not be the executor's fault), so it is kept
    /// rather than a new request's I/O handed to an executor known to have failed.
    executor_failure: Option<ObjstoreError>,
    counters: RuntimeCounters,
    log: EventLog,
}

impl<E: Executor> std::fmt::Debug for Runtime<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("policy", &self.config.policy)
            .field("prefill", &self.prefill)
            .field("write_queue", &self.writes.stores)
            .field("counters", &self.counters)
            .finish()
    }
}

/// Policy units for `tokens` tokens of KV per layer.
fn iocbs_for(tokens: u64, kv_bytes_per_token_per_layer: u64, iocb_bytes: u64) -> u32 {
    let bytes = tokens.saturating_mul(kv_bytes_per_token_per_layer);
    u32::try_from(bytes.div_ceil(iocb_bytes)).unwrap_or(u32::MAX)
}

impl<E: Executor> Runtime<E> {
    /// Binds a store to a profile table. The table must describe the store's geometry (layer
    /// count, KV bytes per token) and the model and GPU named in `config`. Refused (the checks
    /// of [`Runtime::check`]), the store is dropped with the error: call `check` first to keep
    /// it (to close it, or to try another table or config).
    pub fn new(store: KvStore<E>, profile: Profile, config: RuntimeConfig) -> Result<Self> {
        Self::check(&store, &profile, &config)?;
        let geometry = *store.pool().geometry();
        // K and V of one token in one layer: two objects of a block, over its tokens.
        let kv_bytes_per_token_per_layer = 2 * geometry.object_bytes() / u64::from(geometry.block_tokens);
        // One size for every cost row, reads and writes, at least one LBA (validated with the
        // table): the policy counts both directions in it and costs them with their own rows.
        let iocb_bytes = profile.iocb_bytes().max(1);
        let budget = |kind| SmBudget(profile.io_sm_budget_max(kind).max(1));
        let (read_budget, write_budget) = (budget(IoKind::Read), budget(IoKind::Write));
        let layers = geometry.layers;
        let engine_blocks = store.table().registration().num_blocks();
        Ok(Self {
            store,
            profile,
            policy: config.policy.kind().build(),
            block_tokens: geometry.block_tokens,
            layers,
            kv_bytes_per_token_per_layer,
            iocb_bytes,
            read_budget,
            write_budget,
            prefill: None,
            reads: Reads::new(layers as usize, read_budget.0),
            writes: WriteQueue::new(engine_blocks, config.write_queue_limit_stores),
            next_request: 1,
            forcing: None,
            executor_failure: None,
            counters: RuntimeCounters::default(),
            log: EventLog::new(config.event_log_capacity),
            config,
        })
    }

    /// What [`Runtime::new`] checks before it takes the store: the config's bounds, the write
    /// queue below the store's request slots, the table against the store's geometry and the
    /// config's model and GPU, and (slack-aware) that decode steps can write. An engine that
    /// wants the store back on a refusal calls this first.
    pub fn check(store: &KvStore<E>, profile: &Profile, config: &RuntimeConfig) -> Result<()> {
        if config.write_queue_limit_blocks == 0 || config.write_queue_limit_stores == 0 || config.io_timeout.is_zero() {
            return Err(RuntimeError::InvalidConfig {
                reason: format!(
                    "write_queue_limit_blocks ({}), write_queue_limit_stores ({}) and io_timeout ({:?}) must be positive",
                    config.write_queue_limit_blocks, config.write_queue_limit_stores, config.io_timeout
                ),
            });
        }
        if config.io_timeout > IO_TIMEOUT_MAX {
            return Err(RuntimeError::InvalidConfig {
                reason: format!(
                    "io_timeout ({:?}) is past IO_TIMEOUT_MAX ({IO_TIMEOUT_MAX:?}): every wait's deadline is now + io_timeout",
                    config.io_timeout
                ),
            });
        }
        // Each queued or retiring store holds one of the object store's request slots, and the
        // running prefill's retrieve needs one more: past that, prepares fail mid-stream.
        let requests_max = store.config().requests_max;
        if config.write_queue_limit_stores >= requests_max {
            return Err(RuntimeError::InvalidConfig {
                reason: format!(
                    "write_queue_limit_stores ({}) must be below the store's requests_max ({requests_max}): each queued store holds a \
                     request slot, and the running prefill's retrieve needs one",
                    config.write_queue_limit_stores
                ),
            });
        }
        let geometry = *store.pool().geometry();
        // K and V of one token in one layer: two objects of a block, over its tokens.
        let kv_bytes_per_token_per_layer = 2 * geometry.object_bytes() / u64::from(geometry.block_tokens);
        let model = ModelIdentity { name: config.model_name.clone(), layer_count: geometry.layers, kv_bytes_per_token_per_layer };
        profile.check_identity(&model, &config.gpu).map_err(|source| RuntimeError::ProfileMismatch { source })?;
        // Under slack-aware, deferred writes drain in decode steps; when the queue is full and
        // `Refuse` stops prefills, nowhere else: the scheduler's predicate (shared with
        // `tutti-profile check` and `import`) says whether any decode range can write.
        if config.policy == PolicyChoice::SlackAware {
            profile.check_decode_steps_can_write().map_err(|error| RuntimeError::InvalidConfig { reason: error.to_string() })?;
        }
        Ok(())
    }

    pub fn store(&self) -> &KvStore<E> {
        &self.store
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    pub fn counters(&self) -> RuntimeCounters {
        self.counters
    }

    /// Issue/complete events recorded so far (empty unless `event_log_capacity` > 0).
    pub fn events(&self) -> &[IoEvent] {
        self.log.events()
    }

    /// Events that did not fit the log.
    pub fn events_dropped(&self) -> u64 {
        self.log.dropped
    }

    pub fn clear_events(&mut self) {
        self.log.clear();
    }

    /// The IOCB size (bytes) the policy counts in: the table's, one size across its cost rows.
    pub fn iocb_bytes(&self) -> u64 {
        self.iocb_bytes
    }

    /// The longest cached prefix of `tokens`, in blocks.
    pub fn lookup(&mut self, tokens: &[u32]) -> usize {
        self.store.lookup(tokens)
    }

    /// Whether the engine may reuse engine block `block`: no queued store still has to write
    /// its data, and no I/O the device may still be doing names it. A block handed to
    /// `begin_prefill` for storing stays held until its store has committed (its data is on the
    /// device and durable) or failed (it will never be written) with nothing of it in flight; one
    /// the running prefill's retrieve reads into stays held until the prefill ends. A
    /// request that ended with a layer still in flight (a wait that timed out or an executor
    /// failure: `ReadFailed`, `StillInFlight` from `abort_prefill`, a failed deferred write) is
    /// *retiring*: the blocks it reads into or writes from stay held until the device ends that
    /// layer (see [`Runtime::retiring_requests`]).
    pub fn releasable(&self, block: u32) -> bool {
        self.writes.releasable(block)
    }

    /// Requests that ended with a layer still in flight, whose engine blocks stay held until the
    /// device ends it. Each holds one of the object store's request slots. The runtime retires
    /// them at every call (a late completion, a GPU executor's own timeout); on a CPU executor a
    /// completion the device lost ends only with [`Runtime::abandon_in_flight`].
    pub fn retiring_requests(&self) -> usize {
        self.writes.retiring.len()
    }

    /// Engine blocks and stores waiting in the write queue.
    pub fn queued_blocks(&self) -> usize {
        self.writes.queued_blocks
    }

    pub fn queued_stores(&self) -> usize {
        self.writes.stores.len()
    }

    /// Begins a request's prefill. `request.tokens` is the whole prompt, `request.block_ids` the
    /// engine blocks of its full blocks in order. The runtime looks up the cached prefix, prepares
    /// its retrieve into the leading engine blocks and the store of the rest (blocks cached or
    /// being stored elsewhere are shared, not written twice). Nothing is issued yet. All of
    /// `block_ids` (read into, stored from, or only computed into past a truncated store) must
    /// be [`Runtime::releasable`], distinct and registered: otherwise `BlockRefused`, and
    /// nothing is prepared. A pool with no room for the new blocks skips the store
    /// (`stores_skipped_pool_full`) and the prefix is read; any other failure preparing the
    /// store (a malformed request: `block_ids` past the prompt's full blocks; too few free
    /// IOCBs; the headers of evicted slots not written) or the retrieve fails the request
    /// (`Store`, naming the operation) with nothing prepared, the cached prefix not read.
    /// So does an executor error met reaping before anything is prepared or forcing a store
    /// out of the queue (`ForceOldest`), or met by an earlier call with no live I/O to fail
    /// with it (`Store`, "poll the executor"; the request's I/O would go to the same executor;
    /// reported once, so a retry begins it); a failure of another request's store met then is
    /// logged, not returned.
    pub fn begin_prefill(&mut self, request: &KvRequest<'_>) -> Result<PrefillStart> {
        if let Some(active) = &self.prefill {
            return Err(RuntimeError::OutOfOrder {
                call: "begin_prefill",
                reason: format!("request {} is still in prefill (end_prefill or abort_prefill first)", active.id),
            });
        }
        // Completions are reaped and finished stores committed (lookup sees them), but no
        // waiting write is handed over: the new request's reads, not known yet, go first (the
        // barrier holds writes while they are pending; see `reads_pending`).
        match self.advance(false) {
            Ok(()) => {}
            // The executor failed (a retiring request's poll met it, writes in flight): this
            // request's I/O would go to it too. Nothing is prepared; the error is reported once.
            Err(error @ RuntimeError::Store { operation: progress::POLL_THE_EXECUTOR, .. }) => return Err(error),
            // Another request's: a queued store whose write failed, already off the queue, and
            // whose finish was then refused. Returned, it refused this request for it.
            Err(error) => tracing::warn!(%error, "runtime: advancing the queues before a prefill"),
        }
        // The same for an executor error no live I/O claimed (none in flight, or met beside
        // another failure): kept, it would fail this request's first read or write instead,
        // once handed over, and begun here the request would hold its blocks meanwhile.
        self.claim_executor_failure()?;
        let blocks = request.block_ids.len();
        let hit = self.store.lookup(request.tokens).min(blocks);
        let mut incoming = blocks - hit;
        let limit_blocks = self.config.write_queue_limit_blocks;
        let truncated = self.config.on_write_queue_full == WriteQueueFullAction::ForceOldest && incoming > limit_blocks;
        if truncated {
            // More new blocks than the whole queue holds: the first `limit_blocks` of them are
            // stored (a prefix is what later lookups can hit), the rest are not; the cached prefix
            // is read as usual.
            incoming = limit_blocks;
        }
        // Before anything is prepared: a block the device may still move (a queued store's
        // source, a retiring request's, a lost read's target) or named twice would take stale or
        // another block's bytes into the new KV, or commit them under this request's keys; one
        // outside the registration is no block of the engine's memory at all. All
        // of the request's blocks, those past a truncated store too: the engine computes KV into
        // every one of them.
        if let Some((position, block, reason)) = self.writes.refuse_unusable(request.block_ids) {
            return Err(RuntimeError::BlockRefused { block, position, reason });
        }
        // A fully cached prompt has no store but its retrieve still needs a request slot: room
        // is made for it too (before, only for new blocks, and with the queue and the retiring
        // requests holding every slot `prepare_retrieve` failed `TooManyRequests`).
        if (incoming > 0 || hit > 0) && !self.make_room(incoming, hit > 0)? {
            // The retiring requests leave no request slot for the store beside the retrieve
            // (`stores_skipped_no_request_slot`): the retrieve runs, nothing is stored.
            incoming = 0;
        }
        // Forcing (`ForceOldest`) returns an executor error met with the forced layer in
        // flight (`make_room` above). One met with none in flight when `advance` looked (a
        // retiring request's poll between forced layers, which are waited for one at a time;
        // the forced layer done by the pass that would have claimed it) is still kept:
        // returned now, nothing of the request prepared yet, as one met above. Left, it failed
        // this request's first read instead.
        self.claim_executor_failure()?;
        if truncated && incoming > 0 {
            self.counters.stores_truncated += 1;
        }
        let id = self.next_request;
        self.next_request += 1;
        // The store first: it pins the cached blocks it shares, so no eviction it makes can take
        // the prefix the retrieve is about to read.
        if incoming > 0 {
            let stored = KvRequest { tokens: request.tokens, block_ids: &request.block_ids[..hit + incoming] };
            match self.store.prepare_store(&stored) {
                Ok(plan) if plan.new_blocks == 0 => {
                    self.store.finish(plan.handle).map_err(store_error("finish a store with no new block"))?
                }
                Ok(plan) => {
                    let mut engine_blocks = self.writes.take_list();
                    engine_blocks.extend_from_slice(&request.block_ids[hit..hit + incoming]);
                    let new_tokens = plan.new_blocks as u64 * u64::from(self.block_tokens);
                    let iocbs_per_layer = iocbs_for(new_tokens, self.kv_bytes_per_token_per_layer, self.iocb_bytes).max(1);
                    self.writes.push(PendingStore {
                        request: id,
                        handle: plan.handle,
                        engine_blocks,
                        iocbs_per_layer,
                        layer_budgets: vec![self.write_budget.0; self.layers as usize],
                        ready_layers: 0,
                        decided_layers: 0,
                        written_layers: 0,
                        in_flight: None,
                        in_flight_sm_budget: 0,
                        prefill_ended: false,
                    });
                }
                Err(ObjstoreError::PoolFull { needed, evictable }) => {
                    tracing::warn!(needed, evictable, "runtime: pool full, the request's new KV is not stored");
                    self.counters.stores_skipped_pool_full += 1;
                }
                Err(source) => return Err(RuntimeError::Store { operation: "prepare_store", source }),
            }
        }
        let retrieve = if hit > 0 {
            match self.store.prepare_retrieve(&KvRequest { tokens: request.tokens, block_ids: &request.block_ids[..hit] }) {
                Ok(handle) => Some(handle),
                Err(source) => {
                    // The retrieve's error is the one the engine needs (why its prefix is not
                    // read); dropping the store just prepared (nothing of it in flight) is
                    // cleanup, and its failure would have hidden that.
                    if let Err(dropped) = self.drop_store(id) {
                        tracing::warn!(error = %dropped, "runtime: dropping the store of a prefill whose retrieve could not be prepared");
                    }
                    return Err(RuntimeError::Store { operation: "prepare_retrieve", source });
                }
            }
        } else {
            None
        };
        let mut read_targets = self.writes.take_list();
        if retrieve.is_some() {
            read_targets.extend_from_slice(&request.block_ids[..hit]);
            self.writes.hold_targets(&read_targets);
        }
        let input_tokens = u32::try_from(request.tokens.len()).unwrap_or(u32::MAX);
        let prefix_tokens = u32::try_from(hit as u64 * u64::from(self.block_tokens)).unwrap_or(u32::MAX);
        let fallback = self.profile.bucket(input_tokens, prefix_tokens).is_err();
        if fallback {
            self.counters.table_fallbacks += 1;
        }
        let per_layer =
            if hit > 0 { iocbs_for(u64::from(prefix_tokens), self.kv_bytes_per_token_per_layer, self.iocb_bytes).max(1) } else { 0 };
        self.reads.iocbs_per_layer = per_layer;
        self.reads.unissued_iocbs.fill(per_layer);
        self.reads.done.fill(hit == 0);
        self.reads.budgets.fill(self.read_budget.0);
        self.reads.waiting.clear();
        self.reads.in_flight = None;
        // Decode-step time banked while a write layer ran stays with the decode steps: carried
        // into this prefill, its first grant (a 0-IOCB window of 1 ms, say) could release a
        // whole layer to run through its compute, in no window of it (`WriteQueue::drop_banked`).
        self.writes.drop_banked();
        self.prefill = Some(Prefill {
            id,
            input_tokens,
            prefix_tokens,
            retrieve,
            read_targets,
            next_layer: 0,
            in_layer: None,
            wait_for_all: false,
            planned: None,
            kv_resident: false,
            fallback,
            kv_wait: Duration::ZERO,
        });
        self.counters.prefills += 1;
        Ok(PrefillStart {
            id: PrefillId(id),
            cached_blocks: hit,
            queued_blocks: self.writes.index_of(id).map_or(0, |i| self.writes.stores[i].engine_blocks.len()),
        })
    }

    /// Before layer `layer` computes: the policy decides what to issue, the runtime issues it,
    /// then waits until the layer's cached KV is resident. Returns that wait (the bubble). The
    /// same as [`Runtime::begin_layer`] then [`Runtime::wait_layer_kv`], for an engine that does
    /// not run the layer's work before attention separately.
    pub fn before_layer(&mut self, id: PrefillId, layer: u32) -> Result<Duration> {
        self.begin_layer_as("before_layer", id, layer)?;
        self.wait_layer_kv(id, layer)
    }

    /// Layer `layer` begins: the policy decides what to issue and the runtime issues it; nothing
    /// is waited for. The engine may run the layer's work that needs no cached KV (norm, QKV
    /// projection), then calls [`Runtime::wait_layer_kv`] before attention. `Store` with the
    /// operation "poll the executor" (an executor error met beside writes in flight, with no
    /// read of this prefill to fail with it) leaves the prefill running: retry, or
    /// `abort_prefill`.
    pub fn begin_layer(&mut self, id: PrefillId, layer: u32) -> Result<()> {
        self.begin_layer_as("begin_layer", id, layer)
    }

    fn begin_layer_as(&mut self, call: &'static str, id: PrefillId, layer: u32) -> Result<()> {
        let layers = self.layers;
        let prefill = self.prefill_of(call, id)?;
        if let Some(open) = prefill.in_layer {
            // Named for what goes on: a layer begun but not waited for (a `before_layer` whose
            // wait failed, retried) needs `wait_layer_kv` first; `after_layer` would refuse it.
            let next = if prefill.kv_resident { "after_layer first" } else { "wait_layer_kv, then after_layer first" };
            return Err(RuntimeError::OutOfOrder { call, reason: format!("layer {open} has not ended ({next})") });
        }
        if layer != prefill.next_layer || layer >= layers {
            let expected = if prefill.next_layer == layers {
                "none: every layer is done, call end_prefill".to_string()
            } else {
                prefill.next_layer.to_string()
            };
            return Err(RuntimeError::OutOfOrder { call, reason: format!("layer {layer}, expected {expected}") });
        }
        let (input_tokens, prefix_tokens, fallback) = (prefill.input_tokens, prefill.prefix_tokens, prefill.fallback);
        let planned = prefill.planned.filter(|&(planned, _)| planned == layer).map(|(_, wait_for_all)| wait_for_all);
        self.progress()?;
        let mut wait_for_all = false;
        if let Some(planned) = planned {
            // A retry: this layer's plan was applied and handing it over failed (below). What
            // waits goes now (`progress` above); applying the plan again would count its
            // write grant twice.
            wait_for_all = planned;
        } else if fallback {
            for read_layer in 0..self.layers {
                self.decide_read(read_layer, self.read_budget.0);
            }
        } else {
            let view = layer_view(&self.profile, &mut self.reads, &self.writes, input_tokens, prefix_tokens, layer);
            let plan =
                self.policy.plan_layer(&view).map_err(|source| RuntimeError::Scheduler { policy: self.config.policy.name(), source })?;
            wait_for_all = plan.wait_for_all_reads;
            for issue in &plan.issues {
                self.apply(issue);
            }
        }
        if let Some(prefill) = self.prefill.as_mut() {
            prefill.planned = Some((layer, wait_for_all));
        }
        self.pump()?;
        if let Some(prefill) = self.prefill.as_mut() {
            prefill.planned = None;
            prefill.in_layer = Some(layer);
            prefill.wait_for_all = wait_for_all;
            prefill.kv_resident = false;
        }
        Ok(())
    }

    /// Before layer `layer`'s attention: returns once its cached KV is resident (every layer's,
    /// where the policy asked for that), and how long that took (the bubble). A second call in
    /// the same layer returns at once. `Store` with the operation "poll the executor" (as for
    /// `begin_layer`) leaves the prefill running: retry, or `abort_prefill`.
    pub fn wait_layer_kv(&mut self, id: PrefillId, layer: u32) -> Result<Duration> {
        let prefill = self.prefill_of("wait_layer_kv", id)?;
        if prefill.in_layer != Some(layer) {
            return Err(RuntimeError::OutOfOrder {
                call: "wait_layer_kv",
                reason: format!("layer {layer}, but the layer begun is {:?} (begin_layer first)", prefill.in_layer),
            });
        }
        if prefill.kv_resident {
            return Ok(Duration::ZERO);
        }
        let wait_for_all = prefill.wait_for_all;
        let started = Instant::now();
        self.wait_for_reads(if wait_for_all { None } else { Some(layer) })?;
        let waited = started.elapsed();
        self.counters.kv_wait += waited;
        if let Some(prefill) = self.prefill.as_mut() {
            prefill.kv_wait += waited;
            prefill.kv_resident = true;
        }
        Ok(waited)
    }

    /// After layer `layer` computed: its new KV is in engine memory and may be written. Called
    /// again for the layer that ended last (a retry after it failed advancing the queues), it
    /// only advances them.
    pub fn after_layer(&mut self, id: PrefillId, layer: u32) -> Result<()> {
        let prefill = self.prefill_of("after_layer", id)?;
        if prefill.in_layer.is_none() && prefill.next_layer.checked_sub(1) == Some(layer) {
            // The layer ended already: a retry of a call that failed after ending it (advancing
            // the queues, below: an issue the executor failed after publishing it) goes on.
            return self.progress();
        }
        if prefill.in_layer != Some(layer) {
            return Err(RuntimeError::OutOfOrder {
                call: "after_layer",
                reason: format!("layer {layer}, but the layer begun is {:?} (before_layer first)", prefill.in_layer),
            });
        }
        if !prefill.kv_resident && prefill.retrieve.is_some() {
            // Attention ran on KV that may not have landed: the engine skipped the wait.
            return Err(RuntimeError::OutOfOrder {
                call: "after_layer",
                reason: format!("layer {layer}'s cached KV was never waited for (wait_layer_kv before attention)"),
            });
        }
        prefill.in_layer = None;
        prefill.next_layer = layer + 1;
        if let Some(index) = self.writes.index_of(id.0) {
            self.writes.stores[index].ready_layers = layer + 1;
        }
        self.progress()
    }

    /// After the last layer: the request's reads are over; its writes stay queued for later slack.
    /// Returns the time this prefill waited for KV. Past its order checks (`OutOfOrder`,
    /// `StaleRequest`: nothing changed) the prefill ends whatever it returns: a failure after
    /// that is `PrefillEnded`, with the wait and the cause, not to be retried.
    pub fn end_prefill(&mut self, id: PrefillId) -> Result<Duration> {
        let layers = self.layers;
        let prefill = self.prefill_of("end_prefill", id)?;
        if prefill.in_layer.is_some() || prefill.next_layer != layers {
            return Err(RuntimeError::OutOfOrder {
                call: "end_prefill",
                reason: format!("{} of {layers} layers ended (in layer: {:?})", prefill.next_layer, prefill.in_layer),
            });
        }
        let context_tokens = prefill.input_tokens;
        let kv_wait = prefill.kv_wait;
        let ended = |source| RuntimeError::PrefillEnded { request: id.0, kv_wait, source: Box::new(source) };
        // The prefill ends here, whatever follows: its retrieve is finished (every layer waited
        // for its own reads, so none is in flight) and its target blocks are the engine's again.
        // The handle is let go only once finished: refused, it retires with its targets held if
        // the object store still holds a layer of it (`end_reads`), rather than leaking its
        // request slot. The store's new KV was computed on that prefix: it is dropped too.
        if let Err(error) = self.end_reads() {
            if let Err(dropped) = self.drop_store(id.0) {
                tracing::warn!(error = %dropped, "runtime: dropping the store of a prefill whose retrieve could not be finished");
            }
            return Err(ended(error));
        }
        if let Some(index) = self.writes.index_of(id.0) {
            self.writes.stores[index].prefill_ended = true;
        }
        // A failure from here on comes after the prefill ended: `PrefillEnded` says so (and a
        // retry would be `StaleRequest`).
        let view = queue_view(&self.profile, &mut self.reads, &self.writes, context_tokens);
        let issues = self
            .policy
            .plan_prefill_end(&view)
            .map_err(|source| ended(RuntimeError::Scheduler { policy: self.config.policy.name(), source }))?;
        for issue in &issues {
            self.apply(issue);
        }
        self.progress().map_err(ended)?;
        Ok(kv_wait)
    }

    /// Ends a prefill early (the engine gave up on the request): waits (bounded) for its read
    /// and write in flight, drops its retrieve and its store (nothing of it becomes visible).
    /// The prefill is over whatever it returns. `Ok` when nothing of the request is left on the
    /// device; otherwise an error (`StillInFlight`, or `ReadFailed` for a read that timed out)
    /// and the request is retiring: its engine blocks are not `releasable` until the device ends
    /// that layer.
    pub fn abort_prefill(&mut self, id: PrefillId) -> Result<()> {
        self.prefill_of("abort_prefill", id)?;
        if self.reads.in_flight.is_some() {
            if let Err(error) = self.wait_read() {
                // The failure ended the prefill (its retrieve and store) already; the request is
                // given up anyway, so only something of it still in flight is worth an error.
                return if self.writes.is_retiring(id.0) { Err(error) } else { Ok(()) };
            }
        }
        // Both always run: a retrieve left in flight must not keep the store queued.
        let reads = self.end_reads();
        let store = self.drop_store(id.0);
        reads.and(store)
    }

    /// Before a decode step over `context_tokens` tokens: queued writes go into the step's slack
    /// as the policy decides. Not while a prefill runs. A context before the table's first decode
    /// row is priced as that row. Call it once per step: one that failed advancing the queues
    /// (handing a layer over before or after planning, say) has applied the step's grant
    /// already, the first error returned (the layer is collected by the next call; go on with
    /// [`Runtime::poll_io`]), and a second call for the same step grants its slack twice. Only
    /// a [`RuntimeError::Scheduler`] (the policy could not plan) applies nothing.
    pub fn decode_step(&mut self, context_tokens: u32) -> Result<()> {
        if let Some(active) = &self.prefill {
            return Err(RuntimeError::OutOfOrder {
                call: "decode_step",
                reason: format!("request {} is in prefill (end_prefill first)", active.id),
            });
        }
        // A failure here (a layer handed over, say) still lets the step plan and apply its
        // grant: the engine goes on with `poll_io`, not another `decode_step` for this step, so
        // returning before planning lost the step's slack for good. The first error is returned.
        let progressed = self.progress();
        // A context before the table's first decode row is priced as that row: the shortest
        // step the table knows (at short contexts a decode step is bound by the weights, about
        // as long). Before, such a step wrote nothing: with rows from 4096 (the analytic
        // table's default input step) short requests never drained the queue, and under
        // `Refuse` every later store was refused until `drain`.
        // `Profile::decode_pricing_context`: the rule the simulator prices steps by too.
        let priced_as = self.profile.decode_pricing_context(context_tokens);
        let view = queue_view(&self.profile, &mut self.reads, &self.writes, priced_as);
        match self.policy.plan_decode_step(&view) {
            Ok(issues) => {
                for issue in &issues {
                    // Window time while a write layer is outstanding: banked for the next
                    // layer, released by the first grant after this one ends
                    // (`WriteQueue::bank_time`), not behind it.
                    let bank = issue.kind == IoKind::Write && issue.after_reads && issue.iocb_count == 0;
                    if bank && self.writes.outstanding_layers() > 0 {
                        let budget = issue.sm_budget.clamp(1, self.write_budget.0);
                        let profile = &self.profile;
                        self.writes.bank_time(issue.slack_us, |iocbs| {
                            profile.io_duration_us(IoKind::Write, iocbs, budget).unwrap_or(f64::from(iocbs))
                        });
                    } else {
                        self.apply(issue);
                    }
                }
            }
            // Any error, `OutOfRange` included: validation refuses a table with no decode row
            // and the step is priced at or past the first row, so no table reaches a step the
            // policy cannot price. Taken as "no decode row, nothing written" (a table fallback),
            // it once hid whatever had gone wrong instead.
            Err(source) => {
                progressed?;
                return Err(RuntimeError::Scheduler { policy: self.config.policy.name(), source });
            }
        }
        let pumped = self.pump();
        progressed.and(pumped)
    }

    /// Advances the queues without a decision: reaps completions, commits finished stores,
    /// issues what waits. Engines may call it at any time (it never blocks).
    pub fn poll_io(&mut self) -> Result<()> {
        self.progress()
    }

    /// Writes and commits every queued store now (not while a prefill runs), and waits (one
    /// `io_timeout` at most) for the retiring requests to end. `DrainIncomplete` if a store is
    /// still queued or a request still retiring afterwards.
    pub fn drain(&mut self) -> Result<()> {
        if let Some(active) = &self.prefill {
            return Err(RuntimeError::OutOfOrder { call: "drain", reason: format!("request {} is in prefill", active.id) });
        }
        self.writes.decide_all(self.write_budget.0);
        // Each pass completes a write layer or commits (or fails) a store.
        let bound = (self.writes.stores.len() + 1) * (self.layers as usize + 2);
        for _ in 0..bound {
            self.progress()?;
            if self.writes.stores.is_empty() {
                break;
            }
            if let Some(timeout) = self.wait_writes()? {
                // The layer stays in flight and its store queued: waiting longer cannot end a
                // lost completion. The retiring requests are still waited for, and the answer
                // says what is left.
                tracing::warn!(error = %timeout, "runtime: a write timed out while draining");
                break;
            }
        }
        self.progress()?;
        if !self.writes.retiring.is_empty() {
            self.wait_retiring()?;
        }
        if self.writes.stores.is_empty() && self.writes.retiring.is_empty() {
            return Ok(());
        }
        Err(RuntimeError::DrainIncomplete { queued_stores: self.writes.stores.len(), retiring: self.writes.retiring.len() })
    }

    /// Drains the write queue and gives the store back. If draining fails (a write that timed
    /// out, a request still retiring, a prefill still running) the runtime comes back in the
    /// error, store and all: nothing the device may still be doing is dropped with it. The
    /// engine then drains again, calls [`Runtime::abandon_in_flight`], or gives up with
    /// [`Runtime::into_store`] and `KvStore::close`, whose answer says whether its KV memory
    /// may be freed.
    pub fn finish(mut self) -> std::result::Result<(KvStore<E>, RuntimeCounters), Box<FinishError<E>>> {
        match self.drain() {
            Ok(()) => Ok((self.store, self.counters)),
            Err(error) => Err(Box::new(FinishError { error, runtime: Box::new(self) })),
        }
    }

    /// Gives the store back as it is, without draining: stores still queued are never
    /// committed, and anything in flight stays in flight until the store is closed (whose
    /// answer says whether the engine may free its KV memory) or dropped (the same, unheard).
    /// For an engine giving up after [`Runtime::finish`] failed.
    pub fn into_store(self) -> (KvStore<E>, RuntimeCounters) {
        (self.store, self.counters)
    }
}

impl<E: QueuePairReset> Runtime<E> {
    /// After a wait timed out on a CPU executor (a completion the device lost, or a device that
    /// stopped answering), which waiting longer cannot end: ends every layer in flight by
    /// replacing the executor's queue pairs (`KvStore::abandon_in_flight`), then finishes the
    /// retiring requests (their engine blocks become releasable) and hands the healthy layers it
    /// ended to the executor again (the running prefill's read, the oldest store's write).
    /// Returns the layers abandoned, once the reset succeeded: should handing a layer over again
    /// fail (logged), the layer waits and the next call (`before_layer`, `poll_io`, ...) hands it
    /// over; an executor error met then (reported once, by the poll that starts the layers
    /// handed over) is kept for them, and the next call fails them with it: a read as a poll of
    /// its own would have (`ReadFailed`, the prefill ended), writes with `Store` "poll the
    /// executor", their stores left queued (a failed poll of a write's own would have dropped
    /// its store). If a queue pair cannot be deleted the error says so and
    /// nothing is released: the controller must be reset first. An error after the reset (while
    /// reaping the completions it posted) may have ended some layers and not others: those the
    /// object store no longer holds in flight are handed back to be issued again, as above, and
    /// the rest stay in flight (collected by a later call, they end as timed out: a read ends
    /// its prefill, a write drops its store). A GPU executor needs none of this (it resets its
    /// queue pairs itself; the runtime retires its layers as they fail).
    pub fn abandon_in_flight(&mut self) -> Result<usize> {
        // An executor error kept for the live I/O concerned the queue pairs being replaced:
        // forgotten, as the queue forgets those it kept (`GioQueue::reset_queue_pairs`), or it
        // would fail the first layer handed over again.
        if let Some(error) = self.executor_failure.take() {
            tracing::warn!(%error, "runtime: an executor error no live I/O heard is forgotten: it concerned the queue pairs the reset replaces");
        }
        let abandoned = match self.store.abandon_in_flight() {
            Ok(abandoned) => abandoned,
            Err(source) => {
                // It may have failed after the reset, while reaping: the layers it reaped before
                // the error have ended unfilled (as TIMEOUT) and are no longer in flight in the
                // object store, the others still are. Left in flight here, a reaped read was
                // taken as completed by the next poll (the store had nothing of it in flight)
                // and its layer's wait returned on blocks the device never filled.
                self.requeue_abandoned(|runtime, handle, layer| !runtime.device_holds_layer(handle, layer));
                return Err(store_error("abandon the layers in flight")(source));
            }
        };
        self.requeue_abandoned(|_, _, _| true);
        // An executor error met here (logged) came after the reset: it concerns the fresh queue
        // pairs, and the layers about to be handed over again, not the ended ones, have to hear
        // it (kept by `retire_ended`, as the reissue's below).
        self.retire_ended();
        // The reset is done and every layer it ended is requeued: an error here is the reissue's
        // (an issue refused before publishing), not the abandon's, and the error this call
        // returns tells the engine to reset the controller. The layers refused wait, and the
        // next call hands them over; one published before the failure is in flight as usual
        // (`pump_layers`). An executor error met by the poll that starts the layers handed over
        // (the first since the reset, which forgot those kept before it, so gio-uring reports
        // it there, once) `pump` keeps for them, as in any call: the next call fails them with
        // it (`advance`).
        if let Err(error) = self.pump() {
            tracing::warn!(%error, "runtime: handing the abandoned layers over again failed; the next call hands them over");
        }
        Ok(abandoned)
    }

    /// Hands the layers in flight that `ended(handle, layer)` says the object store abandoned
    /// back to be issued again: the running prefill's read waits first in line, a store's
    /// write is issued again when its turn comes. Each is closed in the event log (it is
    /// issued, and logged, again).
    fn requeue_abandoned(&mut self, ended: impl Fn(&Self, RequestHandle, u32) -> bool) {
        let retrieve = self.prefill.as_ref().and_then(|p| p.retrieve);
        if let Some(layer) = self.reads.in_flight {
            // A read in flight always has its retrieve; without one, nothing of it can be.
            if retrieve.is_none_or(|handle| ended(self, handle, layer)) {
                self.reads.in_flight = None;
                self.reads.waiting.push_front(layer);
                let request = self.prefill.as_ref().map_or(0, |p| p.id);
                self.record(request, IoDirection::Read, layer, IoEventKind::Completed, None);
            }
        }
        for index in 0..self.writes.stores.len() {
            let store = &self.writes.stores[index];
            let Some(layer) = store.in_flight else { continue };
            if ended(self, store.handle, layer) {
                let request = store.request;
                self.writes.stores[index].in_flight = None;
                self.record(request, IoDirection::Write, layer, IoEventKind::Completed, None);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use scheduler::analytic::{build_table, AnalyticGrid, GpuSpec, ModelConfig};
    use scheduler::ssd::SsdModel;
    use scheduler::table::IoCostEntry;

    use super::*;

    fn profile() -> Profile {
        let grid = AnalyticGrid { input_step_tokens: 64, input_step_count: 2, prefix_step_tokens: 64, io_sms: 4, decode_step_tokens: 64 };
        let io_costs = SsdModel::tutti_two_ssds().cost_table(1 << 20, 16, &[2, 4]).expect("cost table");
        let table = build_table(&ModelConfig::llama3_8b(), &GpuSpec::h100(), &grid, io_costs, "analytic (test)").expect("table");
        Profile::from_table(table).expect("valid table")
    }

    /// A prefill's reads as `begin_prefill` leaves them: every layer unissued, on the largest
    /// budget until decided.
    fn reads(layers: usize, iocbs_per_layer: u32, largest: u32) -> Reads {
        let mut reads = Reads::new(layers, largest);
        reads.unissued_iocbs.fill(iocbs_per_layer);
        reads.iocbs_per_layer = iocbs_per_layer;
        reads.done.fill(false);
        reads
    }

    /// As `pump_layers` hands the first waiting read over once the one ahead completed.
    fn hand_over(reads: &mut Reads) {
        if let Some(done) = reads.in_flight.take() {
            reads.done[done as usize] = true;
        }
        reads.in_flight = reads.waiting.pop_front();
    }

    #[test]
    fn the_layer_view_prices_each_read_layer_on_its_own_budget_where_fewer_sms_are_faster() {
        // Goal: on a table where fewer SMs are faster (reads 100 µs per IOCB on 2 SMs, 150 on
        // 4: docs/scheduler.md's measured io table has 1 SM faster than 2), a layer handed over
        // on 4 SMs is priced on the 4-SM rows though a run-ahead layer waits on 2. Priced
        // together on the smallest budget, both went at 100 µs per IOCB and the 4-SM layer was
        // taken for faster than it runs: the next plan placed writes into time it still took.
        let mut rows = Vec::new();
        for (kind, per_iocb_2_us, per_iocb_4_us) in [(IoKind::Read, 100.0, 150.0), (IoKind::Write, 300.0, 200.0)] {
            for (sm_budget, per_iocb_us) in [(2, per_iocb_2_us), (4, per_iocb_4_us)] {
                for iocb_count in [1u32, 2, 4, 8] {
                    let bytes = u64::from(iocb_count) << 20;
                    rows.push(IoCostEntry { kind, iocb_count, sm_budget, duration_us: per_iocb_us * f64::from(iocb_count), bytes });
                }
            }
        }
        let grid = AnalyticGrid { input_step_tokens: 64, input_step_count: 2, prefix_step_tokens: 64, io_sms: 4, decode_step_tokens: 64 };
        let table = build_table(&ModelConfig::llama3_8b(), &GpuSpec::h100(), &grid, rows, "analytic (test)").expect("table");
        let profile = Profile::from_table(table).expect("valid table");
        let writes = WriteQueue::new(64, 4);
        let mut reads = reads(4, 2, 4);
        reads.decide(0, 4);
        reads.decide(1, 2);
        hand_over(&mut reads);
        let view = layer_view(&profile, &mut reads, &writes, 64, 64, 1);
        let on_own_budgets_us = profile.io_duration_us(IoKind::Read, 2, 4).unwrap() + profile.io_duration_us(IoKind::Read, 2, 2).unwrap();
        assert_eq!(on_own_budgets_us, 500.0);
        assert_eq!(view.outstanding_reads_us().unwrap(), on_own_budgets_us);
    }

    #[test]
    fn the_layer_view_prices_reads_on_the_budget_a_run_ahead_layer_went_out_on() {
        // Goal: a run-ahead layer the policy placed partly in a 2-SM window goes whole on 2 SMs
        // (`Reads::decide`), and the next plan's view says so (`outstanding_reads_by_budget`),
        // so that the policy does not take it for its time on the table's largest budget (4)
        // and place writes into time it still takes. Before, the view had no read budget and
        // the policy priced every outstanding read on the largest.
        let profile = profile();
        let writes = WriteQueue::new(64, 4);
        let mut reads = reads(4, 2, 4);
        let room = reads.by_budget.as_ptr();
        // Layer 0's plan: its own KV at once on the largest, layer 1 in a 4-SM window, layer 2
        // run ahead partly into a 2-SM window (the rest of it unissued by the policy).
        reads.decide(0, 4);
        reads.decide(1, 4);
        reads.decide(2, 2);
        hand_over(&mut reads);
        let on = |sm_budget, iocbs, kernels| ReadsOnBudget { sm_budget, iocbs, kernels };
        let view = layer_view(&profile, &mut reads, &writes, 64, 64, 1);
        assert_eq!((view.outstanding_read_iocbs, view.outstanding_read_kernels), (6, 3));
        // Layer 0 in flight and layer 1 waiting on 4 SMs, layer 2 waiting on 2: each budget
        // priced on its own rows.
        assert_eq!(view.outstanding_reads_by_budget, [on(4, 4, 2), on(2, 2, 1)]);
        // Layers 0 and 1 done: the run-ahead layer alone, in flight on its 2 SMs.
        hand_over(&mut reads);
        hand_over(&mut reads);
        assert_eq!(reads.in_flight, Some(2));
        let view = layer_view(&profile, &mut reads, &writes, 64, 64, 2);
        assert_eq!((view.outstanding_read_iocbs, view.outstanding_reads_by_budget), (2, &[on(2, 2, 1)][..]));
        assert_eq!(queue_view(&profile, &mut reads, &writes, 64).outstanding_reads_by_budget, [on(2, 2, 1)]);
        // A layer whose plan also placed some of it on 4 SMs before its handover goes on 4.
        reads.decide(3, 2);
        reads.decide(3, 4);
        hand_over(&mut reads);
        assert_eq!(layer_view(&profile, &mut reads, &writes, 64, 64, 3).outstanding_reads_by_budget, [on(4, 2, 1)]);
        // Nothing outstanding: no entry.
        hand_over(&mut reads);
        assert_eq!(layer_view(&profile, &mut reads, &writes, 64, 64, 3).outstanding_reads_by_budget, []);
        // Every entry was built in the room `Reads::new` reserved for them: no view allocated.
        assert_eq!(reads.by_budget.as_ptr(), room, "a view moved the entries to another allocation");
        assert_eq!(reads.by_budget.capacity(), 4);
    }
}
