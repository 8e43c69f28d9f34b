"""Both halves wired as the pipeline will wire them (hooks.py), over the real engine with the fake executor:
requests run, /metrics is scraped over HTTP, the KV event stream is checked against the prefix cache."""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from appliance.config import ApplianceConfig
from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.sampling_params import SamplingParams
from appliance.observability.hooks import FrontendObservability, SchedulerObservability
from appliance.observability.stats import StatsSnapshot
from appliance.runtime.scheduler_proc import delta_to_output
from appliance.runtime.wire import Codec

BS = 4
PROMPT = list(range(1, 14))  # 3 full blocks + 1 token


@pytest.fixture
def ipc_dir():
    """A short directory for ipc:// endpoints (socket paths are limited to ~107 bytes; tmp_path can be longer)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="obs-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_requests_move_metrics_and_kv_events_match_the_cache(ipc_dir) -> None:
    ep = f"ipc://{ipc_dir}/kv"
    cfg = ApplianceConfig.model_validate({"observability": {
        "enable_metrics": True, "decode_log_interval": 1,
        "kv_events": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ep, "topic": "kv"}}})
    sched = SchedulerObservability(cfg.observability, BS, snapshot_interval_s=1e-9)
    front = FrontendObservability(cfg, "m", max_model_len=64)
    core = EngineCore(EngineConfig(num_blocks=16, block_size=BS, max_model_len=64), FakeExecutor(16, BS),
                      on_kv_event=sched.kv_event_sink)
    wire = Codec(StatsSnapshot)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(ep)
    try:
        deadline = time.monotonic() + 5
        sent = 0
        while not sub.poll(50):  # wait out the PUB slow-joiner with harmless clears of the empty cache
            assert time.monotonic() < deadline
            core.reset_prefix_cache()
            sched.after_step(core, [])
            sent += 1
        while sched.kv_events.num_published < sent:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while sub.poll(200):
            sub.recv_multipart()

        for rid in ("a", "b"):  # b repeats a's prompt: a prefix hit of 3 blocks
            front.request_arrived(rid, len(PROMPT), max_tokens=3)
            core.add_request(rid, PROMPT, SamplingParams(max_tokens=3))
            while core.has_work():
                deltas = core.step()
                sched.after_step(core, deltas)
                for d in deltas:
                    front.on_output(delta_to_output(d))
                snap = sched.due_snapshot(core)
                if snap is not None:
                    front.on_snapshot(wire.decode(wire.encode(snap)))
        front.on_snapshot(wire.decode(wire.encode(sched.snapshot(core))))  # idle now

        def metrics(request) -> Response:
            body, content_type = front.render()
            return Response(body, headers={"Content-Type": content_type})

        app = Starlette(routes=[Route("/metrics", metrics)])
        with TestClient(app) as client:
            body = client.get("/metrics").text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(body) for s in fam.samples}
        m, e = (("model_name", "m"),), (("engine", "0"), ("model_name", "m"))
        assert samples[("appliance:request_success_total", (("finished_reason", "length"),) + m)] == 2
        assert samples[("appliance:generation_tokens_total", m)] == 6
        assert samples[("appliance:prompt_tokens_total", m)] == 2 * len(PROMPT)
        assert samples[("appliance:time_to_first_token_seconds_count", m)] == 2
        assert samples[("appliance:inter_token_latency_seconds_count", m)] == 4
        assert samples[("appliance:prefix_cache_queries_total", e)] == 2 * len(PROMPT)
        assert samples[("appliance:prefix_cache_hits_total", e)] == 3 * BS
        assert samples[("appliance:num_requests_running", e)] == 0
        assert samples[("appliance:kv_cache_usage_perc", e)] == 0
        assert samples[("appliance:kv_accounting_drift_blocks", e)] == 0
        assert samples[("appliance:kv_blocks_cached", e)] == len(core.scheduler.cache)

        live: set[int] = set()
        last_seq = -1
        while sub.poll(300):
            topic, seq_b, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq_b) == 8 and int.from_bytes(seq_b, "big") > last_seq
            last_seq = int.from_bytes(seq_b, "big")
            ts, events, rank = msgpack.unpackb(payload, raw=False)
            for ev in events:
                if ev[0] == "BlockStored":
                    assert ev[4] == BS and len(ev[3]) == BS
                    live.add(ev[1][0])
                elif ev[0] == "BlockRemoved":
                    live.discard(ev[1][0])
                else:
                    live.clear()
        cache = core.scheduler.cache
        cached_hashes = {cache.cached_block(b).block_hash for b in range(16) if cache.cached_block(b)}
        assert live == cached_hashes and len(live) >= 3
    finally:
        sub.close()
        sched.close()
        front.close()
        ctx.term()
