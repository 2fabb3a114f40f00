"""A client process of the kill -9 test (run by test_processes.py, never by pytest itself):

    child.py store SOCKET SEED BLOCKS        store and commit prompt SEED, print "committed N"
    child.py store-hang SOCKET SEED BLOCKS   store two layers of prompt SEED, print "storing",
                                             then sleep (to be killed mid-store)
    child.py retrieve SOCKET SEED BLOCKS     look prompt SEED up, retrieve what is found, print
                                             "found N" and "wrong K" (bytes differing)
"""

from __future__ import annotations

import sys
import time

import numpy as np

import tutti
from conftest import FINGERPRINT, GEOMETRY, WAIT_S, block_parts, fill_block, pattern, tokens


def main() -> None:
    mode, socket, seed, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
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
        targets = list(range(blocks, blocks + found))
        with store.prepare_retrieve(prompt, targets) as request:
            for layer in range(GEOMETRY.layers):
                request.retrieve_layer(layer)
                request.wait(WAIT_S)
        wrong = 0
        for index, target in enumerate(targets):
            for part_index, part in enumerate(block_parts(layout, target)):
                wrong += int(np.count_nonzero(part != pattern((seed * 100 + index) * 1000 + part_index, part.size)))
        print("wrong", wrong, flush=True)
    store.close()


if __name__ == "__main__":
    main()
