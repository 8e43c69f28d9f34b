"""The real pipeline on the CPU: supervisor -> worker, scheduler, tokenizer processes, driven by the official
openai client (and raw httpx for errors). One server per module; the last test kills its worker."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pipeline_server import Server, alive, free_port, launch, stop

pytestmark = pytest.mark.slow

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(make_tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model("llama")
    port = free_port()
    cfg = tmp_path_factory.mktemp("e2e") / "serve.toml"
    config = f'''
[model]
path = "{model}"
device = "cpu"
[cache]
max_total_tokens = 4096
[api]
port = {port}
served_model_name = "tiny"
chat_template = {TEMPLATE!r}
[observability]
enable_metrics = true
enable_cache_report = true
log_level = "warning"
'''
    t0 = time.monotonic()
    srv = launch(config, port, cfg_path=cfg)
    print(f"pipeline ready {time.monotonic() - t0:.1f} s after start")
    yield srv
    stop(srv)


@pytest.fixture(autouse=True)
def idle_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames and not request.node.name.startswith("test_killing"):
        srv: Server = request.getfixturevalue("server")
        s = srv.wait_idle()
        assert (s["num_running"], s["num_waiting"], s["kv_blocks_owned"]) == (0, 0, 0), s
        assert s["kv_blocks_free"] + s["kv_blocks_cached"] == s["kv_blocks_total"] and s["accounting_ok"], s


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)


def test_stage_processes_and_health(server: Server) -> None:
    assert sorted(server.stages.values()) == ["scheduler", "tokenizer", "worker0"]
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert [m.id for m in client(server).models.list().data] == ["tiny"]



def test_completions_greedy_is_deterministic_and_streams_match(server: Server) -> None:
    c = client(server)
    a = c.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True})
    b = c.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 12
    assert a.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(c.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == a.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_streaming_and_not(server: Server) -> None:
    c = client(server)
    msgs = [{"role": "user", "content": "Hello there"}]
    full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    stream = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == full.choices[0].message.content
    n3 = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, n=3, seed=1, logprobs=True,
                                   top_logprobs=2)
    assert sorted(ch.index for ch in n3.choices) == [0, 1, 2]
    assert all(len(ch.logprobs.content[0].top_logprobs) == 2 for ch in n3.choices)


def test_many_concurrent_clients(server: Server) -> None:
    async def run() -> list[Any]:
        c = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0, timeout=120)

        async def one(i: int) -> int:
            if i % 2:
                r = await c.completions.create(model="tiny", prompt=f"Number {i}", max_tokens=6 + i % 5,
                                               extra_body={"ignore_eos": True})
                return r.usage.completion_tokens
            stream = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": str(i)}],
                                                     max_tokens=6 + i % 5, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            usage = None
            async for ch in stream:
                usage = ch.usage or usage
            return usage.completion_tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(24)))
        finally:
            await c.close()

    assert asyncio.run(run()) == [6 + i % 5 for i in range(24)]


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_metrics_reflect_the_traffic(server: Server) -> None:
    text = httpx.get(f"{server.base}/metrics").text
    assert metric(text, "appliance:request_success_total", finished_reason="length") >= 24
    assert metric(text, "appliance:generation_tokens_total") >= sum(6 + i % 5 for i in range(24))
    assert metric(text, "appliance:num_requests_running") == 0
    assert metric(text, "appliance:kv_blocks_total") == 256  # cache.max_total_tokens / block_size
    assert metric(text, "appliance:kv_accounting_drift_blocks") == 0
    assert metric(text, "appliance:time_to_first_token_seconds_count") >= 24


def test_abort_mid_stream_frees_the_request(server: Server) -> None:
    body = {"prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{server.base}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.stats()["num_running"] == 1
    # leaving the block closed the connection mid-stream
    s = server.wait_idle(timeout=5)
    assert s["num_running"] == 0 and s["kv_blocks_owned"] == 0


def test_disconnect_of_a_non_streaming_request_frees_it(server: Server) -> None:
    body = b'{"prompt": "Hello", "max_tokens": 400, "ignore_eos": true}'
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while server.stats()["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()["num_running"] == 1
    s = server.wait_idle(timeout=5)
    assert s["num_running"] == 0 and s["kv_blocks_owned"] == 0


def test_stages_froze_their_start_up_heap(server: Server) -> None:
    # a full garbage collection would walk the whole start-up heap in the middle of serving (runtime/gc_heap.py)
    s = server.stats()
    assert s["gc_frozen_objects"] > 10_000 and s["worker_gc_frozen_objects"] > 10_000


def test_error_cases_raw_http(server: Server) -> None:
    with httpx.Client(base_url=server.base, timeout=10) as h:
        cases = [
            h.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"}),
            h.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}),
            h.post("/v1/completions", json={"prompt": "x", "top_p": 0}),
            h.post("/v1/completions", json={"prompt": "word " * 600}),
            h.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2}),
            h.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        ]
    assert [r.status_code for r in cases] == [400, 400, 400, 400, 400, 404]
    for r in cases:
        err = r.json()["error"]
        assert err["message"] and "Traceback" not in err["message"] and "/" not in err["type"]


def test_killing_the_worker_stops_everything(server: Server) -> None:
    worker = next(pid for pid, name in server.stages.items() if name == "worker0")
    body = {"prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{server.base}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        rest: list[str] = []
        try:
            rest.extend(lines)
        except httpx.HTTPError:
            pass  # the connection may close instead of carrying the error event
    assert time.monotonic() - t0 < 5
    assert any('"error"' in line for line in rest), rest[-3:]  # in-flight request ends with an error event
    code = server.proc.wait(timeout=15)
    assert code != 0
    assert time.monotonic() - t0 < 15
    assert not any(alive(pid) for pid in server.stages)
