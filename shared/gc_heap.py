"""The start-up heap, frozen for the garbage collector. A worker holds the model, the tokenizer and every module it
imported for as long as it lives; CPython's oldest-generation collections still walked all of those objects, and
under load one took 180-206 ms in a worker and ~115 ms in a gateway (a 512-request burst on a Zen 5, 2026-12-07),
a pause in every stream at once: most of the ITL p99's tail. vLLM freezes its heap after start-up the same way
(its engine core and API server)."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("kvfleet")


def freeze_startup_heap(what: str) -> int:
    """Collect the young generations (what start-up left there as garbage: cheap, where a full collection took
    ~0.2 s in a worker, at every start), then move every object alive now into the permanent generation, which
    collections skip (`gc.freeze`): refcounting still frees them; only a cycle among them would stay, start-up's
    once. Call it once start-up and the warm-up are done, before serving. -> how many objects it froze."""
    gc.collect(0)
    gc.collect(1)
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: froze the start-up heap (%d objects) out of the garbage collector's scans", what, frozen)
    return frozen
