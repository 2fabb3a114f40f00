"""A client process of the kill -9 test (run by test_processes.py, never by pytest itself):

    child.py store SOCKET SEED BLOCKS        store and commit prompt SEED, print "committed N"
    child.py store-hang SOCKET SEED BLOCKS   store two layers of prompt SEED, print "storing",
                                             then sleep (to be killed mid-store)
    child.py retrieve SOCKET SEED BLOCKS     look prompt SEED up, retrieve what is found, print
                                             "found N" and "wrong K" (bytes differing)
    child.py device-retrieve SOCKET SEED BLOCKS
                                             as retrieve, into a DeviceMemoryStandIn registered
                                             as device memory (test_device_memory.py), whose
                                             blocks 0..BLOCKS the parent filled with seeds 50..
"""

from __future__ import annotations

import sys
import time

import numpy as np

import tutti
from conftest import FINGERPRINT, GEOMETRY, WAIT_S, block_parts, fill_block, pattern, tokens


def main() -> None:
    mode, socket, seed, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "device-retrieve":
        device_retrieve(socket, seed, blocks)
        return
    store = tutti.Store.attach(socket, model_fingerprint=FINGERPRINT, client_name=f"child-{mode}-{seed}")
    layout = store.allocate_kv(2 * blocks, "paged")
    prompt = tokens(seed, blocks)
    if mode in ("store", "store-hang"):
        for block in range(blocks):
            fill_block(layout, block, seed * 100 + block)
        request = store.prepare_store(prompt, list(range(blocks)))
        layers = GEOMETRY.layers if mode == "store" else 2
        for layer in range(layers):
            request.store_layer(layer)
            request.wait(WAIT_S)
        if mode == "store":
            print("committed", request.commit(), flush=True)
            return
        print("storing", flush=True)
        time.sleep(3 * WAIT_S)
        return
    found = store.lookup(prompt)
    print("found", found, flush=True)
    if found:
        wrong = retrieve_and_count_wrong(store, layout, prompt, list(range(blocks, blocks + found)), seed * 100)
        print("wrong", wrong, flush=True)
    store.close()


def retrieve_and_count_wrong(store, layout, prompt, targets: list[int], first_fill: int) -> int:
    """Retrieves `prompt`'s cached blocks into `targets`, layer by layer, and counts the bytes
    that differ from what `fill_block` wrote (fill `first_fill + i` for the i-th block)."""
    with store.prepare_retrieve(prompt, targets) as request:
        for layer in range(GEOMETRY.layers):
            request.retrieve_layer(layer)
            request.wait(WAIT_S)
    wrong = 0
    for index, target in enumerate(targets):
        for part_index, part in enumerate(block_parts(layout, target)):
            wrong += int(np.count_nonzero(part != pattern((first_fill + index) * 1000 + part_index, part.size)))
    return wrong


def device_retrieve(socket: str, seed: int, blocks: int) -> None:
    from test_device_memory import BLOCKS, GEOMETRY as DEVICE_GEOMETRY, LAYER_BYTES, LEAD_BYTES, stand_in_layout

    stand_in = tutti.DeviceMemoryStandIn(LEAD_BYTES + DEVICE_GEOMETRY.layers * LAYER_BYTES)
    layout = stand_in_layout(stand_in)
    store = tutti.Store.attach(socket, model_fingerprint=FINGERPRINT, client_name="child-device-retrieve")
    store.register_kv(layout)
    prompt = tokens(seed, blocks)
    found = store.lookup(prompt)
    print("found", found, flush=True)
    wrong = retrieve_and_count_wrong(store, layout, prompt, list(range(BLOCKS - found, BLOCKS)), 50)
    print("wrong", wrong, flush=True)
    store.close()


if __name__ == "__main__":
    main()
