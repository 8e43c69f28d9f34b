"""benchmarks/session_timeline.py: the sessions workload's step timeline on a modelled GPU clock, scaled down. A host
hit is sampled in its admission step; with write-through the plans that load host hits carry no stores, and the
tier's turns wait less than without it."""
from __future__ import annotations

from benchmarks.session_timeline import GpuModel, Timeline, Workload, engine_config, summary

SMALL = Workload(sessions=8, turns=5, system_len=128, user_len=32, output_len=16, tool_len=48, think_ms=200.0)


def timeline(host_ratio: float, write_policy: str = "write_back") -> dict[str, float]:
    cfg = engine_config(pool_tokens=1024, host_ratio=host_ratio, write_policy=write_policy, mixed=256)
    tl = Timeline(cfg, GpuModel(), SMALL).run()
    assert len(tl.turns) == SMALL.sessions * SMALL.turns and all(t.first_token_step >= t.admitted_step >= 0
                                                                  for t in tl.turns)
    return summary(tl)


def test_write_through_leaves_the_loading_plans_to_loads() -> None:
    back, through, none = timeline(4.0), timeline(4.0, "write_through"), timeline(0.0)
    assert back["loading_plans"] > 0 and back["stores_per_loading_plan"] > 0
    assert through["loading_plans"] > 0 and through["stores_per_loading_plan"] == 0
    assert back["steps_to_first_token_p50"] == through["steps_to_first_token_p50"] == 0
    assert through["ttft_p50_ms"] <= back["ttft_p50_ms"] < none["ttft_p50_ms"]
    assert none["loading_plans"] == 0
