"""Overlap scheduling on a real (tiny, CPU) model: greedy tokens and logprobs equal transformers' with prefix
caching on and off, 16-token chunks and preemption, and stops (stop tokens, max_tokens) end the output exactly
where the synchronous loop ends it, although the device computes one step past them."""
from __future__ import annotations

import pytest

from appliance import LLM, SamplingParams
from tests.test_models_vs_transformers import (
    NEW,
    PROMPTS,
    each_setup_matching,
    greedy_references,
)

ARCHS = ["llama", "qwen3"]


@pytest.fixture(scope="module")
def references(make_tiny_model, hf_greedy):
    return greedy_references(ARCHS, make_tiny_model, hf_greedy)


@pytest.mark.parametrize("arch", ARCHS)
def test_overlap_greedy_matches_transformers(arch, make_tiny_model, references):
    for name, _, llm in each_setup_matching(make_tiny_model(arch), references[arch], async_scheduling=True):
        assert llm.engine.overlap
        stats = llm.engine.stats()
        if name.startswith("preempt"):
            assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
        assert llm.engine.check_accounting().ok
        assert stats.blocks_owned == 0 and not llm.engine.has_work()


def test_overlap_stops_where_the_synchronous_loop_stops(make_tiny_model, references):
    path = make_tiny_model("llama")
    refs = references["llama"]
    # a stop token that each prompt's greedy output meets somewhere (3rd token), and short max_tokens
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[ref[0][2]]) for ref in refs]
    params += [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (1, 2, 3, 1, 2, 3)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + PROMPTS]
    got = {}
    for overlap in (False, True):
        llm = LLM(model=str(path), dtype="float32", block_size=4, chunked_prefill_size=16,
                  enable_overlap_schedule=overlap)
        outs = llm.generate(prompts, params)
        got[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        assert llm.engine.check_accounting().ok and llm.engine.stats().blocks_owned == 0
    assert got[True] == got[False]
    for (tokens, reason), ref in zip(got[True][:6], refs):
        cut = ref[0].index(ref[0][2]) + 1
        assert tokens == ref[0][:cut] and reason == "stop"
    assert [len(t) for t, _ in got[True][6:]] == [1, 2, 3, 1, 2, 3]
