"""The table of tools/compare-lmcache.sh: tutti-bench's KV run against LMCache's disk tier.

    python3 lmcache_table.py WORK ROUNDS MACHINE LOAD_START LOAD_END
    python3 lmcache_table.py --strace TOOL LOG     # a `strace -f -C` log: summary, big transfers

WORK holds, per round r, ``tutti-r.json`` (tutti-bench --output-format=json), ``lmcache-r.json``
(lmcache_disk.py's object) and ``load-r.txt`` (the 1-minute load average before and after the
round). Prints the definitions, every round, the medians and the ratios; exits 2 naming the file
when a round's report is missing or does not hold what the comparison needs (a round whose
bytes were not all verified is not a figure).
"""

import collections
import json
import re
import statistics
import sys


class BadReport(Exception):
    pass


def load(path):
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError) as error:
        raise BadReport(f"{path}: {error}") from error


# What tutti-bench's device description carries when its I/O does not reach a disk
# (tools/tutti-bench/src/filesystems.rs memory_note, devices.rs storage_note).
TUTTI_NOT_A_DISK = ("memory, not a disk", "buffered pread/pwrite")


def tutti_figures(path, kv_bytes):
    """(store, retrieve) GB/s over the layers' time, the same over the phase's wall time, the
    retrieve's per-layer latencies and the configuration line."""
    report = load(path)
    try:
        phases = report["phases"]
        store = next(p for p in phases if p["phase"].startswith("store") and p["blocks"] > 0)
        retrieve = next(p for p in phases if p["phase"].startswith("retrieve"))
        options = report["global options"]
    except (KeyError, StopIteration, TypeError) as error:
        raise BadReport(f"{path}: no store and retrieve phase ({error!r})") from error
    for phase in (store, retrieve):
        if phase["io_bytes"] != kv_bytes:
            raise BadReport(f"{path}: phase {phase['phase']} moved {phase['io_bytes']} bytes, "
                            f"LMCache moved {kv_bytes}: not the same workload")
    if retrieve.get("verified_bytes") != kv_bytes:
        raise BadReport(f"{path}: retrieve verified {retrieve.get('verified_bytes')} bytes, "
                        f"expected {kv_bytes}")
    # LMCache's retrieve must read from the block layer (lmcache_figures); tutti's is held to
    # the same rule: tutti-bench's device description says when its pool file is memory (tmpfs
    # or ramfs: "(tmpfs: memory, not a disk)") or the software controller runs buffered through
    # the page cache ("buffered pread/pwrite"), and such a run measured memory, not a disk.
    description = options.get("device_description")
    if not isinstance(description, str):
        raise BadReport(f"{path}: no device_description: cannot tell whether the retrieve read a disk")
    for marker in TUTTI_NOT_A_DISK:
        if marker in description:
            raise BadReport(f"{path}: tutti's device is not a disk ({marker!r} in its description "
                            f"{description!r}): its retrieve did not read from the block layer")

    def layer_time_ns(phase):
        return sum(layer["lat_ns"] for layer in phase["layers"])

    return {
        "store": kv_bytes / layer_time_ns(store),
        "retrieve": kv_bytes / layer_time_ns(retrieve),
        "store_wall": kv_bytes / store["wall_ns"],
        "retrieve_wall": kv_bytes / retrieve["wall_ns"],
        "store_layers_ns": [layer["lat_ns"] for layer in store["layers"]],
        "retrieve_layers_ns": [layer["lat_ns"] for layer in retrieve["layers"]],
        "layers_in_flight": options.get("layers_in_flight"),
        "mapping_table": options.get("mapping_table", {}).get("form"),
    }


def lmcache_figures(path):
    report = load(path)
    try:
        kv_bytes = report["kv_bytes"]
        if report["verified_bytes"] != kv_bytes:
            raise BadReport(f"{path}: verified {report['verified_bytes']} of {kv_bytes} bytes")
        if report["retrieve_read_bytes"] < kv_bytes:
            raise BadReport(f"{path}: the retrieve read {report['retrieve_read_bytes']} bytes "
                            "from the block layer, less than it returned")
        return {
            "kv_bytes": kv_bytes,
            "store": kv_bytes / report["store_ns"],
            "retrieve": kv_bytes / report["retrieve_ns"],
            # Without the CPU stand-in's copies (gather before the writes, scatter after the
            # reads; neither overlaps LMCache's disk I/O): what its disk path alone does.
            "store_net": kv_bytes / (report["store_ns"] - report["store_gather_ns"]),
            "retrieve_net": kv_bytes / (report["retrieve_ns"] - report["retrieve_scatter_ns"]),
            "store_call_share": report["store_call_ns"] / report["store_ns"],
            "gather_ms": report["store_gather_ns"] / 1e6,
            "scatter_ms": report["retrieve_scatter_ns"] / 1e6,
            "report": report,
        }
    except KeyError as error:
        raise BadReport(f"{path}: no {error} in LMCache's report") from error


def median(values):
    return statistics.median(values)


# One traced call: "PID name(args) = result" (strace -f's unfinished/resumed pairs are joined
# by strace itself only with -o per process; the resumed line carries the result).
STRACE_CALL = re.compile(r"^\d+\s+(?:<\.\.\. )?(\w+)(?:\(| resumed>).*\)\s+=\s+(-?\d+)")
BIG_TRANSFER_BYTES = 1 << 20


def strace_report(tool, path):
    """The summary's top rows and every read/write syscall moving >= 1 MiB, by size: the data
    path's syscalls among the start-up's (imports, page faults of the allocator, ...)."""
    transfers = collections.Counter()
    summary = []
    with open(path, encoding="utf-8", errors="replace") as file:
        in_summary = False
        for line in file:
            if line.startswith("% time"):
                in_summary = True
            if in_summary:
                summary.append(line.rstrip())
                continue
            match = STRACE_CALL.match(line)
            if match and match.group(1) in ("read", "write", "pread64", "pwrite64", "preadv",
                                            "pwritev", "preadv2", "pwritev2"):
                result = int(match.group(2))
                if result >= BIG_TRANSFER_BYTES:
                    transfers[(match.group(1), result)] += 1
    print(f"strace -f, one {tool} round (whole process, start-up included), top rows by time:")
    for line in summary[:14]:
        print(f"  {line}")
    if transfers:
        print("  read/write syscalls of >= 1 MiB: " + ", ".join(
            f"{count} x {name} {size / (1 << 20):g} MiB"
            for (name, size), count in sorted(transfers.items())))
    else:
        print("  no read/write syscall moved >= 1 MiB (the data moves through io_uring here)")


def main():
    if sys.argv[1] == "--strace":
        strace_report(sys.argv[2], sys.argv[3])
        return
    work, rounds, machine, load_start, load_end = sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]
    # The binary measured (compare-lmcache.sh passes the one cargo built, or COMPARE_BENCH).
    bench = sys.argv[6] if len(sys.argv) > 6 else "tutti-bench (path not given)"
    rows = []
    try:
        for index in range(1, rounds + 1):
            lmcache = lmcache_figures(f"{work}/lmcache-{index}.json")
            tutti = tutti_figures(f"{work}/tutti-{index}.json", lmcache["kv_bytes"])
            with open(f"{work}/load-{index}.txt", encoding="ascii") as file:
                load_line = file.read().strip()
            rows.append((index, tutti, lmcache, load_line))
    except (BadReport, OSError) as error:
        print(f"compare-lmcache: {error}", file=sys.stderr)
        sys.exit(2)

    first = rows[0][2]["report"]
    kv_bytes = rows[0][2]["kv_bytes"]
    print(f"machine: {machine}; load average {load_start} at start, {load_end} at end")
    print(f"versions: LMCache {first['lmcache_version']} (torch {first['torch_version']}, "
          f"Python {first['python_version']}); {bench}, "
          f"layers in flight {rows[0][1]['layers_in_flight']}, mapping table "
          f"{rows[0][1]['mapping_table']}")
    print(f"workload: llama3-8b, {first['tokens']} tokens, {kv_bytes:,} bytes of KV "
          f"(32 layers x 2 x {first['tokens']} tokens x 8 heads x 128 x 2 B), GB = 1e9 bytes")
    print(f"LMCache: local disk tier, chunk {first['chunk_tokens']} tokens -> {first['files']} "
          f"files of {first['file_bytes']} bytes, O_DIRECT {'on' if first['o_direct'] else 'OFF'}, "
          f"{first['disk_io_threads']} disk I/O threads, {first['torch_threads']} torch thread(s) for the stand-in's copies, CPU tier off (local_cpu="
          f"{first['cpu_tier']['local_cpu']}, {first['cpu_tier']['keys_before_retrieve']} keys "
          f"in it before the retrieve), page cache dropped before the retrieve "
          f"({first['page_cache_drop']}), retrieve read >= the bytes it returned from the "
          f"block layer (/proc/self/io), every byte verified")
    print("times: tutti store = populate phase, first store_layer issue to last layer done "
          "(its layers' time; prepare/commit excluded), retrieve = retrieve phase's layers' "
          "time (lookup/prepare excluded); 'wall' = the phase's wall time including "
          "prepare/commit.")
    print("       LMCache store = engine.store() call until the disk backend indexes every "
          "chunk (its file written), retrieve = engine.retrieve() call to return (disk reads "
          "+ scatter into the paged KV).")
    print("       LMCache 'net' = the same less the CPU stand-in connector's copies (gather in "
          "the store call before any write, scatter after the reads; on a GPU a kernel does "
          "them): LMCache's disk path alone, the bar tutti must clear to win on a GPU too.")
    print()
    print(f"{'GB/s':<19}" + "  ".join(f"{name:<16}" for name in
                                     ("tutti", "tutti wall", "LMCache", "LMCache net")))
    print(f"{'round':<6}{'load':>11}  " + "  ".join(["  store retrieve"] * 4))
    pairs = {
        "tutti": ("store", "retrieve", 1),
        "tutti wall": ("store_wall", "retrieve_wall", 1),
        "LMCache": ("store", "retrieve", 2),
        "LMCache net": ("store_net", "retrieve_net", 2),
    }

    def figures_line(label, load_text, values):
        cells = "  ".join(f"{store:>7.2f}{retrieve:>9.2f}" for store, retrieve in values)
        return f"{label:<6}{load_text:>11}  {cells}"

    for index, tutti, lmcache, load_line in rows:
        sources = {1: tutti, 2: lmcache}
        print(figures_line(str(index), load_line, [
            (sources[source][store], sources[source][retrieve])
            for store, retrieve, source in pairs.values()]))
    print(figures_line("median", "", [
        (median([row[source][store] for row in rows]),
         median([row[source][retrieve] for row in rows]))
        for store, retrieve, source in pairs.values()]))

    # Ratios tutti/LMCache per round, then the median of the per-round ratios.
    comparisons = {
        "tutti/LMCache": ("store", "retrieve", "store", "retrieve"),
        "wall/LMCache": ("store_wall", "retrieve_wall", "store", "retrieve"),
        "tutti/LMCache net": ("store", "retrieve", "store_net", "retrieve_net"),
    }
    ratios = {name: [] for name in comparisons}
    for _, tutti, lmcache, _ in rows:
        for name, (tutti_store, tutti_retrieve, lmc_store, lmc_retrieve) in comparisons.items():
            ratios[name].append((tutti[tutti_store] / lmcache[lmc_store],
                                 tutti[tutti_retrieve] / lmcache[lmc_retrieve]))
    print()
    print(f"{'ratios':<19}" + "  ".join(f"{name:<16}" for name in comparisons))
    print(f"{'round':<6}{'':>11}  " + "  ".join(["  store retrieve"] * 3))
    for position, (index, _, _, load_line) in enumerate(rows):
        print(figures_line(str(index), load_line, [ratios[name][position] for name in comparisons]))
    medians = {name: (median([pair[0] for pair in values]), median([pair[1] for pair in values]))
               for name, values in ratios.items()}
    print(figures_line("median", "", list(medians.values())))
    print("(medians of the per-round ratios)")
    headline_store, headline_retrieve = medians["tutti/LMCache"]
    print(f"goal (issue 16 item 4) tutti >= 1.0x LMCache: store {headline_store:.2f}x "
          f"{'met' if headline_store >= 1.0 else 'MISSED'}, retrieve {headline_retrieve:.2f}x "
          f"{'met' if headline_retrieve >= 1.0 else 'MISSED'} (against LMCache net: store "
          f"{medians['tutti/LMCache net'][0]:.2f}x, retrieve "
          f"{medians['tutti/LMCache net'][1]:.2f}x)")
    print()

    # Where the time goes: tutti's per-layer latencies (median over rounds of each layer),
    # LMCache's store split into the call (hash, stage, gather, queue) and the writes after it.
    def layer_medians(name):
        per_layer = zip(*[row[1][name] for row in rows], strict=True)
        return [median(values) / 1e6 for values in per_layer]

    for name in ("store_layers_ns", "retrieve_layers_ns"):
        values = layer_medians(name)
        print(f"tutti {name.split('_')[0]} per layer, ms (median over rounds): first "
              f"{values[0]:.1f}, median {median(values):.1f}, max {max(values):.1f}, "
              f"sum {sum(values):.0f}")
    share = median([row[2]["store_call_share"] for row in rows])
    print(f"LMCache store: the engine.store() call is {100 * share:.0f}% of the store time "
          "(the rest: its disk threads finishing the writes); the stand-in's gather "
          f"{median([row[2]['gather_ms'] for row in rows]):.0f} ms, scatter "
          f"{median([row[2]['scatter_ms'] for row in rows]):.0f} ms (medians)")


if __name__ == "__main__":
    main()
