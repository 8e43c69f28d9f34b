"""runtime/gc_heap.py: start-up garbage is collected before the freeze, a frozen block's objects are out of
collections only inside it, and an offline generate() call runs frozen."""
from __future__ import annotations

import gc
import weakref

import pytest
from spec_fixtures import tiny_v3  # noqa: F401  (fixture)

from appliance.runtime.gc_heap import freeze_startup_heap, frozen_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def thawed():
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_startup_freeze_collects_garbage_first(thawed) -> None:
    dead = weakref.ref(Node())
    kept = Node()
    assert dead() is not None  # unreachable, but a cycle: still there until a collection
    frozen = freeze_startup_heap("test")
    assert dead() is None  # collected, not frozen for good
    # objects freed since the freeze (other threads of the test process run on) leave the permanent generation
    assert frozen >= gc.get_freeze_count() > max(1000, frozen - 100)
    ref = weakref.ref(kept)
    del kept
    gc.collect()
    assert ref() is not None  # frozen: a full collection leaves it alone


def test_frozen_heap_holds_only_inside_the_block(thawed) -> None:
    node = Node()
    ref = weakref.ref(node)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert ref() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_frozen_heap_inside_a_frozen_process_freezes_the_rest_and_thaws_nothing(thawed) -> None:
    freeze_startup_heap("test")
    before = gc.get_freeze_count()
    later = [Node() for _ in range(200)]
    with frozen_heap():
        assert gc.get_freeze_count() >= before + 200  # what came after the start-up freeze is frozen too
        assert not any(o is later[0] for o in gc.get_objects())
    # and nothing is thawed: the start-up freeze holds (a thaw would drop the count to 0). The margin is for the
    # block's own generator and frame, frozen inside it and freed at its exit.
    assert gc.get_freeze_count() >= before + 100


def test_generate_runs_with_the_heap_frozen(thawed, tiny_model) -> None:
    from appliance import LLM, SamplingParams

    llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, max_total_tokens=1024)
    seen: list[int] = []
    step = llm.engine.step

    def counting_step():
        seen.append(gc.get_freeze_count())
        return step()

    llm.engine.step = counting_step
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert seen and min(seen) > 1000
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "mtp"])
def test_a_dropped_engine_is_freed_by_refcounts_alone(thawed, request: pytest.FixtureRequest, spec: bool) -> None:
    """On a GPU host something freezes the heap before the engine exists, so frozen_heap's freeze stays and a
    reference cycle through the engine would keep its KV cache alive for good (a speculative runner <->
    speculator cycle once held three 24 GB engines in one test process)."""
    from appliance import LLM, SamplingParams

    path = request.getfixturevalue("tiny_v3" if spec else "tiny_model")
    extra = {"speculative_algorithm": "MTP", "speculative_num_steps": 1} if spec else {}
    gc.freeze()  # like a GPU host: frozen before the engine was built
    gc.disable()  # only reference counts may free it
    try:
        llm = LLM(model=str(path), dtype="float32", block_size=16, max_total_tokens=1024, skip_tokenizer_init=True,
                  **extra)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3))
        runner = weakref.ref(llm.executor.runner)
        del llm
        assert runner() is None
    finally:
        gc.enable()
