"""EngineCore end to end against the FakeExecutor: outputs equal a request run alone, whatever the batching."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from appliance.engine import EngineConfig, EngineCore, QueueFull, RequestDelta, SamplingParams
from appliance.engine.fake_executor import FakeExecutor, reference_generation
from appliance.engine.prefix_cache import BLOCK_REMOVED, BLOCK_STORED

EOS = 0


def make_core(vocab: int = 50, **cfg) -> tuple[EngineCore, FakeExecutor]:
    cfg.setdefault("block_size", 4)
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("eos_token_ids", {EOS})
    config = EngineConfig(**cfg)
    ex = FakeExecutor(config.num_blocks, config.block_size, vocab_size=vocab)
    return EngineCore(config, ex), ex


def drain(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[RequestDelta]]:
    out: dict[str, list[RequestDelta]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return out
        for d in core.step():
            assert d.request_id not in out or not out[d.request_id][-1].finished, "delta after finish"
            out.setdefault(d.request_id, []).append(d)
        rep = core.check_accounting()
        assert rep.ok, rep.problems
    raise AssertionError("engine did not finish")


def prompts() -> dict[str, list[int]]:
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    return {
        "short": [3, 4],
        "one-block": [21, 22, 23, 24],
        "shared-a": shared + [1, 2, 3],
        "shared-b": shared + [4, 4, 4, 4, 4, 4, 4, 4, 4, 4],
        "long": list(range(100, 137)),
        "shared-c": shared,
    }


CONFIGS = {
    "chunk16-prefix": dict(num_blocks=64, chunked_prefill_size=16),
    "chunk16-noprefix": dict(num_blocks=64, chunked_prefill_size=16, enable_prefix_caching=False),
    "chunk-large": dict(num_blocks=64, chunked_prefill_size=4096),
    "no-chunking": dict(num_blocks=64, chunked_prefill_size=-1, max_prefill_tokens=20),
    "tiny-pool-preempts": dict(num_blocks=16, chunked_prefill_size=16),
    "tiny-pool-no-chunking": dict(num_blocks=16, chunked_prefill_size=-1, max_prefill_tokens=16),
    "two-seats-lpm": dict(num_blocks=64, chunked_prefill_size=16, max_num_seqs=2, policy="lpm"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_equal_each_request_run_alone(name: str) -> None:
    core, ex = make_core(**CONFIGS[name])
    params = SamplingParams(max_tokens=20)
    for rid, p in prompts().items():
        core.add_request(rid, p, params)
    out = drain(core)
    for rid, p in prompts().items():
        want, reason = reference_generation(ex.next_token, p, 20, 64, frozenset({EOS}))
        got = [t for d in out[rid] for t in d.new_token_ids]
        assert got == want and out[rid][-1].finish_reason == reason, rid
        assert all(d.num_prompt_tokens == len(p) for d in out[rid])
    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.num_running == stats.num_waiting == 0
    assert stats.blocks_free + stats.blocks_cached == stats.blocks_total
    assert ex.state == {} or all(rid in out for rid in ex.state)  # workers only hold finished requests
    if name.startswith("tiny-pool"):
        assert stats.num_preemptions > 0
    if "noprefix" in name:
        assert stats.blocks_cached == 0 and stats.prefix_hit_rate == 0.0


def test_prefix_hits_are_reported_per_request_and_in_stats() -> None:
    core, _ = make_core(num_blocks=64, chunked_prefill_size=64)
    core.add_request("first", list(range(1, 11)), SamplingParams(max_tokens=2, ignore_eos=True))
    drain(core)
    core.add_request("second", list(range(1, 11)) + [77], SamplingParams(max_tokens=2, ignore_eos=True))
    out = drain(core)
    assert out["second"][0].num_cached_tokens == 8  # two full blocks of 4
    assert core.stats().prefix_hit_rate == pytest.approx(8 / (10 + 11))


def test_abort_mid_prefill_and_mid_decode_frees_blocks_now() -> None:
    core, ex = make_core(num_blocks=64, chunked_prefill_size=8)
    core.add_request("long", list(range(1, 40)), SamplingParams(max_tokens=5))
    core.add_request("dec", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True))
    core.step()
    assert core.get_request("long").num_computed_tokens < 39  # still prefilling
    assert core.abort("long") and not core.abort("long")
    core.step()
    assert "long" not in ex.state and ex.plans[-1].finished_ids == ["long"]
    assert core.abort("dec")
    assert core.stats().blocks_owned == 0 and core.check_accounting().ok
    assert not core.has_work() and core.step() == []


def test_logprobs_and_prompt_logprobs_reach_the_delta() -> None:
    core, _ = make_core(num_blocks=64, chunked_prefill_size=4)  # prompt spans 3 chunks
    core.add_request("lp", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=3, logprobs=2,
                                                                         prompt_logprobs=1, ignore_eos=True))
    core.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    out = drain(core)
    lp = out["lp"]
    assert all(d.new_logprobs is not None and len(d.new_logprobs) == 1 for d in lp)
    assert all(len(d.new_logprobs[0].top_logprobs) == 2 for d in lp)
    assert all(d.new_logprobs[0].token_id == d.new_token_ids[0] for d in lp)
    assert lp[0].prompt_logprobs is not None and len(lp[0].prompt_logprobs) == 10
    assert lp[0].prompt_logprobs[0] is None and lp[0].prompt_logprobs[3] == ((4, -0.125 * 4),)
    assert all(d.prompt_logprobs is None for d in lp[1:])
    assert all(d.new_logprobs is None and d.prompt_logprobs is None for d in out["plain"])


def test_kv_events_are_published_for_stores_and_evictions() -> None:
    events: list[tuple] = []
    config = EngineConfig(num_blocks=4, block_size=4, max_model_len=16, chunked_prefill_size=16)
    core = EngineCore(config, FakeExecutor(4, 4), on_kv_event=lambda *e: events.append(e))
    core.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=1))
    drain(core)
    stored = [e for e in events if e[0] == BLOCK_STORED]
    assert [e[3] for e in stored] == [(1, 2, 3, 4), (5, 6, 7, 8)] and stored[1][2] == stored[0][1]
    core.add_request("b", list(range(50, 63)), SamplingParams(max_tokens=1))
    drain(core)
    removed = {e[1] for e in events if e[0] == BLOCK_REMOVED}
    assert removed and removed <= {e[1] for e in stored}


def test_bad_requests_are_rejected_with_clear_errors() -> None:
    core, _ = make_core(num_blocks=64, max_queued_requests=1)
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request("long", [1] * 65)
    with pytest.raises(ValueError, match="n > 1"):
        core.add_request("n2", [1], SamplingParams(n=2))
    with pytest.raises(ValueError, match="integers"):
        core.add_request("float", [1, 2.5])
    core.add_request("ok", [1])
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("ok", [1])
    with pytest.raises(QueueFull):
        core.add_request("more", [1])
    assert not core.can_queue()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(num_blocks=3, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="not implemented"):
        EngineConfig(num_blocks=64, policy="edf")
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineConfig(num_blocks=64, chunked_prefill_size=0)


def test_from_appliance_reads_scheduler_and_cache_sections() -> None:
    cfg = SimpleNamespace(
        scheduler=SimpleNamespace(max_num_seqs=7, chunked_prefill_size=-1, max_prefill_tokens=333,
                                  max_queued_requests=9, policy="lpm"),
        cache=SimpleNamespace(block_size=8, enable_prefix_caching=False),
    )
    ec = EngineConfig.from_appliance(cfg, num_blocks=100, eos_token_ids=[2, 3], max_model_len=512)
    assert (ec.max_num_seqs, ec.chunked_prefill_size, ec.max_prefill_tokens, ec.max_queued_requests) == (7, -1, 333, 9)
    assert (ec.block_size, ec.enable_prefix_caching, ec.policy) == (8, False, "lpm")
    assert (ec.num_blocks, ec.eos_token_ids, ec.max_model_len) == (100, frozenset({2, 3}), 512)
    assert not ec.chunking and ec.step_token_budget == 333


def test_from_appliance_with_the_real_schema() -> None:
    config_mod = pytest.importorskip("appliance.config")
    cfg = config_mod.ApplianceConfig()
    ec = EngineConfig.from_appliance(cfg, num_blocks=1024, eos_token_ids=[1], max_model_len=2048)
    assert ec.block_size == cfg.cache.block_size and ec.max_num_seqs == cfg.scheduler.max_num_seqs
    assert ec.chunked_prefill_size == cfg.scheduler.chunked_prefill_size


def test_engine_does_not_import_torch() -> None:
    import subprocess  # other tests may have imported torch: check in a clean process

    code = "import sys, appliance.engine, appliance.engine.fake_executor; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr
