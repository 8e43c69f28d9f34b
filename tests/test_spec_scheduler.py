"""Speculative decoding in the engine (pure Python): the FakeExecutor plays an MTP worker that holds drafts
(some right, some wrong) and returns 1..d+1 tokens per verification. Every request still generates exactly what
it generates alone (stops mid-chunk drop the rest, max_tokens / max_model_len exact), blocks stay accounted for
through aborts and preemption, and the plan never verifies more drafts than the worker holds."""
from __future__ import annotations

import pytest
from engine_workload import (
    EOS,
    MAX_MODEL_LEN,
    PREFIXES,
    assert_each_generates_what_it_generates_alone,
    config_st,
    drive,
    engine_config,
    ops_st,
    spec_engine,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine import EngineCore, SamplingParams
from appliance.engine.fake_executor import FakeExecutor, reference_generation


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=ops_st(PREFIXES), k=st.integers(1, 3), seed=st.integers(0, 1000))
def test_random_workloads_with_drafts_generate_what_they_generate_alone(cfg: dict, ops: list, k: int,
                                                                        seed: int) -> None:
    config = engine_config({**cfg, "num_speculative_tokens": k})
    ex = FakeExecutor(config.num_blocks, config.block_size, vocab_size=48, num_speculative_tokens=k,
                      max_model_len=MAX_MODEL_LEN, draft_quality=lambda rid, n: (n * seed + len(rid)) % (k + 1))
    core = EngineCore(config, ex)
    run = drive(core, ops, PREFIXES)
    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.blocks_free + stats.blocks_cached == config.num_blocks
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens <= k * stats.spec_num_drafts
    assert_each_generates_what_it_generates_alone(ex, run)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("prefix", [True, False])
def test_all_drafts_right_emits_k_plus_one_per_step_and_stops_exactly(k: int, prefix: bool) -> None:
    core, ex = spec_engine(k, quality=lambda rid, n: k, enable_prefix_caching=prefix, chunked_prefill_size=8)
    prompts = {f"r{i}": [20 + i, 21, 22, 23, 24, 25][: 2 + i] for i in range(4)}
    ref = {rid: reference_generation(ex.next_token, p, 11, MAX_MODEL_LEN, frozenset({EOS}), ignore_eos=True)[0]
           for rid, p in prompts.items()}
    # a stop token that appears in the middle of r1's output: what follows it in the same chunk is dropped
    stop = ref["r1"][5]
    params = {rid: SamplingParams(max_tokens=11, ignore_eos=True, stop_token_ids=[stop] if rid == "r1" else [],
                                  logprobs=0) for rid in prompts}
    for rid, p in prompts.items():
        core.add_request(rid, p, params[rid])
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    sizes: list[int] = []
    while core.has_work():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
            assert d.new_logprobs is not None and len(d.new_logprobs) == len(d.new_token_ids)
            sizes.append(len(d.new_token_ids))
            if d.finished:
                finish[d.request_id] = d.finish_reason
        assert core.check_accounting().ok
    for rid, p in prompts.items():
        want, why = reference_generation(ex.next_token, p, 11, MAX_MODEL_LEN, frozenset({EOS}),
                                         stop_token_ids=params[rid].stop_token_ids, ignore_eos=True)
        assert out[rid] == want and finish[rid] == why, rid
    assert finish["r1"] == "stop" and len(out["r1"]) == ref["r1"].index(stop) + 1
    assert max(sizes) == k + 1
    s = core.stats()
    assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens > 0  # every verified draft was right
    assert s.spec_acceptance_rate == 1.0 and s.spec_mean_accepted_length > 1.0


def test_all_drafts_wrong_is_one_token_per_step() -> None:
    core, ex = spec_engine(3, quality=lambda rid, n: 0)
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=9, ignore_eos=True))
    got: list[int] = []
    while core.has_work():
        for d in core.step():
            assert len(d.new_token_ids) == 1
            got.extend(d.new_token_ids)
    assert got == reference_generation(ex.next_token, [5, 6, 7], 9, MAX_MODEL_LEN, ignore_eos=True)[0]
    s = core.stats()
    assert s.spec_num_accepted_tokens == 0 and s.spec_num_draft_tokens > 0 and s.spec_acceptance_rate == 0.0


def test_max_model_len_is_exact_and_lookahead_never_passes_it() -> None:
    core, ex = spec_engine(4, quality=lambda rid, n: 4, max_model_len=20, num_blocks=5, block_size=4)
    core.add_request("a", list(range(1, 14)), SamplingParams(max_tokens=None, ignore_eos=True))
    got: list[int] = []
    while core.has_work():
        for d in core.step():
            got.extend(d.new_token_ids)
        assert all(len(r.block_ids) <= 5 for r in core.scheduler.requests.values())
    want, why = reference_generation(ex.next_token, list(range(1, 14)), None, 20, ignore_eos=True)
    assert got == want and len(got) == 7


def test_thinking_budget_requests_never_verify_drafts() -> None:
    """Its processor cannot roll back rejected drafts, so the worker holds none for it (structured outputs do verify
    drafts: tests/test_spec_structured.py)."""
    core, ex = spec_engine(2, quality=lambda rid, n: 2)
    sp = SamplingParams(max_tokens=6, ignore_eos=True, extra={"thinking_budget": {"budget": 2, "end_token_ids": [5]}})
    core.add_request("g", [3, 4, 5], sp)
    while core.has_work():
        for d in core.step():
            assert len(d.new_token_ids) == 1
    assert all(s.num_tokens == 1 for p in ex.plans[1:] for s in p.scheduled)
    assert core.stats().spec_num_drafts == 0


@pytest.mark.parametrize("reads_next, hit", [(True, 8), (False, 12)], ids=["mtp_or_eagle", "draft_model_or_ngram"])
def test_prefix_hit_gives_back_its_last_block_where_the_drafter_read_the_next_token(reads_next: bool,
                                                                                    hit: int) -> None:
    """A drafter whose cache at a position read the token after it (MTP, EAGLE) cannot reuse the hit's last
    position; a draft model's cache and n-gram lookup keep the whole hit."""
    core, ex = spec_engine(2, block_size=4, spec_drafter_reads_next=reads_next)
    prompt = list(range(1, 14))  # 3 full blocks + 1
    core.add_request("a", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while core.has_work():
        core.step()
    core.add_request("b", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    core.step()
    new = ex.plans[-1].new_requests[0]
    assert new.num_computed_tokens == hit  # 3 blocks match; the last one is recomputed for an MTP/EAGLE drafter


def test_preemption_and_abort_mid_speculation_keep_the_pool_whole() -> None:
    # 10 blocks of 2 tokens for three requests that each want up to 20: preemption is certain
    core, ex = spec_engine(3, quality=lambda rid, n: n % 4, num_blocks=10, block_size=2, max_model_len=20,
                            chunked_prefill_size=4)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}
    for rid, p in prompts.items():
        core.add_request(rid, p, SamplingParams(max_tokens=14, ignore_eos=True))
    out: dict[str, list[int]] = {}
    for i in range(400):
        if not core.has_work():
            break
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        if i == 6:
            assert core.abort("c")
        assert core.check_accounting().ok
    assert core.stats().num_preemptions > 0
    for rid in ("a", "b"):
        assert out[rid] == reference_generation(ex.next_token, prompts[rid], 14, 20, ignore_eos=True)[0]
    assert core.stats().blocks_owned == 0
