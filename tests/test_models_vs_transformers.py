"""Greedy tokens and logprobs of every architecture equal transformers' under batching, chunked prefill,
prefix caching and preemption (CPU, float32, tiny random-weight models)."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from appliance import LLM, SamplingParams

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
SHARED = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41]  # a 10-token prefix shared by two prompts (prefix-cache hits)
# one-token and 17-token prompts give one-token prefill chunks, which take the decode-attention path
PROMPTS = [[5, 6, 7, 8, 9], SHARED + [50, 51, 52, 53, 54, 55, 56, 57, 58], [90] * 3 + list(range(100, 126)),
           SHARED + [60, 61], [77], list(range(200, 217))]
NEW = 8

# (name, overrides): caching on with one big chunk; off with 16-token chunks; on with 16-token chunks and a
# cache of 64 tokens, smaller than the batch needs, so requests are preempted and recomputed
SETUPS = [
    ("prefix_on_big_chunks", {"enable_prefix_caching": True, "chunked_prefill_size": 8192}),
    ("prefix_off_chunk16", {"enable_prefix_caching": False, "chunked_prefill_size": 16}),
    # no output reservation at admission (schedule_conservativeness 0): the tiny cache must force preemption
    ("preempt_chunk16", {"enable_prefix_caching": True, "chunked_prefill_size": 16, "max_total_tokens": 64,
                         "max_model_len": 64, "schedule_conservativeness": 0.0}),
]


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)


def greedy_references(archs: list[str], make_tiny_model, hf_greedy) -> dict[str, list]:
    """arch -> transformers' greedy (tokens, logprobs) of every prompt: the oracle."""
    return {arch: hf_greedy(make_tiny_model(arch), PROMPTS, NEW) for arch in archs}


def each_setup_matching(path, refs: list, prepare: Callable[[LLM], None] | None = None,
                        setups: list[tuple[str, dict]] = SETUPS, **llm_kwargs) -> Iterator[tuple[str, dict, LLM]]:
    """For each of `setups`: an LLM on path (handed to `prepare` first, when given) whose greedy tokens and
    logprobs on PROMPTS were checked against refs (and the cumulative logprob against their sum); the caller
    checks the rest before the next one."""
    params = greedy_params()
    for name, overrides in setups:
        llm = LLM(model=str(path), dtype="float32", block_size=4, **llm_kwargs, **overrides)
        if prepare is not None:
            prepare(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for out, (ref_tokens, ref_lps) in zip(outs, refs):
            got = out.outputs[0]
            assert got.token_ids == ref_tokens, (name, out.prompt_token_ids)
            ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
            assert ours == pytest.approx(ref_lps, abs=1e-4), name
            assert got.cumulative_logprob == pytest.approx(sum(ref_lps), abs=1e-3)
        yield name, overrides, llm


@pytest.fixture(scope="module")
def references(make_tiny_model, hf_greedy):
    return greedy_references(ARCHS, make_tiny_model, hf_greedy)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, make_tiny_model, references):
    for name, overrides, llm in each_setup_matching(make_tiny_model(arch), references[arch]):
        stats = llm.engine.stats()
        if name.startswith("preempt"):
            assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
        if overrides["enable_prefix_caching"] and not name.startswith("preempt"):
            # a second pass over the same prompts hits the prefix cache and still matches
            again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params())
            assert [o.outputs[0].token_ids for o in again] == [r[0] for r in references[arch]]
            assert sum(o.num_cached_tokens for o in again) > 0
        assert llm.engine.check_accounting().ok
