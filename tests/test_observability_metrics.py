"""MetricsRegistry: request events and scheduler snapshots move the exposition's numbers as they should."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.sampling_params import SamplingParams
from appliance.observability.metrics import MetricsRegistry, build_1_2_5_buckets
from appliance.observability.stats import StatsSnapshot, snapshot_from_core

M = "m"


def scrape(reg: MetricsRegistry) -> dict[tuple[str, tuple], float]:
    body, ctype = reg.render()
    assert ctype.startswith("text/plain")
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": M, **labels}.items())))]


def test_request_lifecycle_observes_latencies_and_counts_tokens() -> None:
    reg = MetricsRegistry(M, max_model_len=1000)
    reg.on_request_arrived("a", num_prompt_tokens=7, max_tokens=16, now=100.0)
    reg.on_request_arrived("b", num_prompt_tokens=3, now=100.0)
    s = scrape(reg)
    assert val(s, "appliance:num_requests_in_flight") == 2
    assert val(s, "appliance:prompt_tokens_total") == 0

    reg.on_request_scheduled("a", 100.5)
    reg.on_request_scheduled("a", 101.5)  # a later (re)scheduling keeps the first
    reg.on_tokens("a", 1, now=101.0)  # ttft 1.0
    reg.on_tokens("a", 2, now=101.25)  # itl 0.25
    reg.on_tokens("a", 1, now=101.5)  # itl 0.25
    s = scrape(reg)
    assert val(s, "appliance:prompt_tokens_total") == 7
    assert val(s, "appliance:generation_tokens_total") == 4
    assert val(s, "appliance:time_to_first_token_seconds_count") == 1
    assert val(s, "appliance:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert val(s, "appliance:time_to_first_token_seconds_bucket", le="0.75") == 0
    assert val(s, "appliance:time_to_first_token_seconds_bucket", le="1.0") == 1
    assert val(s, "appliance:inter_token_latency_seconds_count") == 2
    assert val(s, "appliance:inter_token_latency_seconds_sum") == pytest.approx(0.5)

    reg.on_request_finished("a", "length", now=102.0)
    reg.on_request_finished("b", "abort", now=103.0)  # aborted before any token
    s = scrape(reg)
    assert val(s, "appliance:request_success_total", finished_reason="length") == 1
    assert val(s, "appliance:request_success_total", finished_reason="abort") == 1
    assert val(s, "appliance:num_requests_in_flight") == 0
    assert val(s, "appliance:e2e_request_latency_seconds_count") == 2
    assert val(s, "appliance:e2e_request_latency_seconds_sum") == pytest.approx(2.0 + 3.0)
    assert val(s, "appliance:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert val(s, "appliance:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert val(s, "appliance:request_decode_time_seconds_sum") == pytest.approx(0.5)
    assert val(s, "appliance:request_decode_time_seconds_count") == 1  # b produced no token
    assert val(s, "appliance:request_inference_time_seconds_sum") == pytest.approx(1.0)
    assert val(s, "appliance:request_time_per_output_token_seconds_sum") == pytest.approx(0.5 / 3)
    assert val(s, "appliance:request_generation_tokens_sum") == 4
    assert val(s, "appliance:request_prompt_tokens_sum") == 10
    assert val(s, "appliance:request_params_max_tokens_count") == 1
    assert val(s, "appliance:prompt_tokens_total") == 7  # b never prefilled


def test_queue_and_prefill_are_not_observed_without_a_scheduled_time() -> None:
    reg = MetricsRegistry(M)
    reg.on_request_arrived("a", 2, now=0.0)
    reg.on_tokens("a", 1, now=1.0)
    reg.on_request_finished("a", "stop", now=1.0)
    s = scrape(reg)
    assert val(s, "appliance:request_queue_time_seconds_count") == 0
    assert val(s, "appliance:request_prefill_time_seconds_count") == 0
    assert val(s, "appliance:request_time_per_output_token_seconds_count") == 0  # one token: no TPOT
    assert val(s, "appliance:e2e_request_latency_seconds_count") == 1
    reg.on_request_arrived("z", 1, now=0.0)  # a clock reading of 0.0 is a time like any other
    reg.on_tokens("z", 1, now=0.0)
    reg.on_tokens("z", 1, now=0.25)
    assert val(scrape(reg), "appliance:inter_token_latency_seconds_sum") == pytest.approx(0.25)


def test_bad_request_events() -> None:
    reg = MetricsRegistry(M)
    reg.on_request_arrived("a", 1, now=0.0)
    with pytest.raises(ValueError):
        reg.on_request_arrived("a", 1, now=0.0)
    with pytest.raises(ValueError):
        reg.on_tokens("a", -1)
    reg.on_tokens("ghost", 3)  # finished / unknown: ignored, not counted
    reg.on_request_finished("ghost", "stop")
    reg.on_request_finished("a", "stop", now=1.0)
    reg.on_request_finished("a", "abort", now=2.0)  # an abort racing the last output: counted once
    s = scrape(reg)
    assert val(s, "appliance:generation_tokens_total") == 0
    assert val(s, "appliance:request_success_total", finished_reason="stop") == 1
    assert ("appliance:request_success_total", (("finished_reason", "abort"), ("model_name", M))) not in s
    assert val(s, "appliance:e2e_request_latency_seconds_count") == 1
    reg.on_http_error(429)
    assert val(scrape(reg), "appliance:request_errors_total", status="429") == 1


def snap(ts: float, **kw: int) -> StatsSnapshot:
    base = dict(kv_blocks_total=10, kv_blocks_free=6, kv_blocks_cached=1, kv_blocks_owned=3)
    base.update(kw)
    return StatsSnapshot(timestamp=ts, **base)


def test_snapshots_set_gauges_and_advance_counters_by_difference() -> None:
    reg = MetricsRegistry(M, spec_decode=True)
    reg.update_from_snapshot(snap(1.0, num_running=2, num_waiting=5, prefix_cache_queries=100,
                                  prefix_cache_hits=40, num_preemptions=1, spec_num_drafts=3,
                                  spec_num_draft_tokens=9, spec_num_accepted_tokens=6))
    reg.update_from_snapshot(snap(2.0, num_running=1, num_waiting=0, prefix_cache_queries=150,
                                  prefix_cache_hits=90, num_preemptions=3, spec_num_drafts=4,
                                  spec_num_draft_tokens=12, spec_num_accepted_tokens=6))
    reg.update_from_snapshot(snap(1.5, num_running=9))  # stale: ignored
    s = scrape(reg)
    e = {"engine": "0"}
    assert val(s, "appliance:num_requests_running", **e) == 1
    assert val(s, "appliance:num_requests_waiting", **e) == 0
    assert val(s, "appliance:kv_cache_usage_perc", **e) == pytest.approx(0.3)
    assert val(s, "appliance:kv_blocks_cached", **e) == 1
    assert val(s, "appliance:kv_accounting_drift_blocks", **e) == 0
    assert val(s, "appliance:prefix_cache_queries_total", **e) == 150
    assert val(s, "appliance:prefix_cache_hits_total", **e) == 90
    assert val(s, "appliance:prefix_cache_hit_rate", **e) == pytest.approx(0.6)
    assert val(s, "appliance:num_preemptions_total", **e) == 3
    assert val(s, "appliance:spec_decode_num_draft_tokens_total", **e) == 12
    assert val(s, "appliance:spec_decode_num_accepted_tokens_total", **e) == 6
    assert val(s, "appliance:spec_decode_acceptance_rate", **e) == pytest.approx(0.5)
    assert val(s, "appliance:stats_snapshot_timestamp_seconds", **e) == 2.0

    # the engine restarted: its counters start over, and the new values are increments
    reg.update_from_snapshot(snap(3.0, prefix_cache_queries=20, prefix_cache_hits=5))
    # drift: a block counted twice
    reg.update_from_snapshot(snap(4.0, kv_blocks_free=7, prefix_cache_queries=20, prefix_cache_hits=5))
    # a second DP rank has its own series
    reg.update_from_snapshot(StatsSnapshot(timestamp=1.0, dp_rank=1, num_running=4, prefix_cache_queries=8))
    s = scrape(reg)
    assert val(s, "appliance:prefix_cache_queries_total", **e) == 170
    assert val(s, "appliance:kv_accounting_drift_blocks", **e) == -1
    assert val(s, "appliance:num_requests_running", engine="1") == 4
    assert val(s, "appliance:prefix_cache_queries_total", engine="1") == 8


def test_spec_metrics_only_exist_when_spec_decode_is_on() -> None:
    reg = MetricsRegistry(M)
    reg.update_from_snapshot(snap(1.0))
    assert not any(name.startswith("appliance:spec_decode") for name, _ in scrape(reg))


def test_snapshot_dict_roundtrip_and_validation() -> None:
    s = snap(5.0, num_running=2, prefix_cache_queries=4, prefix_cache_hits=1)
    assert StatsSnapshot.from_dict(s.to_dict()) == s
    import msgpack
    assert StatsSnapshot.from_dict(msgpack.unpackb(msgpack.packb(s.to_dict()))) == s
    from appliance.runtime.wire import Codec  # the pipeline's typed wire carries it as is
    codec = Codec(StatsSnapshot)
    assert codec.decode(codec.encode(s)) == s
    with pytest.raises(ValueError):
        StatsSnapshot.from_dict({"timestamp": 1.0, "bogus": 1})
    with pytest.raises(ValueError):
        StatsSnapshot.from_dict({"num_running": 1})
    with pytest.raises(ValueError):
        StatsSnapshot(timestamp=1.0, num_running=-1)
    with pytest.raises(ValueError):
        StatsSnapshot(timestamp=1.0, prefix_cache_queries=1, prefix_cache_hits=2)


def test_snapshot_from_a_real_engine_run_feeds_the_registry() -> None:
    cfg = EngineConfig(num_blocks=16, block_size=4, max_model_len=64)
    core = EngineCore(cfg, FakeExecutor(16, 4))
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    core.add_request("a", prompt, SamplingParams(max_tokens=2))
    s0 = snapshot_from_core(core, timestamp=1.0)
    assert (s0.num_waiting, s0.num_running, s0.kv_blocks_owned) == (1, 0, 0)
    while core.has_work():
        core.step()
    core.add_request("b", prompt, SamplingParams(max_tokens=2))  # same prompt: 3 blocks hit
    core.step()
    s1 = snapshot_from_core(core, timestamp=2.0)
    assert s1.num_running == 1 and s1.kv_blocks_owned > 0
    assert (s1.prefix_cache_queries, s1.prefix_cache_hits) == (26, 12)
    assert s1.kv_accounting_drift == 0
    assert s1.kv_blocks_free + s1.kv_blocks_cached + s1.kv_blocks_owned == 16
    cheap = snapshot_from_core(core, timestamp=2.0, verify_accounting=False)
    assert cheap == s1
    # a pool whose lists and refcounts disagree shows up as drift (simulated corruption: a block both owned
    # and on the free list)
    core.scheduler.pool._free.append(core.get_request("b").block_ids[-1])
    assert snapshot_from_core(core, timestamp=3.0).kv_accounting_drift == -1
    core.scheduler.pool._free.pop()
    reg = MetricsRegistry(M)
    reg.update_from_snapshot(s0)
    reg.update_from_snapshot(s1)
    s = scrape(reg)
    assert val(s, "appliance:prefix_cache_hits_total", engine="0") == 12
    assert val(s, "appliance:kv_cache_usage_perc", engine="0") == pytest.approx(s1.kv_blocks_owned / 16)


def test_token_buckets() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    with pytest.raises(ValueError):
        build_1_2_5_buckets(0)


def test_every_metric_is_documented() -> None:
    import pathlib

    doc = (pathlib.Path(__file__).parents[1] / "docs" / "observability.md").read_text()
    reg = MetricsRegistry(M, spec_decode=True)
    for fam in reg.registry.collect():
        suffix = "_total" if fam.type == "counter" else ""
        assert f"`{fam.name}{suffix}`" in doc, f"{fam.name} is not in docs/observability.md"
