"""Observability of the REAL pipeline (supervisor + worker, scheduler, tokenizer processes on the CPU): /metrics
moves as requests run, a ZMQ subscriber sees the prefix cache's BlockStored / BlockRemoved events frame by frame
(ZMQ multipart, msgpack KVEventBatch), and the request dump replays to the same answers. One server for the module."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
from pipeline_server import Server, free_port, launch, stop
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

BLOCK = 16


def scrape(srv: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(name, sorted labels without model_name): value}."""
    r = httpx.get(f"{srv.base}/metrics", timeout=10)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


def val(m: dict, name: str, **labels: str) -> float:
    return m.get(("appliance:" + name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def ipc_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="obs-e2e-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def server(make_tiny_model: Any, ipc_dir: str) -> Iterator[Server]:
    port = free_port()
    srv = launch(f'''
[model]
path = "{make_tiny_model("llama")}"
device = "cpu"
[cache]
max_total_tokens = 1024
block_size = {BLOCK}
[api]
port = {port}
served_model_name = "tiny"
[observability]
enable_metrics = true
log_level = "warning"
dump_path = "{ipc_dir}/dump.jsonl"
[observability.kv_events]
enable_kv_cache_events = true
publisher = "zmq"
endpoint = "ipc://{ipc_dir}/kv"
topic = "kv"
''', port)
    yield srv
    stop(srv)


@pytest.fixture(scope="module")
def subscriber(server: Server, ipc_dir: str) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"ipc://{ipc_dir}/kv")
    time.sleep(0.3)  # ZMQ's slow joiner: the subscription must reach the publisher before the first batch
    yield sub
    sub.close(0)
    ctx.term()


def complete(srv: Server, prompt: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{srv.base}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_ids(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 370 for i in range(n)]


def receive_batches(sub: zmq.Socket, timeout: float = 3.0) -> list[tuple[int, list[list[Any]]]]:
    """(seq, events) of every batch that arrives until the stream is quiet for `timeout` s; checks the frames."""
    out = []
    while sub.poll(int(timeout * 1000)):
        frames = sub.recv_multipart()
        assert len(frames) == 3 and frames[0] == b"kv" and len(frames[1]) == 8
        ts, events, dp_rank = msgpack.unpackb(frames[2], raw=False)
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and dp_rank == 0
        out.append((int.from_bytes(frames[1], "big"), events))
    return out


def test_kv_events_follow_the_prefix_cache(server: Server, subscriber: zmq.Socket) -> None:
    first = prompt_ids(1, 6 * BLOCK + 4)
    complete(server, first, 1)
    batches = receive_batches(subscriber, timeout=1.0)
    stored = [ev for _, evs in batches for ev in evs if ev[0] == "BlockStored"]
    assert len(stored) == 6  # the full blocks of the prompt; the partial seventh is not stored
    parent = None
    for i, (kind, hashes, parent_hash, tokens, block_size) in enumerate(stored):
        assert len(hashes) == 1 and isinstance(hashes[0], int) and parent_hash == parent
        assert tokens == first[i * BLOCK:(i + 1) * BLOCK] and block_size == BLOCK
        parent = hashes[0]
    first_hashes = [ev[1][0] for ev in stored]
    # distinct prompts fill the 64-block pool: the oldest cached blocks (the first prompt's) are evicted
    for k in range(2, 8):
        complete(server, prompt_ids(k, 12 * BLOCK), 1)
    batches += receive_batches(subscriber, timeout=1.0)
    seqs = [s for s, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap, in order
    live: dict[int, None] = {}
    removed = []
    for _, events in batches:
        for ev in events:
            if ev[0] == "BlockStored":
                live[ev[1][0]] = None
            elif ev[0] == "BlockRemoved":
                assert ev[1][0] in live, "a removal of a block never stored"
                del live[ev[1][0]]
                removed.append(ev[1][0])
    assert set(first_hashes) <= set(removed)
    s = server.wait_idle()
    assert len(live) == s["kv_blocks_cached"] > 0  # the subscriber's view is the cache's state


def test_metrics_move_with_real_requests(server: Server) -> None:
    before = scrape(server)
    repeated = prompt_ids(20, 3 * BLOCK + 2)
    a = complete(server, repeated, 5, ignore_eos=True)  # finish "length"
    b = complete(server, repeated, 5, ignore_eos=True)  # the same prompt: prefix-cache hit
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    stream = httpx.post(f"{server.base}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt_ids(21, 10), "max_tokens": 7, "ignore_eos": True, "stream": True})
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    server.wait_idle()
    after = scrape(server)

    def d(name: str, **labels: str) -> float:
        return val(after, name, **labels) - val(before, name, **labels)

    requests = [a, b]
    assert d("request_success_total", finished_reason="length") == 3
    assert d("request_success_total", finished_reason="abort") == 0
    assert d("prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for r in requests) + 10
    assert d("generation_tokens_total") == 5 + 5 + 7
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_inference_time_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert d(hist + "_count") == 3, hist
    assert d("request_queue_time_seconds_sum") >= 0 and d("request_inference_time_seconds_sum") > 0
    assert d("request_inference_time_seconds_sum") >= d("request_decode_time_seconds_sum")
    assert d("e2e_request_latency_seconds_sum") >= d("request_inference_time_seconds_sum")
    assert d("inter_token_latency_seconds_count") == 4 + 4 + 6
    # the second request hits the 3 cached blocks of the first
    assert d("prefix_cache_hits_total") >= 3 * BLOCK
    assert d("prefix_cache_queries_total") >= 2 * len(repeated)
    assert val(after, "num_requests_running") == val(after, "num_requests_waiting") == 0
    assert val(after, "num_requests_in_flight") == 0
    assert val(after, "kv_cache_usage_perc") == 0 and val(after, "kv_accounting_drift_blocks") == 0
    assert val(after, "kv_blocks_total") == 1024 // BLOCK
    assert val(after, "kv_blocks_owned") == 0
    assert val(after, "kv_blocks_free") + val(after, "kv_blocks_cached") == 1024 // BLOCK
    assert 0 < val(after, "prefix_cache_hit_rate") <= 1


def test_a_stop_string_counts_as_stop(server: Server) -> None:
    repeated = prompt_ids(22, 12)
    text = complete(server, repeated, 8, ignore_eos=True)["choices"][0]["text"]
    stop_char = next((c for c in text[1:] if c.strip()), None)
    if stop_char is None:
        pytest.skip("the tiny model produced no visible character")
    before = scrape(server)
    c = complete(server, repeated, 8, ignore_eos=True, stop=[stop_char])
    assert c["choices"][0]["finish_reason"] == "stop"
    server.wait_idle()
    after = scrape(server)
    assert val(after, "request_success_total", finished_reason="stop") - \
        val(before, "request_success_total", finished_reason="stop") == 1
    assert val(after, "request_success_total", finished_reason="abort") == \
        val(before, "request_success_total", finished_reason="abort")


def test_kv_usage_is_non_zero_while_a_request_runs(server: Server) -> None:
    body = {"model": "tiny", "prompt": prompt_ids(30, 40), "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{server.base}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        m = scrape(server)
        assert val(m, "num_requests_running") == 1 and val(m, "kv_cache_usage_perc") > 0
        assert val(m, "kv_blocks_owned") >= 3
    server.wait_idle(timeout=5)
    m = scrape(server)
    assert val(m, "request_success_total", finished_reason="abort") >= 1
    assert val(m, "kv_cache_usage_perc") == 0 and val(m, "num_requests_running") == 0


def test_the_dump_replays_to_the_same_requests(server: Server, ipc_dir: str) -> None:
    from appliance.observability.dump import read_dump
    from appliance.observability.replay import build_replay_requests, replay

    complete(server, "Hello world", 6, ignore_eos=True)
    r = httpx.post(f"{server.base}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code in (200, 400)  # the tiny tokenizer may have no chat template: a 400 is dumped too
    requests = build_replay_requests(read_dump(f"{ipc_dir}/dump.jsonl"))
    greedy = [q for q in requests if q.recorded is not None and "error" not in q.recorded
              and q.body.get("temperature") == 0 and "stop" not in q.body]
    assert len(greedy) >= 5 and any(q.body.get("prompt") == "Hello world" for q in greedy)
    assert [q.seq for q in requests] == sorted(q.seq for q in requests)
    with httpx.Client(base_url=server.base, timeout=60) as client:
        outcomes = replay(greedy, client)
    bad = [(o.request.seq, o.status, o.differences) for o in outcomes if not o.ok]
    assert not bad, bad
    tool = subprocess.run([sys.executable, "tools/replay_dump.py", f"{ipc_dir}/dump.jsonl", "--base-url",
                           server.base, "--seq", str(greedy[0].seq)], capture_output=True, text=True, timeout=60, check=False,
                          cwd=Path(__file__).resolve().parents[1])
    assert tool.returncode == 0, tool.stdout + tool.stderr
