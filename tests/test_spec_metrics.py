"""Speculative-decoding counters from the engine to /metrics and /v1/internal/stats: the scheduler process' loop
(SchedulerLoop, over the real EngineCore with the FakeExecutor playing an MTP worker and in-memory sockets) puts
the engine's spec counts in its timed and on-demand StatsSnapshots and in its stats reply; the tokenizer side
turns the snapshots into the spec_decode_* Prometheus series; the DP router sums the counts over replicas. Also the
GPU memory profile's logits rows with speculation (a verification samples several rows per request)."""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import pytest
import spec_fixtures
import zmq
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import ApplianceConfig
from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.sampling_params import SamplingParams
from appliance.observability.hooks import FrontendObservability, SchedulerObservability
from appliance.observability.stats import StatsSnapshot
from appliance.runtime import scheduler_proc
from appliance.runtime.dp_router import combine_stats
from appliance.runtime.messages import (
    OUTPUT_CODEC,
    REQUEST_CODEC,
    GenerateRequest,
    OutputBatch,
    StatsQuery,
    StatsReply,
)
from appliance.runtime.scheduler_proc import SchedulerLoop

# fixtures: a random DeepSeek-V3 checkpoint with one MTP layer; a config-only one with the tiny tokenizer
tiny_v3, tiny_v3_served = spec_fixtures.tiny_v3, spec_fixtures.tiny_v3_served
K = 2
SPEC_KEYS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


class MemorySocket:
    """The two socket calls SchedulerLoop makes on each side: frames queued in, frames sent out."""

    def __init__(self) -> None:
        self.inbox: deque[bytes] = deque()
        self.sent: list[bytes] = []

    def poll(self, timeout: int = 0) -> bool:
        return bool(self.inbox)

    def recv(self, flags: int = 0) -> bytes:
        if not self.inbox:
            raise zmq.Again()
        return self.inbox.popleft()

    def send(self, frame: bytes) -> None:
        self.sent.append(frame)


def config(spec: bool) -> ApplianceConfig:
    d: dict[str, Any] = {"observability": {"enable_metrics": True}}
    if spec:
        d["speculative"] = {"algorithm": "MTP", "num_steps": K}
    return ApplianceConfig.model_validate(d)


def run_loop(monkeypatch: pytest.MonkeyPatch, cfg: ApplianceConfig) -> tuple[SchedulerLoop, MemorySocket]:
    """Three requests through SchedulerLoop.run until the engine is idle, then one stats query."""
    ecfg = EngineConfig(num_blocks=64, block_size=4, max_model_len=128, num_speculative_tokens=K)
    ex = FakeExecutor(64, 4, vocab_size=48, num_speculative_tokens=K, max_model_len=128,
                      draft_quality=lambda rid, n: 1)  # of K drafts the first is right: some accepted, some not
    core = EngineCore(ecfg, ex)
    obs = SchedulerObservability(cfg.observability, 4, snapshot_interval_s=1e-9)
    requests, outputs = MemorySocket(), MemorySocket()
    for i in range(3):
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        requests.inbox.append(REQUEST_CODEC.encode(GenerateRequest(f"r{i}", [5 + i, 6, 7, 8, 9], params.to_dict())))
    loop = SchedulerLoop(core, requests, outputs, parent_pid=0, obs=obs)
    turns = iter(range(10_000))
    # the loop runs while its parent lives: here, until the engine has drained (bounded, in case it never does)
    monkeypatch.setattr(scheduler_proc, "parent_alive",
                        lambda pid: next(turns) < 2 or (core.has_work() and next(turns) < 9_000))
    loop.run()
    assert not core.has_work()
    requests.inbox.append(REQUEST_CODEC.encode(StatsQuery(7)))
    loop._drain_requests()
    return loop, outputs


def decoded(outputs: MemorySocket) -> list[Any]:
    return [OUTPUT_CODEC.decode(f) for f in outputs.sent]


def test_snapshots_and_stats_reply_carry_the_engines_spec_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    loop, outputs = run_loop(monkeypatch, config(spec=True))
    counts = loop.core.spec_counts()
    drafts, draft_tokens, accepted = counts
    assert drafts > 0 and 0 < accepted < draft_tokens  # the run really verified drafts, some rejected
    msgs = decoded(outputs)
    assert sum(len(m.outputs[0].new_token_ids) > 1 for m in msgs if isinstance(m, OutputBatch)) > 0
    snaps = [m for m in msgs if isinstance(m, StatsSnapshot)]
    timed = snaps[:-1]  # the loop's due snapshots; the last one answers the stats query
    assert len(timed) > 2
    seq = [(s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) for s in timed]
    assert seq == sorted(seq) and seq[-1] == counts and seq[0] != counts  # cumulative, growing with the run
    last = snaps[-1]
    assert (last.spec_num_drafts, last.spec_num_draft_tokens, last.spec_num_accepted_tokens) == counts
    reply = [m for m in msgs if isinstance(m, StatsReply)]
    assert len(reply) == 1 and reply[0].query_id == 7
    assert tuple(reply[0].stats[k] for k in SPEC_KEYS) == counts
    assert reply[0].stats["idle"] and reply[0].stats["kv_blocks_owned"] == 0


def test_metrics_show_the_spec_series_after_a_spec_run(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(spec=True)
    loop, outputs = run_loop(monkeypatch, cfg)
    drafts, draft_tokens, accepted = loop.core.spec_counts()
    front = FrontendObservability(cfg, "m", max_model_len=128)
    for m in decoded(outputs):
        if isinstance(m, StatsSnapshot):
            front.on_snapshot(m)
    body, _ = front.render()
    samples = {s.name: s.value for fam in text_string_to_metric_families(body.decode()) for s in fam.samples
               if s.labels.get("engine") == "0"}
    assert samples["appliance:spec_decode_num_drafts_total"] == drafts
    assert samples["appliance:spec_decode_num_draft_tokens_total"] == draft_tokens
    assert samples["appliance:spec_decode_num_accepted_tokens_total"] == accepted
    assert samples["appliance:spec_decode_acceptance_rate"] == pytest.approx(accepted / draft_tokens)
    assert samples["appliance:spec_decode_num_emitted_tokens_total"] == accepted + drafts
    assert samples["appliance:spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    per_pos = {s.labels["position"]: s.value for fam in text_string_to_metric_families(body.decode())
               for s in fam.samples if s.name == "appliance:spec_decode_num_accepted_tokens_per_pos_total"}
    want = loop.core.scheduler.spec.accepted_per_pos
    assert per_pos == {str(j): c for j, c in enumerate(want)} and sum(want) == accepted
    assert all(a >= b for a, b in zip(want, want[1:]))  # draft j + 1 is accepted only after draft j


def test_without_speculation_the_counts_stay_zero_and_no_series_is_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(spec=False)
    ecfg = EngineConfig(num_blocks=64, block_size=4, max_model_len=128)
    core = EngineCore(ecfg, FakeExecutor(64, 4, vocab_size=48))
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    while core.has_work():
        core.step()
    requests, outputs = MemorySocket(), MemorySocket()
    loop = SchedulerLoop(core, requests, outputs, 0, SchedulerObservability(cfg.observability, 4))
    assert tuple(loop.stats()[k] for k in SPEC_KEYS) == (0, 0, 0)
    front = FrontendObservability(cfg, "m", max_model_len=128)
    front.on_snapshot(loop.obs.snapshot(core, spec=core.spec_counts()))
    assert b"spec_decode" not in front.render()[0]


def test_dp_router_sums_the_spec_counts_over_replicas() -> None:
    parts = [{"num_running": 1, "spec_num_drafts": 3, "spec_num_draft_tokens": 6, "spec_num_accepted_tokens": 4},
             {"num_running": 0, "spec_num_drafts": 5, "spec_num_draft_tokens": 10, "spec_num_accepted_tokens": 2}]
    out = combine_stats(parts)
    assert (out["spec_num_drafts"], out["spec_num_draft_tokens"], out["spec_num_accepted_tokens"]) == (8, 16, 6)
    assert out["num_running"] == 1 and out["replicas"] == parts


# ---- the GPU memory profile sizes its logits for a verification's rows (memory_profile.peak_bytes) ------------

@pytest.mark.parametrize("spec", [False, True])
def test_memory_profile_computes_logits_for_every_row_a_spec_step_samples(
        tiny_v3: Path, monkeypatch: pytest.MonkeyPatch, spec: bool) -> None:
    """peak_bytes runs on CUDA only; here its torch.cuda calls are stubbed so the CPU runs it, and the logits rows
    it profiles are recorded: max_num_seqs * (1 + num_steps) with MTP (each request verifies num_steps drafts and
    samples up to num_steps + 1 tokens), max_num_seqs without."""
    import torch

    from appliance import LLM
    from appliance.executor import memory_profile

    spec_args: dict[str, Any] = {"speculative_algorithm": "MTP", "speculative_num_steps": K} if spec else {}
    llm = LLM(model=str(tiny_v3), dtype="float32", block_size=4, skip_tokenizer_init=True, max_num_seqs=3,
              chunked_prefill_size=64, max_total_tokens=1024, **spec_args)
    runner = llm.executor.runner
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 1 << 40)
    rows: list[int] = []
    real = runner.model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return real(hidden)

    monkeypatch.setattr(runner.model, "compute_logits", compute_logits)
    memory_profile.peak_bytes(runner.model, runner.config, runner.kv_spec, runner.step_tokens, runner.device, 0)
    assert rows == [3 * (1 + K) if spec else 3]


# ---- the real pipeline: /metrics and /v1/internal/stats after a speculative run --------------------------------

@pytest.fixture(scope="module")
def spec_metrics_server(tiny_v3_served: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from pipeline_server import free_port, launch, stop

    port = free_port()
    config = spec_fixtures.spec_serve_config(tiny_v3_served, port, f"num_steps = {K}", "enable_metrics = true")
    srv = launch(config, port, cfg_path=tmp_path_factory.mktemp("spec_metrics") / "serve.toml")
    yield srv
    stop(srv)


@pytest.mark.slow
def test_pipeline_metrics_show_the_spec_counts(spec_metrics_server: Any) -> None:
    import httpx

    srv = spec_metrics_server
    for prompt in ([5, 6, 7, 8, 9], list(range(200, 217))):
        r = httpx.post(f"{srv.base}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                           "temperature": 0.0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
    stats = srv.wait_idle()
    drafts, draft_tokens, accepted = (stats[k] for k in SPEC_KEYS)
    assert drafts > 0 and K * drafts >= draft_tokens >= drafts >= 1 and accepted <= draft_tokens
    body = httpx.get(f"{srv.base}/metrics", timeout=10).text  # answered after a fresh scheduler snapshot
    samples = {s.name: s.value for fam in text_string_to_metric_families(body) for s in fam.samples
               if s.labels.get("engine") == "0"}
    assert samples["appliance:spec_decode_num_drafts_total"] == drafts
    assert samples["appliance:spec_decode_num_draft_tokens_total"] == draft_tokens
    assert samples["appliance:spec_decode_num_accepted_tokens_total"] == accepted
