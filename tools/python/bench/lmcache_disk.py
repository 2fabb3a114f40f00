"""LMCache's own engine storing and retrieving one prompt's KV on its local disk tier.

The LMCache side of tools/compare-lmcache.sh (issue 16 item 4). One process, one round:

1. builds an ``LMCacheEngine`` (LMCache's ``LMCacheEngineBuilder``, its chunked token database,
   its ``StorageManager``) with the local disk backend on DIRECTORY, O_DIRECT on, 256-token
   chunks, and its CPU tier OFF (``local_cpu=False``: the CPU backend is then only the staging
   allocator and keeps nothing, so a retrieve has to read the disk);
2. fills engine KV memory shaped like vLLM's paged KV for Llama-3.1-8B (per layer one
   ``[2, blocks, 16, 8, 128]`` bf16 tensor, blocks in a scrambled order through the block table)
   with seeded random bytes and keeps a copy;
3. **store**: ``engine.store(tokens, kvcaches=..., slot_mapping=...)``, then waits until the disk
   backend's index holds every chunk (its writes are asynchronous: the index gains a key when
   that chunk's file is written);
4. drops the page cache (``echo 1 > /proc/sys/vm/drop_caches``; ``posix_fadvise(DONTNEED)`` on
   every file where that is not allowed), clears the engine KV memory;
5. **retrieve**: ``engine.retrieve(tokens, kvcaches=..., slot_mapping=...)`` (returns once every
   chunk is read and scattered into the paged KV), checks every token came back, that the
   process read at least the prompt's bytes from the block layer (``/proc/self/io``
   ``read_bytes``: the bytes came from the disk, not a cache) and compares every byte.

Only the GPU connector is ours: ``CpuPagedConnector`` implements LMCache's
``GPUConnectorInterface`` with CPU gathers/scatters between the paged KV and LMCache's
``KV_2LTD`` memory objects (what ``VLLMPagedMemGPUConnectorV2``'s CUDA kernel does on a GPU).

Prints one JSON object on stdout. Exit status: 0 done, 2 LMCache missing or a check failed
(the reason on stderr), 1 anything unexpected.

Run with the engines environment's python and LMCache's site directory on PYTHONPATH (the
script does that): ``python lmcache_disk.py --directory /var/tmp/lmcache-compare``.
"""

import argparse
import json
import os
import shutil
import sys
import time

# LMCache sends a usage report on engine creation unless told not to; this machine has no
# route to it and a benchmark has no business phoning home.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

# Llama-3.1-8B's KV geometry, as tutti-bench's default (`--model llama3-8b`).
LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK_TOKENS = 16
ELEMENT_BYTES = 2  # bf16

# Bounds: the store's asynchronous writes must land within this, or the round fails.
STORE_DEADLINE_S = 120.0
STORE_POLL_INTERVAL_S = 0.0005


class CheckFailed(Exception):
    """A verification failed: the figures of this round must not be used."""


def fail(message):
    print(f"lmcache_disk: {message}", file=sys.stderr)
    sys.exit(2)


try:
    import numpy
    import torch
    import lmcache
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import local_disk_backend
except ImportError as error:  # the shell script installs it; this is the last line of defence
    fail(f"LMCache 0.5.6 does not import here ({error}); run tools/compare-lmcache.sh")


class CpuPagedConnector(GPUConnectorInterface):
    """LMCache's connector interface over CPU tensors shaped like vLLM's paged KV.

    ``kvcaches`` is a list of per-layer tensors ``[2, blocks, block_tokens, heads, head_dim]``;
    ``slot_mapping`` gives each token of the sequence its slot (block * block_tokens + offset).
    A memory object holds one chunk as ``[2, layers, tokens, heads * head_dim]`` (KV_2LTD).
    ``from_gpu`` gathers the chunk's slots into it, ``to_gpu`` scatters them back: one
    ``index_select`` / ``index_copy_`` per layer and K/V, whole blocks at a time (rows of
    block_tokens * heads * head_dim elements) when the chunk covers whole blocks in slot order,
    as it does here; token by token otherwise. On a GPU this is one CUDA kernel at memory speed;
    here it must not be what the comparison measures, so it moves whole blocks.
    """

    def __init__(self, layers, hidden_elements, block_tokens):
        self.layers = layers
        self.hidden_elements = hidden_elements
        self.block_tokens = block_tokens
        self.kvcaches = None
        # Time spent in the copies, so that the report can say how much of LMCache's figures
        # is this stand-in (a GPU does these copies in a kernel, not on the CPU).
        self.gather_ns = 0
        self.scatter_ns = 0

    def _rows(self, kwargs, start, end):
        """(index, row_elements): block ids when [start, end) is whole blocks, else slots."""
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' should be provided in kwargs.")
        slots = kwargs["slot_mapping"][start:end]
        block_tokens = self.block_tokens
        if len(slots) % block_tokens == 0:
            blocks = slots[::block_tokens] // block_tokens
            offsets = torch.arange(block_tokens).repeat(len(blocks))
            if torch.equal(slots, blocks.repeat_interleave(block_tokens) * block_tokens + offsets):
                return blocks, block_tokens * self.hidden_elements
        return slots, self.hidden_elements

    def _layer_rows(self, layer, row_elements):
        # [2, rows, row_elements]: a view, each layer's memory is contiguous.
        return self.kvcaches[layer].view(2, -1, row_elements)

    def from_gpu(self, memory_obj, start, end, **kwargs):
        self.initialize_kvcaches_ptr(**kwargs)
        index, row_elements = self._rows(kwargs, start, end)
        tensor = memory_obj.tensor
        for layer in range(self.layers):
            source = self._layer_rows(layer, row_elements)
            for kv in range(2):
                target = tensor[kv, layer, : end - start].view(-1, row_elements)
                torch.index_select(source[kv], 0, index, out=target)
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj, start, end, **kwargs):
        self.initialize_kvcaches_ptr(**kwargs)
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"memory object in {memory_obj.metadata.fmt}, expected KV_2LTD")
        index, row_elements = self._rows(kwargs, start, end)
        tensor = memory_obj.tensor
        for layer in range(self.layers):
            target = self._layer_rows(layer, row_elements)
            for kv in range(2):
                source = tensor[kv, layer, : end - start].view(-1, row_elements)
                target[kv].index_copy_(0, index, source)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        started = time.perf_counter_ns()
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)
        self.gather_ns += time.perf_counter_ns() - started

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        started = time.perf_counter_ns()
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)
        self.scatter_ns += time.perf_counter_ns() - started

    def get_shape(self, num_tokens):
        return torch.Size([2, self.layers, num_tokens, self.hidden_elements])


def process_io():
    """The process's block-layer byte counters (all threads): what really hit the disk."""
    counters = {}
    with open("/proc/self/io", encoding="ascii") as file:
        for line in file:
            name, value = line.split(":")
            counters[name.strip()] = int(value)
    return counters


def drop_page_cache(directory):
    """Drops the page cache; per-file DONTNEED where /proc/sys/vm/drop_caches is not writable."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as file:
            file.write("1\n")
        return "drop_caches"
    except OSError:
        for name in os.listdir(directory):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def engine_kv(blocks, seed):
    """Per-layer paged KV filled with seeded random bytes, and a copy to compare against."""
    random = numpy.random.default_rng(seed)
    shape = (2, blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM * ELEMENT_BYTES)
    layer_bytes = 2 * blocks * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * ELEMENT_BYTES
    layers, expected = [], []
    for _ in range(LAYERS):
        want = torch.frombuffer(bytearray(random.bytes(layer_bytes)), dtype=torch.uint8)
        expected.append(want.view(shape))
        layers.append(want.clone().view(shape).view(torch.bfloat16))
    return layers, expected


def first_difference(layers, expected):
    for layer, (got, want) in enumerate(zip(layers, expected, strict=True)):
        got_bytes = got.view(torch.uint8)
        if not torch.equal(got_bytes, want):
            index = int((got_bytes != want).flatten().nonzero()[0])
            per_kv = want[0].numel()
            kv = "KV"[index // per_kv]
            return (f"layer {layer} {kv} byte {index % per_kv}: expected "
                    f"{int(want.flatten()[index])}, got {int(got_bytes.flatten()[index])}")
    return None


def run(args):
    tokens_total = args.tokens
    if tokens_total % args.chunk_tokens or tokens_total % BLOCK_TOKENS:
        fail(f"--tokens {tokens_total} must be a multiple of the chunk ({args.chunk_tokens}) "
             f"and block ({BLOCK_TOKENS}) sizes")
    blocks = tokens_total // BLOCK_TOKENS
    chunks = tokens_total // args.chunk_tokens
    kv_bytes = LAYERS * 2 * tokens_total * KV_HEADS * HEAD_DIM * ELEMENT_BYTES

    # One thread for torch's CPU copies: its default (one per core) spins against LMCache's
    # disk threads on a small machine (measured here: 15 s instead of 0.9 s per 512 MiB while
    # other work loaded the cores). On a GPU the copies take no CPU thread at all.
    torch.set_num_threads(1)
    directory = args.directory
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)

    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, 128000, (tokens_total,), generator=generator, dtype=torch.long)
    block_table = torch.randperm(blocks, generator=generator)
    positions = torch.arange(tokens_total)
    slot_mapping = block_table[positions // BLOCK_TOKENS] * BLOCK_TOKENS + positions % BLOCK_TOKENS
    kvcaches, expected = engine_kv(blocks, args.seed)

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=args.chunk_tokens,
        local_cpu=False,
        # Staging memory for one prompt's memory objects (the CPU tier itself is off).
        max_local_cpu_size=args.staging_gib,
        local_disk=directory,
        max_local_disk_size=args.disk_gib,
        extra_config={"use_odirect": True},
    )
    metadata = LMCacheMetadata(
        model_name="meta-llama/Llama-3.1-8B",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, args.chunk_tokens, KV_HEADS, HEAD_DIM),
        chunk_size=args.chunk_tokens,
    )
    connector = CpuPagedConnector(LAYERS, KV_HEADS * HEAD_DIM, BLOCK_TOKENS)
    engine = LMCacheEngineBuilder.get_or_create(
        "tutti-compare", config, metadata, connector, None, None)
    try:
        engine.post_init()
        backends = engine.storage_manager.storage_backends
        disk = backends.get("LocalDiskBackend")
        cpu = backends.get("LocalCPUBackend")
        if disk is None:
            raise CheckFailed(f"no LocalDiskBackend among {sorted(backends)}")
        if cpu is not None and cpu.use_hot:
            raise CheckFailed("LMCache's CPU tier is on: a retrieve would not read the disk")
        odirect = bool(disk.use_odirect) and (kv_bytes // chunks) % disk.os_disk_bs == 0

        # Store: the call gathers every chunk into memory objects and queues the writes; the
        # store is done when the disk backend's index holds every chunk.
        io_before = process_io()
        started = time.perf_counter()
        engine.store(tokens, kvcaches=kvcaches, slot_mapping=slot_mapping)
        submitted = time.perf_counter()
        deadline = submitted + STORE_DEADLINE_S
        while len(disk.dict) < chunks or disk.disk_worker.put_tasks:
            if time.perf_counter() > deadline:
                raise CheckFailed(f"store: {len(disk.dict)} of {chunks} chunks on disk after "
                                  f"{STORE_DEADLINE_S:.0f} s")
            time.sleep(STORE_POLL_INTERVAL_S)
        stored = time.perf_counter()
        io_stored = process_io()
        written_bytes = io_stored["write_bytes"] - io_before["write_bytes"]

        files = sorted(os.listdir(directory))
        sizes = sorted({os.path.getsize(os.path.join(directory, name)) for name in files})
        if len(files) != chunks or sum(os.path.getsize(os.path.join(directory, name))
                                       for name in files) != kv_bytes:
            raise CheckFailed(f"store: {len(files)} files of sizes {sizes} in {directory}, "
                              f"expected {chunks} files holding {kv_bytes} bytes")

        drop_method = drop_page_cache(directory)
        for layer in kvcaches:
            layer.zero_()
        cpu_keys = len(cpu.hot_cache) if cpu is not None else 0

        io_before = process_io()
        started_retrieve = time.perf_counter()
        retrieved_mask = engine.retrieve(tokens, kvcaches=kvcaches, slot_mapping=slot_mapping)
        retrieved = time.perf_counter()
        io_retrieved = process_io()
        read_bytes = io_retrieved["read_bytes"] - io_before["read_bytes"]

        retrieved_tokens = int(retrieved_mask.sum())
        if retrieved_tokens != tokens_total:
            raise CheckFailed(f"retrieve: {retrieved_tokens} of {tokens_total} tokens found")
        if read_bytes < kv_bytes:
            raise CheckFailed(f"retrieve: the process read {read_bytes} bytes from the block "
                              f"layer, less than the {kv_bytes} it returned: not from disk")
        difference = first_difference(kvcaches, expected)
        if difference is not None:
            raise CheckFailed(f"retrieve: bytes differ ({difference})")

        return {
            "tool": "lmcache",
            "lmcache_version": lmcache.__version__,
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "directory": directory,
            "kv_bytes": kv_bytes,
            "tokens": tokens_total,
            "chunk_tokens": args.chunk_tokens,
            "chunks": chunks,
            "files": len(files),
            "file_bytes": sizes,
            "o_direct": odirect,
            "disk_io_threads": config.get_extra_config_value(
                "disk_io_threads", local_disk_backend._DEFAULT_THREAD_COUNT),
            "torch_threads": torch.get_num_threads(),
            "cpu_tier": {"local_cpu": bool(config.local_cpu), "hot": bool(cpu.use_hot),
                         "keys_before_retrieve": cpu_keys},
            "page_cache_drop": drop_method,
            "store_ns": int((stored - started) * 1e9),
            "store_call_ns": int((submitted - started) * 1e9),
            "retrieve_ns": int((retrieved - started_retrieve) * 1e9),
            "store_gather_ns": connector.gather_ns,
            "retrieve_scatter_ns": connector.scatter_ns,
            "store_write_bytes": written_bytes,
            "retrieve_read_bytes": read_bytes,
            "verified_bytes": kv_bytes,
        }
    finally:
        LMCacheEngineBuilder.destroy("tutti-compare")
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--directory", required=True,
                        help="LMCache's local disk directory (created, then removed)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--staging-gib", type=float, default=1.0,
                        help="LMCache's CPU staging allocator, GiB (its CPU tier stays off)")
    parser.add_argument("--disk-gib", type=float, default=2.0,
                        help="LMCache's local disk capacity, GiB")
    parser.add_argument("--keep", action="store_true", help="keep the chunk files")
    args = parser.parse_args()
    try:
        result = run(args)
    except CheckFailed as error:
        fail(str(error))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
