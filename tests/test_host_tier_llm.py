"""The host KV tier through the offline API on a small random model (CPU): the device pool holds 32 blocks of 4
tokens, so other prompts evict a session's history between its turns; the history comes back from the host and
the answers are token-exact with a cold prefill (prefix caching off), while the reported cached tokens count
the host hits; blocks copied to the host when evicted or written through once cached."""
from __future__ import annotations

from pathlib import Path

import pytest
from tier_fixtures import llm_args, turns

from appliance import LLM
from appliance.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_host_tier_reload_matches_a_cold_prefill(tiny_model: Path, write_policy: str) -> None:
    common = llm_args(tiny_model)
    tiered = LLM(**common, host_cache=True, host_cache_ratio=4, host_cache_write_policy=write_policy)
    assert tiered.engine.config.host_cache_write_policy == write_policy
    cold = LLM(**common, enable_prefix_caching=False)  # every prompt prefilled whole
    cached: list[list[int]] = []
    for batch in turns():
        ours = tiered.generate(batch, GREEDY)
        ref = cold.generate(batch, GREEDY)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in ref]
        cached.append([o.num_cached_tokens for o in ours])
        assert tiered.engine.check_accounting().ok, tiered.engine.check_accounting().problems
    host = tiered.engine.scheduler.cache.host
    assert host is not None and host.num_stored > 0 and host.num_loaded > 0
    # turns 2 and 3 reuse their session's earlier prompt though the floods filled the device pool in between
    assert all(c >= 40 for c in cached[2] + cached[4]), cached
    # without the tier the floods leave less to reuse
    device_only = LLM(**common)
    alone = [[o.num_cached_tokens for o in device_only.generate(batch, GREEDY)] for batch in turns()]
    assert sum(alone[2] + alone[4]) < sum(cached[2] + cached[4]), (alone, cached)
