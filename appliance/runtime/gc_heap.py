"""The garbage collector and the serving loop: objects that live for the whole run are kept out of its passes.

A full (generation 2) collection walks every tracked object of the process. A worker has imported torch, triton
and transformers and built a model: ~450,000 objects, and on an H100 host one such pass took 206-300 ms in the
middle of a Qwen3 throughput run, with the GPU idle for as long (one pass in most 7.5-second runs: the runs with
one were 3-7% slower than the runs without). `gc.freeze()` moves every
object alive at that moment into a permanent generation that collections skip, so later passes walk only what
serving created. vLLM does the same after its start-up (`freeze_gc_heap`); this is our own version of it.

- A pipeline process (worker, scheduler, tokenizer) freezes when it is ready: `freeze_startup_heap`.
  It collects first, so start-up garbage is freed rather than frozen for good. The tokenizer also freezes
  before it waits for its turn, so the pass on its path to ready walks only what came after.
- The offline `LLM` runs each generate() call under `frozen_heap()`: what existed when the call began (the
  engine, the caller's objects) is frozen for the call and thawed after, so a process that builds and drops
  many engines (tests, notebooks) still gets their cycles collected.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Collect, then freeze every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of garbage collection", process, frozen)
    return frozen


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what is alive for the block (no collection first: freezing costs nothing, a full pass does) and
    thaw it afterwards. Where something had frozen objects before (a library, a freeze_startup_heap), the
    block's freeze joins theirs and stays: a thaw cannot tell the two apart, and thawing theirs would undo it."""
    before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not before:
            gc.unfreeze()
