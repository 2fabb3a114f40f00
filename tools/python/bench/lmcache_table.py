"""The table of tools/compare-lmcache.sh: tutti-bench's KV run against LMCache's disk tier.

    python3 lmcache_table.py WORK ROUNDS MACHINE LOAD_START LOAD_END

WORK holds, per round r, ``tutti-r.json`` (tutti-bench --output-format=json), ``lmcache-r.json``
(lmcache_disk.py's object) and ``load-r.txt`` (the 1-minute load average before and after the
round). Prints the definitions, every round, the medians and the ratios; exits 2 naming the file
when a round's report is missing or does not hold what the comparison needs (a round whose
bytes were not all verified is not a figure).
"""

import json
import statistics
import sys

GB = 1e9


class BadReport(Exception):
    pass


def load(path):
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError) as error:
        raise BadReport(f"{path}: {error}") from error


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
            "store_call_share": report["store_call_ns"] / report["store_ns"],
            "report": report,
        }
    except KeyError as error:
        raise BadReport(f"{path}: no {error} in LMCache's report") from error


def median(values):
    return statistics.median(values)


def main():
    work, rounds, machine, load_start, load_end = sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]
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
          f"Python {first['python_version']}); tutti-bench of this checkout (release), "
          f"layers in flight {rows[0][1]['layers_in_flight']}, mapping table "
          f"{rows[0][1]['mapping_table']}")
    print(f"workload: llama3-8b, {first['tokens']} tokens, {kv_bytes:,} bytes of KV "
          f"(32 layers x 2 x {first['tokens']} tokens x 8 heads x 128 x 2 B), GB = 1e9 bytes")
    print(f"LMCache: local disk tier, chunk {first['chunk_tokens']} tokens -> {first['files']} "
          f"files of {first['file_bytes']} bytes, O_DIRECT {'on' if first['o_direct'] else 'OFF'}, "
          f"{first['disk_io_threads']} disk I/O threads, CPU tier off (local_cpu="
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
    print()
    header = (f"{'round':<7}{'load':>12}  {'tutti st':>9}{'tutti rt':>9}  {'wall st':>8}"
              f"{'wall rt':>8}  {'LMC st':>7}{'LMC rt':>7}  {'st ratio':>8}{'rt ratio':>9}"
              f"  {'wall st':>7}{'wall rt':>8}")
    print("GB/s; ratio = tutti/LMCache (layers' time; 'wall' columns: tutti's wall time)")
    print(header)
    ratio_columns = {"store": [], "retrieve": [], "store_wall": [], "retrieve_wall": []}
    for index, tutti, lmcache, load_line in rows:
        ratios = {name: tutti[name] / lmcache[name.split("_")[0]] for name in ratio_columns}
        for name, value in ratios.items():
            ratio_columns[name].append(value)
        print(f"{index:<7}{load_line:>12}  {tutti['store']:>9.2f}{tutti['retrieve']:>9.2f}  "
              f"{tutti['store_wall']:>8.2f}{tutti['retrieve_wall']:>8.2f}  "
              f"{lmcache['store']:>7.2f}{lmcache['retrieve']:>7.2f}  "
              f"{ratios['store']:>8.2f}{ratios['retrieve']:>9.2f}  "
              f"{ratios['store_wall']:>7.2f}{ratios['retrieve_wall']:>8.2f}")

    def column(source, name):
        return median([row[source][name] for row in rows])

    medians = {name: median(values) for name, values in ratio_columns.items()}
    print(f"{'median':<7}{'':>12}  {column(1, 'store'):>9.2f}{column(1, 'retrieve'):>9.2f}  "
          f"{column(1, 'store_wall'):>8.2f}{column(1, 'retrieve_wall'):>8.2f}  "
          f"{column(2, 'store'):>7.2f}{column(2, 'retrieve'):>7.2f}  "
          f"{medians['store']:>8.2f}{medians['retrieve']:>9.2f}  "
          f"{medians['store_wall']:>7.2f}{medians['retrieve_wall']:>8.2f}")
    print("(ratio medians are medians of the per-round ratios)")
    goals = [f"{name} {medians[name]:.2f}x {'met' if medians[name] >= 1.0 else 'MISSED'}"
             for name in ("store", "retrieve")]
    print(f"goal (issue 16 item 4) tutti >= 1.0x LMCache: {', '.join(goals)}")

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
          "(the rest: its disk threads finishing the writes)")


if __name__ == "__main__":
    main()
