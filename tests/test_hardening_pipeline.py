"""Hardening of the REAL pipeline, with auth, a Host allow-list and metrics on: hostile single requests fail
alone with a clear 4xx, overload answers 429 at once, disconnects (mid-prefill, mid-stream) free their blocks,
every route refuses a missing key, nothing listens beyond loopback, a pickled frame on an internal socket is
dropped, a schema-driven fuzz run sees no 5xx; the last test SIGTERMs the server and checks the drain."""
from __future__ import annotations

import json
import os
import pickle
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline_server import (
    Server,
    free_port,
    launch,
    socket_inodes,
    stop,
    survivors,
    unix_socket_of,
)
from test_hardening_fuzz import LEAKS, ROUTES, bodies, check_answer
from test_observability_e2e import prompt_ids

pytestmark = pytest.mark.slow

KEY = "s3cret-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUED = 3
GRACE = 8.0
TEMPLATE = ("{% if slow is defined %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
            "{% endfor %}{% endif %}"
            "{% if evil is defined %}{{ messages.__class__.__mro__[1].__subclasses__() }}{% endif %}"
            "{% if boom is defined %}{{ raise_exception('template says no') }}{% endif %}"
            "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(make_tiny_model: Any) -> Iterator[Server]:
    port = free_port()
    srv = launch(f'''
[model]
path = "{make_tiny_model("llama")}"
device = "cpu"
[scheduler]
max_num_seqs = 2
max_queued_requests = {MAX_QUEUED}
chunked_prefill_size = 32
[cache]
max_total_tokens = 2048
[api]
port = {port}
served_model_name = "tiny"
api_key = "{KEY}"
allowed_hosts = ["127.0.0.1", "localhost"]
chat_template = {json.dumps(TEMPLATE)}
shutdown_grace_period = {GRACE}
[api.caps]
max_n = 4
max_logprobs = 5
max_stop = 4
max_body_bytes = 65536
[observability]
enable_metrics = true
log_level = "error"
''', port, headers=AUTH)
    yield srv
    stop(srv, expect_clean_exit=False)


def assert_healthy_and_accounted(srv: Server) -> None:
    assert httpx.get(f"{srv.base}/health", timeout=5).status_code == 200
    s = srv.wait_idle()
    assert (s["num_running"], s["num_waiting"], s["kv_blocks_owned"]) == (0, 0, 0), s
    assert s["kv_blocks_free"] + s["kv_blocks_cached"] == s["kv_blocks_total"] and s["accounting_ok"], s
    m = httpx.get(f"{srv.base}/metrics", timeout=5).text
    assert re.search(r'^appliance:kv_accounting_drift_blocks\{[^}]*\} 0\.0$', m, re.MULTILINE), "drift on /metrics"


def post(srv: Server, path: str, body: Any = None, *, raw: bytes | None = None, headers: dict | None = None,
         timeout: float = 30) -> httpx.Response:
    h = {**AUTH, "content-type": "application/json", **(headers or {})}
    return httpx.post(f"{srv.base}{path}", content=raw if raw is not None else json.dumps(body).encode(),
                      headers=h, timeout=timeout)


def long_stream(srv: Server, max_tokens: int, out: dict[str, Any], prompt: Any = "Hello",
                stop: threading.Event | None = None) -> threading.Thread:
    """A streaming completion in a thread: out['lines'] (data lines), out['error']; `stop` set: the client
    leaves at its next line."""
    def run() -> None:
        try:
            with httpx.Client(timeout=60) as h, h.stream("POST", f"{srv.base}/v1/completions", headers=AUTH, json={
                    "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                out["status"] = r.status_code
                out["lines"] = []
                for ln in r.iter_lines():
                    if stop is not None and stop.is_set():
                        break
                    if ln.startswith("data: "):
                        out["lines"].append(ln)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_hostile_single_requests_fail_alone(server: Server) -> None:
    victim: dict[str, Any] = {}
    t = long_stream(server, 120, victim)
    msgs = [{"role": "user", "content": "hi"}]
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    cases: list[tuple[str, Any, int]] = [
        (comp, {"prompt": "x", "stop": [str(i) for i in range(5000)]}, 400),
        (comp, {"prompt": "x", "stop": ["a"] * 5}, 400),
        (comp, {"prompt": "x", "stop": [""]}, 400),
        (comp, {"prompt": "x", "stop_token_ids": [10**9]}, 400),
        (comp, {"prompt": "x", "logprobs": 10**9}, 400),
        (comp, {"prompt": "x", "logprobs": 6}, 400),
        (comp, {"prompt": "x", "logprobs": -1}, 400),
        (chat, {"messages": msgs, "logprobs": True, "top_logprobs": 10**6}, 400),
        (chat, {"messages": msgs, "top_logprobs": 3}, 400),
        (comp, {"prompt": [10**9, 5]}, 400),
        (comp, {"prompt": [-1, 5]}, 400),
        (comp, {"prompt": [384]}, 400),
        (comp, {"prompt": [[1, 2], [3, 2**70]]}, 400),
        (comp, {"prompt": "x", "n": 5}, 400),
        (comp, {"prompt": "x", "n": 10**9}, 400),
        (comp, {"prompt": "x", "best_of": 100}, 400),
        (chat, {"messages": msgs, "n": 0}, 400),
        (comp, {"prompt": "x", "max_tokens": 10**12}, 400),
        (comp, {"prompt": "x", "max_tokens": -1}, 400),
        (comp, {"prompt": "x", "temperature": 1e308}, 400),
        (comp, {"prompt": "x", "logit_bias": {"5": 1000}}, 400),
        (comp, {"prompt": "x", "min_tokens": 10, "max_tokens": 2}, 400),
        (chat, {"messages": msgs, "chat_template_kwargs": {"slow": True}}, 400),
        (chat, {"messages": msgs, "chat_template_kwargs": {"evil": True}}, 400),
        (chat, {"messages": msgs, "chat_template_kwargs": {"boom": True}}, 400),
        (chat, {"messages": [{"role": "user", "content": {"deep": [[[[1]]]]}}]}, 400),
        (chat, {"messages": []}, 400),
        (comp, {"prompt": "word " * 2000}, 400),
        ("/detokenize", {"tokens": [10**12]}, 400),
        (comp, {"prompt": "x" * 70000}, 413),
    ]
    started = time.monotonic()
    for path, body, want in cases:
        r = post(server, path, body)
        assert r.status_code == want, (body if len(json.dumps(body)) < 300 else path, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["message"] and not LEAKS.search(r.text), r.text[:300]
        if "boom" in json.dumps(body):
            assert "template says no" in err["message"]
    raw_cases = [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
                 b"[" * 30000 + b"]" * 30000, b'{"prompt": "\xff\xfe"}', b'{"prompt": "x"']
    for raw in raw_cases:
        r = post(server, comp, raw=raw)
        assert r.status_code == 400, (raw[:40], r.text[:200])
        assert not LEAKS.search(r.text)
    assert time.monotonic() - started < 30
    t.join(timeout=60)
    assert victim.get("status") == 200 and "error" not in victim, victim.get("error")
    assert victim["lines"][-1] == "data: [DONE]"
    assert json.loads(victim["lines"][-2][6:])["usage"]["completion_tokens"] == 120
    assert_healthy_and_accounted(server)


def test_a_top_k_beyond_int64_is_served_like_top_k_off(server: Server) -> None:
    """The fuzzer once sent top_k = 2**63 in a chat request: the worker's sampler could not hold it in an int64
    tensor, and the pipeline died. Any top_k past every vocabulary keeps every token (SamplingParams.TOP_K_ALL)."""
    msgs = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 1.0, "top_k": 2**63}),
                       ("/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "top_k": 2**70, "seed": 3})):
        r = post(server, path, body)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
        assert r.json()["usage"]["completion_tokens"] == 4
    assert_healthy_and_accounted(server)


def test_a_bad_token_id_sent_past_the_server_fails_in_the_scheduler_not_the_worker(server: Server) -> None:
    """Defence in depth: a GenerateRequest with an id past the vocabulary, pushed straight onto the scheduler's
    socket, is refused there; the worker never sees it, so the pipeline keeps serving."""
    from appliance.runtime.messages import REQUEST_CODEC, GenerateRequest

    sched = next(p for p, n in server.stages.items() if n == "scheduler")
    endpoint = unix_socket_of(sched, "requests")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    push.send(REQUEST_CODEC.encode(GenerateRequest("hostile-1", [5, 10**6], {"max_tokens": 3})))
    marker = f"/tmp/pwned-{os.getpid()}"

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    before = server.stats()["malformed_frames"]
    push.send(pickle.dumps(Evil()))  # never unpickled: the typed codec drops it
    push.close(linger=1000)
    ctx.term()
    time.sleep(0.5)
    assert server.stats()["malformed_frames"] == before + 1 and not os.path.exists(marker)
    r = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert_healthy_and_accounted(server)


FILL_TOKENS = 500  # 8-token prompts: as long as the 512-token context allows, to keep the queue full long


def _fill_queue(srv: Server, leave: threading.Event, outs: list[dict[str, Any]]) -> list[threading.Thread]:
    """2 running, then MAX_QUEUED waiting, in two stages: sent all at once, several can reach the scheduler
    before it admits any, and the scheduler rightly refuses the ones past max_queued_requests."""
    threads: list[threading.Thread] = []
    for want, seeds in (((2, 0), range(2)), ((2, MAX_QUEUED), range(2, 2 + MAX_QUEUED))):
        for i in seeds:
            outs.append({})
            threads.append(long_stream(srv, FILL_TOKENS, outs[-1], prompt_ids(i, 8), leave))
        deadline = time.monotonic() + 30
        while ((s := srv.stats())["num_running"], s["num_waiting"]) != want and time.monotonic() < deadline:
            if any(o.get("lines", [""])[-1:] == ["data: [DONE]"] for o in outs[:2]):
                return threads  # a running one finished before the rest arrived: the caller tries again
            time.sleep(0.01)
        assert (s["num_running"], s["num_waiting"]) == want, (s, [o.get("lines", [])[-2:] for o in outs])
    return threads


def _probe_while_full(srv: Server) -> list[tuple[httpx.Response, float]]:
    huge = {"prompt": "hello world " * 5000, "max_tokens": 2}  # tokenized it would be a 400 (past the context)
    slow = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"slow": True}}  # rendered: 400
    answers = []
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}), ("/v1/completions", huge),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/chat/completions", slow)):
        t0 = time.monotonic()
        r = post(srv, path, body)
        answers.append((r, time.monotonic() - t0))
    for _ in range(5):
        t0 = time.monotonic()
        r = httpx.get(f"{srv.base}/health", timeout=5)
        answers.append((r, time.monotonic() - t0))
    return answers


def test_overload_answers_429_at_once_and_health_stays_up(server: Server) -> None:
    """The probes count only if the queue was still full after them: should the 2 running requests finish
    first (a slow, loaded machine), the attempt says nothing either way and is run again."""
    for _ in range(3):
        leave = threading.Event()
        outs: list[dict[str, Any]] = []
        threads = _fill_queue(server, leave, outs)
        answers = _probe_while_full(server)
        s = server.stats()
        still_full = (s["num_running"], s["num_waiting"]) == (2, MAX_QUEUED)
        leave.set()
        for t in threads:
            t.join(timeout=60)
        assert all(o.get("status") == 200 and "error" not in o for o in outs), outs
        assert not any(ln.startswith('data: {"error"') for o in outs for ln in o.get("lines", [])), outs
        if still_full:
            break
        server.wait_idle()
    else:
        raise AssertionError(f"the queue never stayed full through the probes: {s}")
    for r, took in answers[:4]:
        assert r.status_code == 429, r.text[:200]  # 429, not the 400 that rendering or tokenizing would give
        assert r.headers["retry-after"].isdigit() and r.json()["error"]["code"] == "queue_full"
        assert took < 1.0, took  # no tokenization, no queueing: a shared 2-core CI machine still answers fast
    for r, took in answers[4:]:
        assert r.status_code == 200 and took < 1.0, (r.status_code, took)
    m = httpx.get(f"{server.base}/metrics", timeout=5).text
    assert re.search(r'^appliance:request_errors_total\{[^}]*status="429"[^}]*\} [1-9]', m, re.MULTILINE)
    assert_healthy_and_accounted(server)


def _abort_count(srv: Server) -> float:
    m = httpx.get(f"{srv.base}/metrics", timeout=5).text
    found = re.search(r'^appliance:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', m, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_disconnect_mid_stream_frees_the_blocks(server: Server) -> None:
    aborts = _abort_count(server)
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{server.base}/v1/chat/completions", headers=AUTH, json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(4)]
        assert server.stats()["num_running"] == 1
    t0 = time.monotonic()
    after = server.wait_idle(timeout=5)
    assert after["kv_blocks_owned"] == 0 and time.monotonic() - t0 < 2
    assert _abort_count(server) == aborts + 1


ROUTE_CALLS = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
               ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [5]}),
               ("GET", "/v1/internal/stats", None)]


def test_auth_matrix_over_every_route(server: Server) -> None:
    bad = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
           {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": f"Bearer {KEY}x"},
           {"Authorization": KEY}, {"X-Api-Key": KEY}]
    with httpx.Client(base_url=server.base, timeout=30) as h:
        for method, path, body in ROUTE_CALLS:
            for headers in bad:
                r = h.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer" and KEY not in r.text
            r = h.request(method, path, json=body, headers=AUTH)
            assert r.status_code == 200, (path, r.text[:200])
            r = h.request(method, path, json=body, headers={"Authorization": f"bearer  {KEY}"})
            assert r.status_code == 200, path
        for path in ("/health", "/metrics", "/version"):  # probes and scrapes need no key
            assert h.get(path).status_code == 200


def test_host_header_is_checked(server: Server) -> None:
    port = server.base.rsplit(":", 1)[1]
    with httpx.Client(base_url=server.base, timeout=10) as h:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.", ""):
            for path in ("/health", "/v1/models"):
                r = h.get(path, headers={**AUTH, "Host": host})
                assert r.status_code == 421, (host, path, r.status_code)
        for host in ("127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST"):
            assert h.get("/v1/models", headers={**AUTH, "Host": host}).status_code == 200, host


def test_nothing_listens_beyond_loopback(server: Server) -> None:
    pids = [server.proc.pid, *server.stages]
    inodes: set[str] = set().union(*(socket_inodes(pid) for pid in pids))
    listening = []
    for table, loopback in (("/proc/net/tcp", "0100007F"), ("/proc/net/tcp6", "00000000000000000000000001000000")):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and parts[9] in inodes:  # LISTEN, owned by the pipeline
                    listening.append(parts[1])
                    assert parts[1].split(":")[0] == loopback, f"{table}: listens on {parts[1]}"
    assert len(listening) == 1  # the HTTP port; every internal socket is ipc://


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), path=st.sampled_from(sorted(ROUTES)))
def test_fuzz_the_real_pipeline(server: Server, data: st.DataObject, path: str) -> None:
    body = data.draw(bodies(path))
    if isinstance(body, dict) and path.startswith("/v1/"):  # keep the run short; caps are checked elsewhere
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            body[key] = min(v, 16) if isinstance(v, int) and not isinstance(v, bool) else v
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 16
    check_answer(post(server, path, body, timeout=60), body)


def test_fuzz_left_the_engine_clean(server: Server) -> None:
    assert_healthy_and_accounted(server)


def test_sigterm_drains_open_requests_then_exits_cleanly(server: Server) -> None:
    """Last: takes the server down. A running stream finishes within api.shutdown_grace_period; new
    connections are refused meanwhile; exit code 0 and no process left."""
    out: dict[str, Any] = {}
    t = long_stream(server, 150, out)
    deadline = time.monotonic() + 10
    while server.stats()["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    time.sleep(0.3)
    try:
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, timeout=5)
        assert r.status_code == 503, r.status_code
    except httpx.TransportError:
        pass  # the listener is already closed: refused
    t.join(timeout=GRACE + 5)
    assert out.get("status") == 200 and "error" not in out, out.get("error")
    assert out["lines"][-1] == "data: [DONE]", out["lines"][-3:]
    assert json.loads(out["lines"][-2][6:])["usage"]["completion_tokens"] == 150, out["lines"][-3:]
    assert server.proc.wait(timeout=GRACE + 10) == 0
    assert time.monotonic() - t0 < GRACE + 10
    assert not survivors(server.stages, within_s=5)
