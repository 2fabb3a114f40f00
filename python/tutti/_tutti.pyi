"""Type stub of `tutti._tutti`, the compiled extension (crates/python). Everything here is
re-exported by `tutti` (python/tutti/__init__.py): import it from there.

This file is the API contract the engine connectors (tutti.vllm, tutti.sglang) code against.
Changes after its first commit are additions only, or are announced in
/work/wt/prompts/py-api-changes.md.

Units: sizes and addresses in bytes (`*_bytes`, `address`), times in seconds (`*_s`, floats),
layers and engine blocks as 0-based indices, tokens as sequences of non-negative ints (< 2**32).

Where things run (docs/python.md):
- `Store.open(...)`: the pool's devices (the software NVMe controller `emu:...`, or `vfio:BDF`
  on a machine with VFIO) are opened in this process; no daemon. One process per pool (the same
  lock tuttid takes).
- `Store.attach(...)`: the pool belongs to a `tuttid` daemon; this process moves its own KV bytes
  over a queue pair the daemon created in its shared memory window; per request it asks the
  daemon (lookup, prepare, commit, release), per layer it sends nothing.
- `LookupClient.connect(...)`: a session with tuttid that only looks up (an engine's scheduler
  process): no memory, no queue pairs.

Threads: every object may be used from any thread; calls on one `Store` (and its requests) are
serialised by a lock inside it. Blocking calls (`wait`, `commit`, `prepare_*`, `attach`,
`open`, lookups through the daemon) release the GIL.
"""

from __future__ import annotations

import builtins
from typing import Any, Literal, Optional, Sequence, Union

__version__: str

# ---------------------------------------------------------------------------------------------
# Exceptions. Each carries the Rust error's message (str(e)), which says what was expected, what
# was found and, where there is one, what to do about it.
# ---------------------------------------------------------------------------------------------

class Error(Exception):
    """Base of every error tutti raises (besides TypeError for arguments of the wrong Python
    type, raised by the bindings before anything runs)."""

class InvalidArgument(Error, ValueError):
    """A value the store cannot accept: a model geometry out of range, a registration whose
    tensors do not match the geometry (size, shape, dtype, contiguity, alignment, overlap), block
    ids outside the registration, a layer past the model's layers, tokens of fewer than one block,
    a malformed device string, a fingerprint that is not 32 bytes, a daemon's `BadRequest`."""

class UnsupportedMemory(InvalidArgument):
    """Memory the store cannot reach: a tensor on a device other than the CPU and CUDA; CUDA
    memory with an in-process store (only a store attached to tuttid started with
    --device-memory cuda reaches it, and only where a CUDA driver can be loaded); or, for a store
    attached to tuttid, CPU memory this process allocated itself (the daemon can only map memory
    shared with it: allocate the KV cache with `Store.allocate_kv`)."""

class NotRegistered(Error):
    """A call that needs the engine's KV memory (prepare_*, lookup on an in-process store) before
    `Store.register_kv` or `Store.allocate_kv`."""

class TimeoutError(Error, builtins.TimeoutError):
    """A wait's deadline passed (the layer is still in flight: wait again, or close the store),
    or tuttid did not answer within the store's `timeout_s`."""

class LimitReached(Error):
    """A bounded resource is exhausted: too many requests prepared at once (`requests_max`), no
    free IOCBs for a prepare (each prepared request holds `layers_in_flight` sets, so
    requests_max x layers_in_flight should not exceed `iocbs`: the message says so; raise `iocbs`),
    or a per-session cap of tuttid (requests, windows, window bytes). Finish requests, or raise
    the limit."""

class PoolFull(LimitReached):
    """The pool has no free or evictable slot for a store's new blocks (the rest are pinned by
    requests in flight). Finish requests or store fewer blocks."""

class StaleRequest(Error):
    """A request handle that is finished, committed, of another session, or of a closed store."""

class InvalidState(Error):
    """A call out of order on a live request: issuing a layer while another is in flight (wait
    first), a store call on a retrieve (or the reverse), committing before every layer was
    stored, finishing with a layer in flight."""

class IntegrityError(Error):
    """A retrieved block's bytes did not match the CRC recorded when it was stored
    (`verify_retrieves=True`). The block was evicted; the request's other blocks were delivered;
    do not use the named engine blocks' bytes."""

class PoolError(Error):
    """The pool on the devices cannot be used as asked: none there (open with `format=True`),
    a damaged superblock, another format version, formatted for another model geometry, a
    namespace too small, too few queue pairs on a controller. Also raised in-process by a
    `prepare_store` that must evict a slot (or clear one a failed commit left), or a `commit`,
    once the pool's header generation count is exhausted (another tool wrote a header claiming a
    generation no pool reaches, and the pool counted on from it; only a reformat lets the pool
    commit again); through tuttid
    that refusal is a `DaemonError` with `code` "StoreFailed"."""

class DeviceError(Error):
    """A device failed: it could not be opened or brought up (missing `emu:` file, a VFIO
    error), or an NVMe command, DMA mapping or gio_uring operation failed."""

class DaemonError(Error):
    """tuttid refused or failed a request in a way no other class describes (`code` names the
    daemon's error code, e.g. "Busy", "Unsupported", "StoreFailed"). A reply that does not answer
    its request (of another kind, a body that does not decode, a lookup count out of range) is
    `Disconnected`: the client no longer uses that connection."""

    code: Optional[str]
    """The daemon's error code name, or None when the error is not a daemon refusal."""

class Disconnected(DaemonError):
    """The connection to tuttid failed or is gone: no daemon at the socket, the daemon closed the
    connection (it stopped, the session's lease expired), a socket error, or a reply that does not
    answer its request (of another kind, a body that does not decode, a lookup count out of
    range), after which the connection is out of step. Reconnect with a new `Store.attach` /
    `LookupClient.connect`; nothing of an uncommitted store survives."""

# ---------------------------------------------------------------------------------------------
# Model geometry
# ---------------------------------------------------------------------------------------------

class ModelGeometry:
    """The shape of a model's KV cache as the store sees it (objstore's `ModelGeometry`).

    An *object* is one layer's K (or V) of one engine block: block_tokens x kv_heads x head_dim x
    dtype_bytes bytes. Raises InvalidArgument if a field is 0 or above 65536, or an object is over
    1 GiB."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, block_tokens: int) -> None: ...
    @staticmethod
    def preset(name: str, block_tokens: int) -> ModelGeometry:
        """`llama3-8b`, `qwen3-32b`, `llama3-70b`. Raises InvalidArgument for another name."""
    @property
    def layers(self) -> int: ...
    @property
    def kv_heads(self) -> int:
        """KV heads of this rank (after tensor-parallel sharding)."""
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype_bytes(self) -> int:
        """Bytes per element (2 for bf16/fp16, 1 for fp8)."""
    @property
    def block_tokens(self) -> int:
        """Tokens per engine block (the engine's block/page size)."""
    @property
    def object_bytes(self) -> int:
        """Bytes of one layer's K (or V) of one block."""
    @property
    def block_bytes(self) -> int:
        """Bytes of one engine block over all layers, K and V: 2 x layers x object_bytes."""
    def __eq__(self, other: object) -> bool: ...
    def __repr__(self) -> str: ...

# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------

TensorLike = Any
"""What a KV layout accepts as one tensor, tried in this order:
- a `KvBuffer` (memory tutti allocated) or a `RawMemory` (address + size + device + owner);
- an object with `__dlpack__` / `__dlpack_device__` (a torch tensor, a numpy array, ...): asked
  with `max_version=(1, 0)` (a DLPack 1.0 capsule, which says whether the memory is read-only
  and whether it is a copy the producer made: one flagged read-only or IS_COPIED raises
  InvalidArgument, as retrieves would not reach the tensor), and again without arguments when the producer
  raises TypeError at that keyword (a legacy capsule, which cannot say so: taken as writable). The
  DLPack capsule is consumed and kept, with the object, until the store is closed. That keeps
  the tensor object alive, not its memory: a producer may still free or move the memory under a
  live tensor (torch: `resize_`, `set_`, `untyped_storage().resize_(0)`), and the store would
  go on naming it (the device writes there). Never resize or `set_` a registered tensor or its
  storage before the store's close();
- an object with the buffer protocol (bytearray, mmap, array.array, numpy, ctypes arrays): it
  must be writable and C-contiguous (formats "B", "b", "c", after at most one byte-order
  character, are raw bytes); the export is held (so it cannot be resized or freed) until the
  store is closed.
Its device must be the CPU (DLPack device type 1 or 3, "cpu") or CUDA (DLPack device type 2,
"cuda:N"; registered only through tuttid, see Store.register_kv); anything else raises
UnsupportedMemory. The DLPack capsule's device decides: a capsule of another device type (or
CUDA device) than `__dlpack_device__` named raises InvalidArgument, and so does a capsule that
cannot be imported (already consumed, more than 32 dimensions, no shape, a DLPack major version
other than 1, a dtype of a fraction of a byte such as int4), naming the tensor. Its element size
must be the geometry's dtype_bytes, or 1 (raw bytes, e.g. uint8); another raises InvalidArgument.
torch is never imported by tutti."""

class RawMemory:
    """Memory named by address and size (a tensor's `data_ptr()` and byte size), for producers
    without DLPack or the buffer protocol.

    The caller promises that `address .. address + nbytes` is memory of this process, readable
    and writable, that stays valid as long as `owner` lives: the store keeps a reference to
    `owner` (not to the memory) until it is closed. A wrong promise is undefined behaviour (the
    device writes there); prefer DLPack where the producer offers it.

    `device`: "cpu", or "cuda" / "cuda:N" (GPU memory: `address` is a device pointer, e.g. a
    CUDA tensor's `data_ptr()`, registered through tuttid as for a DLPack CUDA tensor; see
    Store.register_kv), or another name (raises UnsupportedMemory when registered). `itemsize`: bytes per element (checked against the
    geometry's dtype_bytes; 1 = raw bytes). `shape` / `strides_bytes`: optional, as DLPack gives
    them (strides in bytes); without them the memory is one dense 1-D run of bytes.
    Raises InvalidArgument if nbytes is 0, address is 0, address + nbytes overflows, or the
    shape and strides name memory outside `address .. address + nbytes` (past nbytes, or before
    the address through a negative stride)."""

    def __init__(
        self,
        address: int,
        nbytes: int,
        *,
        owner: object,
        device: str = "cpu",
        itemsize: int = 1,
        shape: Optional[Sequence[int]] = None,
        strides_bytes: Optional[Sequence[int]] = None,
    ) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> str: ...

class DeviceMemoryStandIn:
    """The CPU stand-in for GPU memory: `nbytes` of a sealed memfd mapped in this process,
    handed out in place as CPU memory (`__dlpack__`, `numpy()`). Tensors over it registered
    with a store attached to tuttid go the GPU route (one allocation, exported as device
    memory; tuttid started with --device-memory memfd maps the memfd and reaches it only by
    copies, as it reaches GPU memory), so that route runs on machines without a GPU (tests).
    With an in-process store it is plain CPU memory. Raises InvalidArgument (nbytes 0 or over
    1 TiB), DeviceError (the memfd could not be made)."""

    def __init__(self, nbytes: int) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[object] = None,
        max_version: Optional[tuple] = None,
        dl_device: Optional[tuple] = None,
        copy: Optional[bool] = None,
    ) -> object: ...
    def __dlpack_device__(self) -> tuple: ...
    def numpy(self) -> Any:
        """`numpy.from_dlpack(self)`: a 1-D uint8 view (imports numpy); writable with numpy >=
        2.2.5 only, as KvBuffer.numpy()."""

class KvBuffer:
    """A piece of KV memory that tutti allocated (`Store.allocate_kv`): page aligned, zeroed at
    allocation, reachable by the store's devices (for a store attached to tuttid: inside the
    shared window the daemon mapped). It stays valid as long as the store or any consumer of it
    (a DLPack capsule taken from it, a numpy array or torch tensor made from one) lives.

    Zero-copy views: `numpy.from_dlpack(buffer)` / `torch.from_dlpack(buffer)` give a 1-D uint8
    array over it; reinterpret and reshape it to the engine's dtype and shape there (e.g.
    `torch.from_dlpack(b).view(torch.bfloat16).view(num_blocks, ...)`).

    Do not read or write a block while a layer of a request naming it is in flight: the device
    moves those bytes then (the same rule as for GPU KV memory)."""

    @property
    def address(self) -> int:
        """The first byte's address in this process."""
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> str:
        """Always "cpu" today."""
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule of a 1-D uint8 tensor over the buffer, holding a reference to it:
        "dltensor_versioned" (DLPack 1.0, flagged writable) when `max_version` >= (1, 0) is
        given (numpy 2 and torch ask for it; numpy imports legacy capsules read-only), else
        the legacy "dltensor". `copy=True` and a dl_device other than the CPU raise BufferError
        (nothing is ever copied)."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """(1, 0): the CPU."""
    def numpy(self) -> Any:
        """`numpy.from_dlpack(self)`: a 1-D uint8 view (imports numpy). Writable with numpy >=
        2.2.5; earlier numpy imports every DLPack capsule read-only (numpy/numpy#28599): write
        through `torch.from_dlpack(self)` there."""

KvLayoutKind = Literal["separate", "fused", "paged", "block_major"]

class KvLayout:
    """How the engine's KV cache lies in memory, and the tensors that hold it: what
    `Store.register_kv` takes and `Store.allocate_kv` returns. Built with one of the static
    methods; the store checks it against its geometry when it is registered (not here), and
    the tensors are held while the store lives (see TensorLike: a DLPack tensor's object, not
    its storage).

    num_blocks N is taken from the tensors (their leading block dimension, or for a 1-D tensor
    its bytes over the bytes per block); every tensor of a layout must give the same N and the
    same block stride. In each kind, a block's part of a tensor (one object, or K+V of one
    layer) must be one dense run of bytes (its dimensions after the block dimension dense in some
    order: a permuted view is fine in separate, fused and paged, padding inside a block is not;
    block_major has an order of its own, see there); blocks may be spaced further apart than
    their size (a block stride larger than the block)."""

    @staticmethod
    def separate(keys: Sequence[TensorLike], values: Sequence[TensorLike]) -> KvLayout:
        """One K and one V tensor per layer, each `[N, block_tokens, kv_heads, head_dim]` (any
        shape whose dimensions after the first make one object: object_bytes per block).
        `keys[l]` / `values[l]` are layer l's. objstore `KvLayout::SeparateKv`."""
    @staticmethod
    def fused(layers: Sequence[TensorLike]) -> KvLayout:
        """One tensor per layer `[2, N, ...]`: K of block b at index [0, b], V at [1, b]
        (vLLM's FlashAttention layout `(2, num_blocks, block_size, kv_heads, head_size)`).
        objstore `KvLayout::FusedPerLayer`."""
    @staticmethod
    def paged(layers: Sequence[TensorLike]) -> KvLayout:
        """One tensor per layer `[N, ...]` whose block b is one dense run of 2 x object_bytes
        holding K and V in any arrangement: vLLM 0.32's `[blocks, heads, slots, content]` view
        with K and V together in each slot's content, FlashInfer's `(num_blocks, 2, block_size,
        kv_heads, head_size)`, SGLang's page-first host pool per layer. The store moves the
        block's bytes as they are: its first half as the layer's "K" object and its second half as
        "V" (so a pool written in this layout must be read back in this layout). objstore
        `KvLayout::PagedPerLayer`."""
    @staticmethod
    def block_major(tensor: TensorLike) -> KvLayout:
        """One tensor `[N, layers, 2, ...]`: all layers of a block together, layer l's K then V
        (tuttid's own window layout, SGLang's page-first host pool over all layers). objstore
        `KvLayout::BlockMajor`. The store reads layer l's K at 2 x l x object_bytes into a block
        and its V object_bytes after it, so the order in memory matters here: after the block
        dimension the tensor must be `[layers, 2, ...]` or `[2 x layers, ...]` with those
        dimensions in memory order (dimensions of size 1 aside), or one flat dimension of a
        block's bytes; `[N, 2, layers, ...]` or a view that permutes the layer and K/V
        dimensions raises InvalidArgument (per-layer I/O would move another layer's bytes)."""
    @property
    def kind(self) -> KvLayoutKind: ...
    @property
    def tensors(self) -> list[Any]:
        """The objects given (or, from allocate_kv, the KvBuffers), in the constructor's order:
        separate: keys then values (2 x layers); fused, paged: one per layer; block_major: one."""
    def key(self, layer: int) -> Any:
        """separate only: layer's K tensor. Raises InvalidArgument for another kind."""
    def value(self, layer: int) -> Any:
        """separate only: layer's V tensor."""
    def layer(self, layer: int) -> Any:
        """fused and paged: layer's tensor; block_major: the one tensor."""
    @property
    def num_blocks(self) -> Optional[int]:
        """N once the layout was checked by a store (registered or allocated), else None."""
    @property
    def block_stride_bytes(self) -> Optional[int]:
        """Bytes from one block to the next in each tensor, once checked by a store."""

# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------

class Store:
    """A layer-wise KV store (objstore's `LayerKvStore`): in-process over the pool's devices
    (`Store.open`) or attached to tuttid (`Store.attach`); the same calls either way.

    Life: open/attach -> register_kv (caller's memory, in-process) or allocate_kv (memory tutti
    allocates: the only way for an attached store) -> per request: lookup, prepare_retrieve /
    prepare_store -> per layer retrieve_layer / store_layer and wait (or poll, or select on
    fileno()) -> commit (a store) or finish -> close.

    A context manager: `with Store.open(...) as store:` closes it at the end. Closing finishes
    every request still prepared (waiting up to `timeout_s` for every layer in flight), deletes the
    store's queue pairs, and only then drops the references to the registered tensors. If a
    queue pair could not be deleted (its commands may still move bytes) the references are
    kept for the life of the process and counted in `leaked_registrations()`.

    One process: a store belongs to the process that opened or attached it. A child forked
    from it inherits the same socket, queue pairs and memory as the parent's, so there every
    call of the store and of its requests that reaches them (close too; fixed properties such
    as geometry or handle still answer) raises InvalidState ("inherited across fork: open or
    attach again in the child"; kv too), and dropping it there neither waits, nor
    finishes, nor releases anything: the child keeps the memory it inherited, unused, until it
    exits. The child's copies of the descriptors holding the parent's session or devices (the
    socket to tuttid, device locks and files, VFIO) are closed at the fork, so the parent's
    close ends its session and frees its devices while the child lives; the parent's store goes
    on as if there were no child. Open or attach a store of its own
    in the child (multiprocessing: the "spawn" or "forkserver" start method)."""

    @staticmethod
    def open(
        devices: Union[str, Sequence[str]],
        geometry: ModelGeometry,
        *,
        format: bool = False,
        overwrite: bool = False,
        create_bytes: Optional[int] = None,
        blocks_per_slot: int = 1,
        slots_max: Optional[int] = None,
        payload_crcs: bool = True,
        verify_retrieves: bool = False,
        model_fingerprint: Optional[bytes] = None,
        tp_rank: int = 0,
        tp_world: int = 1,
        namespace: int = 1,
        lock_dir: str = "/run/tutti",
        queue_depth: int = 64,
        iocbs: int = 64,
        requests_max: int = 32,
        timeout_s: float = 30.0,
        layers_in_flight: int = 1,
    ) -> Store:
        """Opens the pool on `devices` in this process.

        devices: device strings as tuttid and tutti-bench take them: "emu:mem:SIZE" (software
        controller over memory, e.g. "emu:mem:1g": starts empty, so needs format=True),
        "emu:PATH" (over a file; with format=True, `create_bytes` creates or grows it; without
        format it is not used: a pool's size is its superblock's), "vfio:BDF". Several devices
        make one pool striped across them.
        format: write a fresh pool for `geometry` first (everything there is lost), with
        `blocks_per_slot` engine blocks per slot, at most `slots_max` slots per device,
        `payload_crcs` (record each slot's CRC at commit: needed by verify_retrieves). Without
        format, the pool on the devices is opened (recovery runs) and must have been formatted
        for `geometry` (PoolError otherwise).
        overwrite: with format, format a device that holds something other than a tutti pool
        (a file system, a partition table, a non-empty file of other bytes; a block device or a
        "vfio:" SSD that is not a tutti pool, a blank one included); without it that is
        PoolError naming what was found. A tutti pool is reformatted either way.
        verify_retrieves: check every retrieved block against its recorded CRC (IntegrityError).
        model_fingerprint, tp_rank, tp_world: the key space, as tuttid's (32 bytes, see
        `tutti.fingerprint`); a pool written in-process with a fingerprint is found by tuttid
        sessions of the same model, rank and world. None: the in-process key space (seed 0,
        what tutti-bench uses).
        lock_dir: where `vfio:` devices' lock files live (`emu:PATH` files are locked in place),
        as tuttid's --lock-dir: a second opener (a daemon or another process) gets DeviceError
        naming the holder.
        queue_depth: NVMe queue entries, 2..=1024; iocbs: gio_uring IOCBs, a power of two in
        2..=65536 (gio_uring's ring depth bound); requests_max: requests prepared at once,
        1..=65536 (the store allocates each one's state at open); outside these bounds
        InvalidArgument, before any device is opened; timeout_s: the default wait of `close`. Every timeout_s
        of this package is 0..=1e9 seconds (about 31 years): a longer one (or a negative one)
        is InvalidArgument, since no deadline that far ahead fits the clock.
        layers_in_flight: how many layers of one request may be in flight at once, 1..=4
        (objstore's LAYERS_IN_FLIGHT_LIMIT): an engine issues up to that many layers before it
        waits for the oldest, so the device's queue does not drain at each layer boundary. Each
        prepared request then holds that many sets of its IOCBs (filled once, at prepare)
        until it is finished or committed: requests_max x layers_in_flight (x the IOCBs of one
        set: one per 2048 commands of a layer) should not exceed `iocbs` (not refused here:
        with the defaults, 4 layers in flight hold 16 requests; a prepare past the IOCBs is
        LimitReached saying what each request holds and to raise iocbs), and iocbs must be at
        least layers_in_flight.

        Raises InvalidArgument (a bad device string, geometry or option), DeviceError (a device
        cannot be opened or brought up, or is locked by another process), PoolError."""
    @staticmethod
    def attach(
        socket: str,
        *,
        model_fingerprint: bytes,
        tp_rank: int = 0,
        tp_world: int = 1,
        client_name: str = "python",
        timeout_s: float = 5.0,
        queue_depth: int = 64,
        iocbs: int = 64,
        requests_max: int = 32,
        verify_retrieves: bool = False,
        keepalive: bool = True,
        layers_in_flight: int = 1,
    ) -> Store:
        """Attaches to the tuttid serving `socket` as (model_fingerprint, tp_rank, tp_world);
        the geometry is the daemon's pool's (`store.geometry`). No memory is registered yet:
        call `allocate_kv` next.

        timeout_s: the longest wait for any daemon answer; an attach the daemon answers Busy
        (every connection taken) is asked again on a new connection until timeout_s has passed.
        (A Busy for a restarted engine's old session still holding the request reservations or
        queue ids this one needs comes later, at allocate_kv / register_kv.)
        keepalive: a background thread of this store pings the daemon every third of its lease (HelloReply's lease) while the
        store is idle, so an idle engine keeps its session; without it, an engine idle longer
        than the lease (tuttid --lease, 10 s by default) loses its session (Disconnected on the
        next call). queue_depth, iocbs, requests_max, layers_in_flight: as for `open`, with the
        same bounds (the data path is this process's, so the daemon is not involved; checked
        before connecting).

        client_name: the name tuttid records for this session; at most 64 bytes of
        UTF-8, a longer one is InvalidArgument, raised before anything is sent to the daemon.

        Raises Disconnected (no daemon there), InvalidArgument (the daemon refused the identity:
        an all-zero fingerprint, rank >= world; a queue option or layers_in_flight out of
        bounds; a client_name over 64 UTF-8 bytes), DaemonError (e.g. code
        "Busy": still busy at timeout_s; a model geometry from the daemon
        that is not valid, e.g. 0 KV heads, named with its values), TimeoutError."""
    @property
    def kind(self) -> Literal["in-process", "tuttid"]: ...
    @property
    def geometry(self) -> ModelGeometry: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def layers_in_flight(self) -> int:
        """How many layers of one request may be in flight at once (as opened or attached)."""
    @property
    def registered(self) -> bool:
        """Whether KV memory is registered (register_kv or allocate_kv succeeded)."""
    @property
    def kv(self) -> Optional[KvLayout]:
        """The registered layout (with its tensors), or None."""
    @property
    def closed(self) -> bool: ...
    @property
    def session(self) -> Optional[int]:
        """tuttid's session id (attached stores), else None."""
    @property
    def requests_sent(self) -> int:
        """Requests sent to tuttid on this store's connection (0 in-process): per-layer calls
        add none."""
    def allocate_kv(self, num_blocks: int, kind: KvLayoutKind = "paged") -> KvLayout:
        """Allocates KV memory for `num_blocks` engine blocks in layout `kind`, registers it, and
        returns the layout, whose tensors are KvBuffers the engine uses as its KV cache:
        separate: 2 x layers buffers of num_blocks x object_bytes (keys then values);
        fused: one per layer of 2 x num_blocks x object_bytes; paged: one per layer of
        num_blocks x 2 x object_bytes; block_major: one of num_blocks x block_bytes.
        Attached stores: the memory lies in a sealed memfd window shared with tuttid (together
        with this client's queue rings and mapping table), which the daemon maps for its
        devices: the only memory an attached store can use. In-process: DMA memory of the
        pool's allocator. Once per store.

        Attached: a registration or queue attach tuttid answers Busy (a restarted engine's old
        session still holds the request reservations or queue ids this one needs) is asked
        again on the same connection, each step for up to the store's timeout_s.

        Raises InvalidArgument (num_blocks 0, or the window over tuttid's per-session byte cap),
        InvalidState (already registered), DaemonError / LimitReached (refused by tuttid;
        DaemonError "Busy": still busy at timeout_s)."""
    def register_kv(self, layout: KvLayout) -> None:
        """Registers the engine's KV memory, described by `layout`, for the store's devices.

        In-process: the tensors' memory is mapped where it is (no copy; each tensor's pages are
        mapped whole, and only the bytes of its blocks are ever named in a command). Checks, each
        an InvalidArgument that names the tensor and what to fix: the device (UnsupportedMemory),
        the DLPack capsule (see TensorLike), writability (a read-only buffer, or a DLPack 1.0
        capsule flagged read-only; a legacy DLPack capsule cannot say so), element size, the
        bytes per block against the geometry, the block dimension's density, the same N and stride across tensors, no two tensors overlapping,
        the alignment the devices need (4 bytes with SGL, 4 KiB with PRP).
        Attached to tuttid, CPU memory: accepted when `layout`'s tensors are exactly this
        store's allocation from allocate_kv (same addresses, kind and N: a no-op that lets an
        engine hand its tensors back as it would to any store), or lie in one
        DeviceMemoryStandIn (below); other CPU memory raises UnsupportedMemory, naming
        allocate_kv.
        Attached to tuttid, GPU memory (CUDA tensors through DLPack, or RawMemory on "cuda:N"):
        the same checks, then the range from the lowest tensor's first byte to the highest
        one's end must lie in one CUDA allocation (one cudaMalloc: vLLM 0.32's KV cache is one;
        UnsupportedMemory naming the fix otherwise); it is exported through CUDA IPC and
        registered with tuttid as device memory, which tuttid's software controllers reach by
        CUDA copies (tuttid must run with --device-memory cuda on emu: devices; its refusal is
        raised as UnsupportedMemory with its reason, and ends the session: the store is closed).
        The tensors are kept until the store is closed and tuttid ended the session. Before
        store_layer, the layer's GPU writes must be complete (synchronize the stream that made
        them): tuttid copies from the memory as it is. Without a CUDA driver (libcuda): an
        UnsupportedMemory saying so. An in-process store refuses GPU memory (UnsupportedMemory:
        attach to tuttid).
        Attached: a Busy from tuttid is asked again as for allocate_kv (DaemonError "Busy" once
        timeout_s has passed).
        A tensor's own failure is not a refusal: KeyboardInterrupt, SystemExit or MemoryError
        raised by its __dlpack__, __dlpack_device__ or buffer export comes out as itself; any
        other exception from them is an InvalidArgument naming the tensor and quoting it.
        Once per store (InvalidState otherwise, except that repeat)."""
    def lookup(self, tokens: Sequence[int], first_block: int = 0) -> int:
        """The longest cached prefix of `tokens`, in blocks (x block_tokens for tokens), in this
        store's key space. Only full blocks count. With `first_block` (blocks the engine holds
        itself need not be cached): where the run of cached blocks from there ends, in blocks of
        the prefix (first_block when that block is not cached; a start past the prompt counts as
        its end). Raises NotRegistered (in-process store before registration), Disconnected /
        TimeoutError (tuttid)."""
    def lookup_all_ranks(self, tokens: Sequence[int], first_block: int = 0) -> int:
        """The longest prefix cached on every tensor-parallel rank 0..tp_world of this store's
        model (what an engine's scheduler plans with); from `first_block` as lookup. tp_world 1:
        lookup."""
    def prepare_retrieve(self, tokens: Sequence[int], block_ids: Sequence[int], first_block: int = 0) -> Request:
        """Prepares reading blocks first_block..first_block + len(block_ids) of the prefix of
        `tokens` (all cached: look up first) into engine blocks `block_ids` (block first_block + i
        of the prefix into block_ids[i]). Pins their slots until the request is finished. Then
        per layer: retrieve_layer, wait.

        Blocks before `first_block` (the engine's own, e.g. a local prefix cache hit) are neither
        read nor required to be cached; `tokens` still holds the prefix from its start, since a
        block's key depends on every token before it.

        Raises InvalidArgument (no block ids, blocks past the full blocks of tokens, a block id
        outside the registration, an engine block named twice (refused before anything is
        reserved), a block no longer cached), NotRegistered, LimitReached
        (requests_max), DaemonError / Disconnected (tuttid)."""
    def prepare_store(self, tokens: Sequence[int], block_ids: Sequence[int]) -> Request:
        """Prepares storing blocks 0..len(block_ids) of the prefix of `tokens` from engine blocks
        `block_ids`. Blocks already cached or being stored by another request are shared (not
        written again): `Request.new_block_ids` names the engine blocks this request writes.
        Then per layer: store_layer, wait; then commit (visible and durable) or finish (nothing
        becomes visible).

        Raises as prepare_retrieve, and PoolFull."""
    def ping(self) -> None:
        """Renews tuttid's lease now (attached stores; a no-op in-process)."""
    def close(self, timeout_s: Optional[float] = None) -> None:
        """Finishes every live request (every layer in flight is waited for, oldest first, all
        within timeout_s, default the store's timeout_s), deletes the queue pairs, releases the
        pool (in-process: the devices and the lock; attached: the session, which the daemon ends
        in its safe order), then drops the tensors' references. Attached with a layer still in
        flight at the deadline (or after a wait that failed without ending it): the KV memory is
        given back only once tuttid no longer lists the session and counted no new leaked queue
        pair (asked for at least 5 s); otherwise it is kept for good (leaked_registrations).
        Idempotent. Every later call on the store or its requests raises StaleRequest. Not
        interruptible (nor is leaving the `with`): Ctrl-C is raised once it returned, so that
        nothing is given back while a layer may still move bytes."""
    def leaked_registrations(self) -> int:
        """Tensors (or allocate_kv buffers) whose memory this store keeps for good because a
        queue pair that could reach them could not be deleted, or (attached) a layer was in
        flight at close and tuttid did not confirm the session's end (0 in a healthy run)."""
    def __enter__(self) -> Store: ...
    def __exit__(self, *exc: object) -> None: ...

class Request:
    """One prepared retrieve or store: a completion handle too. Up to the store's
    `layers_in_flight` layers may be issued and not yet returned by a wait at once (1 by
    default: issue, wait, issue); they complete in issue order, and `wait` returns them in that
    order, one per call (a layer's LayerIo.wait returns that one instead). A context
    manager: leaving the `with` finishes it unless it was committed or finished, first waiting
    out every layer in flight (all within the store's timeout_s). A layer still in flight then
    makes the finish refuse: InvalidState ("still in flight"), raised when the block ended
    normally or on any exception but an interruption (a TimeoutError of a wait for a stuck
    layer, the engine's own, a cancellation such as asyncio's CancelledError, which
    asyncio.timeout turns into a TimeoutError), that exception its __context__, so that an
    `except TimeoutError:` around the `with` cannot reuse blocks the layer may still write;
    when KeyboardInterrupt, SystemExit or GeneratorExit leaves the block, that goes on instead
    and the refusal is logged at error level (under asyncio.run, Ctrl-C reaches a task as a
    CancelledError: the exit then raises InvalidState). Either way the request stays held, prepared, until a
    finish, its drop or the store's close ends it.

    A Request garbage-collected while prepared (neither committed nor finished) is finished
    then, giving back its place among requests_max, its pins and its IOCBs: its layers in
    flight are waited out first, as leaving the `with` does (within the store's timeout_s, with
    the GIL released), so that none moves bytes into or out of engine blocks after the drop. A
    layer still in flight after that (a device that does not answer) is logged at error level
    and the request held until the layer ends (the completion thread and the next prepare
    finish it then; the store's close at the latest). While such a request is held, later
    drops wait for nothing (what has ended is taken, the rest held the same way): requests
    dropped together with a stuck device cost one timeout_s in all, not one each. Finish or
    commit explicitly (or use `with`) rather than rely on this: the drop may block the thread
    that frees the object.

    Leaving the `with`, the drop and Store.close are not interruptible, on purpose: Ctrl-C is
    raised only once they returned, so that none gives back memory or a request while a layer
    of it may still move bytes. Leaving the `with` and the drop wait for the layers in flight
    up to the store's timeout_s, then finish the request (attached: one exchange with tuttid,
    bounded by that timeout too). Store.close can take longer than its timeout_s: after the
    layers (up to timeout_s), an attached store with a layer still in flight then waits at
    least 5 s more for tuttid to confirm the session ended, and an in-process store's devices
    are brought down (see Store.close)."""

    @property
    def handle(self) -> int:
        """The store's request handle (objstore's RequestHandle bits)."""
    @property
    def direction(self) -> Literal["retrieve", "store"]: ...
    @property
    def num_blocks(self) -> int:
        """len(block_ids) given to prepare."""
    @property
    def block_ids(self) -> list[int]: ...
    @property
    def new_blocks(self) -> int:
        """Store: blocks this request writes; retrieve: num_blocks."""
    @property
    def shared_blocks(self) -> int:
        """Store: blocks already cached or being stored by another request (0 for a retrieve)."""
    @property
    def evicted_slots(self) -> int:
        """Store: committed slots evicted to make room (0 for a retrieve)."""
    @property
    def new_block_ids(self) -> list[int]:
        """Store: the engine block ids this request writes, in prefix order (the others of
        block_ids are shared). Retrieve: block_ids."""
    @property
    def layer_in_flight(self) -> Optional[int]:
        """The oldest layer in flight (the one the next wait is for), or None: whether a layer
        may still move bytes. Once the store is closed: the oldest layer its close could not
        wait out nor prove ended (see LayerIo.done), for good, whatever the request's state
        (a finish after the close, refused with StaleRequest, does not end it)."""
    @property
    def layers_in_flight(self) -> list[int]:
        """Every layer in flight, oldest first (issued and not yet ended); once the store is
        closed, every layer its close left in flight (as layer_in_flight)."""
    @property
    def layers_completed(self) -> list[int]:
        """Layers whose I/O completed, in order of completion."""
    @property
    def state(self) -> Literal["prepared", "committed", "finished", "failed"]:
        """"failed": a store whose commit failed (the request is finished; nothing visible)."""
    def retrieve_layer(self, layer: int, *, budget: int = 1) -> LayerIo:
        """Issues the reads of one layer (O(IOCBs): the per-block work was done in prepare) and
        returns its completion handle. The layer's commands are on the devices when it returns
        (up to the queue depth; the rest follow at the next wait or poll, or by the completion
        thread once `fileno()` was taken), so its I/O runs while the caller computes. An
        executor failure seen then is raised here, with the layer left in flight (a wait or the
        request's end settles it). `budget`: the SMs (GPU executor) or workers (CPU executor)
        the layer's I/O may use (objstore's SmBudget; the slack-aware scheduler's per-layer
        decision; the CPU executor of this package runs on the calling thread and ignores it).
        Raises InvalidState (already layers_in_flight layers issued and not yet returned by a
        wait, in flight or completed: the message names each and the one to wait for; the same
        layer in flight already; a store request), InvalidArgument (layer past the model's),
        StaleRequest. A layer a poll or the completion thread completed still counts until a
        wait (Request.wait, or its LayerIo's wait or poll) returns it: refusing, rather than
        forgetting its completion, keeps every layer returnable in issue order, and makes
        whether an issue is accepted depend only on the caller's issues and waits, never on
        when the I/O happened to complete."""
    def store_layer(self, layer: int, *, budget: int = 1) -> LayerIo:
        """Issues the writes of one layer; as retrieve_layer. A request with no new block to
        write (new_blocks == 0: the pool holds the prompt) moves nothing: the layer is complete
        at the issue (its LayerIo done, the next wait returns it, the eventfd signalled)."""
    def wait(self, timeout_s: float = 30.0) -> Optional[int]:
        """Returns the oldest issued layer no wait returned yet, waiting (GIL released) until it
        completes if it is still in flight; None if there is none. Layers completed already
        (seen by poll, the completion thread, another layer's LayerIo.wait) are returned at
        once, in issue order, none forgotten (an issue is refused while layers_in_flight of
        them, with those in flight, are not returned yet). A layer that failed is returned as
        its failure, raised in its turn, once, its message starting "layer N failed: " (unless
        that layer's LayerIo.wait raised it first). Raises TimeoutError after timeout_s (the
        layer stays in flight: wait again), its message starting "request 0x...: layer N did
        not complete by the deadline; it is still in flight"; a layer's own failure can be a
        TimeoutError too (tuttid's timeout for that layer, or a deadline the store passed,
        once the store no longer lists the layer): "layer N failed: ...", that layer ended,
        as any failed layer (only the message tells them apart; a LayerIo's done does too),
        IntegrityError (verify_retrieves: the last layer's
        wait compares CRCs), DeviceError (a command failed: that layer is ended, the later ones
        stay in flight), StaleRequest. Interruptible: it looks for signals every 100 ms or so
        (GIL taken for that), so Ctrl-C raises KeyboardInterrupt (a handler's exception, in the
        main thread) within about that; the layer stays in flight, as after TimeoutError."""
    def poll(self) -> bool:
        """Non-blocking: drives the I/O once, ending every layer in flight that is done (oldest
        first; later waits return them, a failed layer's failure too: poll does not raise it);
        True once nothing is in flight. Raises StaleRequest, and a wait's failure that ended no
        layer (the layer stays in flight)."""
    def fileno(self) -> int:
        """An eventfd (non-blocking, close-on-exec, owned by this Request object: do not close
        it; it stays open, and its number stays this eventfd's, as long as the object lives,
        also after commit, finish or the store's close, when it is no longer written),
        written once each time a layer of this request ends (completes or fails) or a wait
        fails without ending its layer, whoever observed it (a wait, a poll, a LayerIo, or the
        store's completion thread); layers ended before the first call are announced at once.
        The first call starts the store's completion thread if not running (one per store, at
        most): while a request with an eventfd has a layer in flight, it drives the store's
        I/O in slices of at most 200 us under the store's lock, and stops when the store
        closes.

        The eventfd counts; it is not a semaphore (no EFD_SEMAPHORE): one read (8 bytes)
        returns how many such events happened since the last read and resets it, so several
        layer ends merge into one wake-up. A wake-up may also find nothing left: a wait or a
        LayerIo may have taken the outcome before the read. So after each read, call `wait(0)`
        until it returns None or raises the TimeoutError of its deadline ("request 0x...: layer
        N did not complete by the deadline; it is still in flight": the oldest layer still in
        flight): each call takes one ended layer, or raises its failure ("layer N failed: ...",
        whatever its class, a TimeoutError included: handle it and call again, as stopping
        there would leave the layers that ended after it untaken with the eventfd read already;
        any other failure ended no layer), and frees its place among the
        layers_in_flight not yet returned; do so before the next issue (`layers_completed` and
        `poll()` only look)."""
    def commit(self) -> int:
        """Store: makes the stored blocks durable (flush, headers with FUA) and visible, and
        finishes the request; every layer must have completed. Returns the blocks stored.
        Raises InvalidState (a layer in flight or not stored, e.g. one whose latest store_layer
        failed, or a retrieve), StaleRequest, DeviceError, DaemonError; nothing of it is
        visible after a failure. A failure that left the store holding the request (every
        InvalidState refusal, or one part way that did not let go of it) leaves it prepared:
        store what is missing and commit again, or finish it (leaving the `with` does);
        otherwise the request is finished ("failed")."""
    def finish(self) -> None:
        """Ends the request without committing (a retrieve's pins released; nothing of a store
        becomes visible). Raises InvalidState while any layer is in flight (wait for each first,
        or leave the `with`, which does). Idempotent after commit/finish."""
    def __enter__(self) -> Request: ...
    def __exit__(self, *exc: object) -> None:
        """Waits out the layers in flight (up to the store's timeout_s), then finishes the
        request unless it was committed or finished; never suppresses the exception leaving the
        block, and raises a refusal over it (its __context__) only when it is an Exception (see
        the class doc)."""

class LayerIo:
    """The completion handle of one issue of a layer (from retrieve_layer / store_layer). It
    answers for its own issue only: once a layer is issued again, the earlier handle still
    reports how its own issue ended (also after a wait returned that outcome), never the new
    issue's outcome."""

    @property
    def layer(self) -> int: ...
    @property
    def request(self) -> Request: ...
    @property
    def done(self) -> bool:
        """Whether this layer ended, completed or failed, as observed (by any wait/poll/the
        completion thread); does not drive I/O (use poll). A failed layer is done: its wait
        raises the failure. True once the request has ended, its store's close included (the
        close ends every request), except for a layer the close could not wait out (within its
        timeout_s) whose queue pairs it could not prove deleted either (tuttid's session not
        seen ending cleanly): nothing says it ended, and it stays False for good (its memory
        is kept for good, counted in Store.leaked_registrations), a later finish of its request
        (refused: StaleRequest) included; its request's layer_in_flight names it."""
    def poll(self) -> bool:
        """Non-blocking: drives the request's I/O up to this layer; True when this layer
        completed, whose completion it then takes as wait does, and True once the request has
        ended with this layer completed. Raises as wait, except wait's TimeoutError of its
        deadline (False instead): this layer's own failure is raised whatever its class, a
        TimeoutError "layer N failed: ..." included (the layer ended; done is True); after the
        request ended, this layer's failure if it failed, else StaleRequest if it never
        ended."""
    def wait(self, timeout_s: float = 30.0) -> None:
        """Waits (GIL released) until this layer ended, ending the layers issued before it first
        (their outcomes stay for Request.wait, a failure of theirs too: it is not raised here;
        this layer's is taken, however it was seen to end: Request.wait does not return it,
        and it no longer counts against layers_in_flight). Raises this layer's own failure
        ("layer N failed: ...", the class as Request.wait's), as often as asked, and a failed
        wait of its own the completion thread kept (once); when a layer before it cannot be
        waited for (its wait, tried again here, fails again without ending it), a failure
        naming that layer ("layer K is still in flight behind layer J, ..."); an earlier
        failed wait the completion thread kept is no gate: it is tried again by this wait,
        within its timeout; TimeoutError at its deadline ("request 0x...: layer N did not
        complete by the deadline; it is still in flight", done False), not to be taken for this
        layer's own failure of that class ("layer N failed: ...", done True); StaleRequest;
        InvalidState for a layer never issued on
        this request. After the request ended (finish, commit, leaving the `with`): returns at
        once if this layer completed, raises its failure if it failed, else StaleRequest.
        Interruptible as Request.wait (Ctrl-C: KeyboardInterrupt, the layer left in flight)."""
    def fileno(self) -> int:
        """The request's eventfd (Request.fileno)."""

# ---------------------------------------------------------------------------------------------
# Lookup-only client (an engine's scheduler process)
# ---------------------------------------------------------------------------------------------

class LookupClient:
    """A tuttid session that only looks up: no memory registration, no queue pairs (tutti-daemon's
    `Client`). Cheap: one socket. Thread-safe (calls are serialised). One process, as a Store:
    inherited across fork, every call that reaches the connection (close too) raises
    InvalidState in the child, and
    dropping it there sends nothing (the child's copy of the socket is closed at the fork, so the
    parent's close still ends its session): connect again in the child."""

    @staticmethod
    def connect(
        socket: str,
        *,
        model_fingerprint: bytes,
        tp_rank: int = 0,
        tp_world: int = 1,
        client_name: str = "python-scheduler",
        timeout_s: float = 5.0,
    ) -> LookupClient:
        """Connects and attaches (Hello). Raises as Store.attach (a timeout_s past 1e9 s, or
        negative, is InvalidArgument; so is a client_name over 64 UTF-8 bytes, before anything
        is sent)."""
    @property
    def session(self) -> int: ...
    @property
    def geometry(self) -> ModelGeometry:
        """The daemon's pool geometry."""
    @property
    def block_tokens(self) -> int: ...
    @property
    def lease_s(self) -> float:
        """The session's lease: call ping() (or any lookup) at least this often."""
    def lookup(self, tokens: Sequence[int], first_block: int = 0) -> int:
        """Longest cached prefix in blocks in this session's (model, rank, world) key space; from
        `first_block`: where the run of cached blocks from there ends (see Store.lookup). A
        first_block of 2^32 or more raises InvalidArgument."""
    def lookup_all_ranks(self, tokens: Sequence[int], first_block: int = 0) -> int:
        """Longest prefix in blocks cached on every rank 0..tp_world of this model and world;
        from `first_block` as lookup."""
    def ping(self) -> None: ...
    def status(self) -> dict[str, Any]:
        """The daemon's status (tutti-daemon's StatusReply) as plain data: {"daemon_pid",
        "uptime_ms", "connections", "leaked_queue_pairs", "devices": [{"spec", "description",
        "refused_commands", "metadata_fenced"}], "pool": {"slots", "free_slots", "valid_slots", "writing_slots",
        "pinned_slots", "cached_blocks", "evictions"}, "clients": [{"session", "pid", "uid",
        "name", "tp_rank", "tp_world", "requests", "idle_ms", "registrations", "queue_pairs",
        "requests_in_flight", "awaiting_exit", "kept", "retiring"}]} ("awaiting_exit": the daemon ended the
        session while its process still runs, and holds its queues until that process exits;
        "kept": the session ended but its queue pairs are not known to be deleted, so the daemon
        keeps its memory registered for good — never free memory a kept session registered;
        "retiring": the session ended and the deletion of its queue pairs is not confirmed yet,
        retried until it is — its memory stays registered meanwhile, so do not free it either;
        a device's "metadata_fenced": its slot headers could not be written, so its slots take no
        new KV until tuttid restarts — stores answered pool full meanwhile)."""
    def close(self) -> None: ...
    def __enter__(self) -> LookupClient: ...
    def __exit__(self, *exc: object) -> None: ...
