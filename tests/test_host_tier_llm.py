"""The host KV tier through the offline API on a small random model (CPU): the device pool holds 32 blocks of 4
tokens, so other prompts evict a session's history between its turns; the history comes back from the host and
the answers are token-exact with a cold prefill (prefix caching off), while the reported cached tokens count
the host hits."""
from __future__ import annotations

from pathlib import Path

from appliance import LLM
from appliance.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def turns() -> list[list[list[int]]]:
    """Turn 1 of two sessions, a flood of distinct prompts that needs the whole pool, turn 2 of both sessions
    (their turn-1 prompts extended), another flood, turn 3."""
    s = [list(range(10, 58)), list(range(60, 100))]
    flood = [[list(range(200 + 80 * i + 40 * t, 200 + 80 * i + 40 * t + 60)) for i in range(2)] for t in range(2)]
    return [s, flood[0], [p + list(range(120, 132)) for p in s], flood[1],
            [p + list(range(120, 132)) + list(range(140, 148)) for p in s]]


def test_host_tier_reload_matches_a_cold_prefill(tiny_model: Path) -> None:
    common = dict(model=str(tiny_model), dtype="float32", block_size=4, max_total_tokens=128, max_model_len=96)
    tiered = LLM(**common, host_cache=True, host_cache_ratio=4)
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
