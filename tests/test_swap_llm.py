"""Preemption by swap through the offline API on a small random model (CPU): a device pool of 24 blocks of 4 tokens
and no room reserved for outputs, so running requests are preempted; swapped ones resume from their host slots
and every output is token-exact with a pool that never preempts. With auto, the workers' measured rates are
logged and given to the scheduler."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from appliance import LLM
from appliance.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [list(range(10 + 40 * i, 30 + 40 * i + 2 * i)) for i in range(5)]


def common(tiny_model: Path) -> dict:
    return {"model": str(tiny_model), "dtype": "float32", "block_size": 4, "max_model_len": 64}


def test_swapped_requests_give_the_tokens_of_a_pool_that_never_preempts(tiny_model: Path) -> None:
    want = [o.outputs[0].token_ids for o in LLM(**common(tiny_model), max_total_tokens=1024).generate(PROMPTS, GREEDY)]
    llm = LLM(**common(tiny_model), max_total_tokens=96, schedule_conservativeness=0, host_cache=True,
              host_cache_ratio=4, preemption_mode="swap")
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.cache.host.num_swapped_in > 0
    counts = llm.engine.stats().tier_counts
    assert counts["tier_swapped_out"] >= counts["tier_swapped_in"] == sched.cache.host.num_swapped_in
    assert llm.engine.check_accounting().ok, llm.engine.check_accounting().problems


def test_auto_prices_swaps_with_rates_measured_at_start_up(tiny_model: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="appliance.executor.swap_cost"):
        llm = LLM(**common(tiny_model), max_total_tokens=96, schedule_conservativeness=0, host_cache=True,
                  host_cache_ratio=4, preemption_mode="auto")
    costs = llm.engine.scheduler.swap.costs
    assert costs is not None and costs.copy_gbps > 0 and costs.prefill_tok_s > 0
    assert costs.bytes_per_block == llm.executor.runner.kv_spec.bytes_per_block
    assert any("preemption costs measured" in r.getMessage() for r in caplog.records)
    want = [o.outputs[0].token_ids for o in LLM(**common(tiny_model), max_total_tokens=1024).generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert llm.engine.check_accounting().ok
