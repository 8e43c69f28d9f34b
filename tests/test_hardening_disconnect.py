"""A client that leaves mid-prefill frees its KV blocks while the prefill still runs.

Its own server: a long context and small chunks make the prefill take many steps, so the check does not depend on
how fast one step is on the machine running the tests.
"""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pipeline_server import Server, free_port, launch, stop
from test_hardening_pipeline import AUTH, KEY, _abort_count, assert_healthy_and_accounted
from test_observability_e2e import prompt_ids

PREFILL_PROMPT, PREFILL_CHUNK = 3000, 16
PREFILL_STEPS = -(-PREFILL_PROMPT // PREFILL_CHUNK)  # steps the prompt's prefill takes at the least


def _raw_request(srv: Server, body: dict[str, Any]) -> socket.socket:
    """A completion request sent over a bare socket, which the test closes before the answer."""
    data = json.dumps(body).encode()
    host, port = srv.base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


@pytest.fixture(scope="module")
def prefill_server(make_tiny_model: Any) -> Iterator[Server]:
    """A server whose prefill takes many steps (a long context, small chunks): the disconnect below must be seen
    and acted on while the prefill still runs, with a margin that does not depend on how fast a step is."""
    port = free_port()
    srv = launch(f'''
[model]
path = "{make_tiny_model("llama", max_position_embeddings=4096)}"
device = "cpu"
[scheduler]
max_num_seqs = 2
chunked_prefill_size = {PREFILL_CHUNK}
[cache]
max_total_tokens = 8192
[api]
port = {port}
served_model_name = "tiny"
api_key = "{KEY}"
[observability]
enable_metrics = true
log_level = "error"
''', port, headers=AUTH)
    yield srv
    stop(srv)


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_mid_prefill_frees_the_blocks(prefill_server: Server, stream: bool) -> None:
    """A long prompt prefilled 16 tokens a step: the client leaves while the prefill runs."""
    server = prefill_server
    aborts = _abort_count(server)
    s = _raw_request(server, {"prompt": prompt_ids(40 + stream, PREFILL_PROMPT), "max_tokens": 30, "stream": stream})
    deadline = time.monotonic() + 10
    while True:
        st_ = server.stats()
        if st_["kv_blocks_owned"] > 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.005)
    steps = st_["num_steps"]
    s.close()
    t0 = time.monotonic()
    after = server.wait_idle(timeout=5)
    assert after["kv_blocks_owned"] == 0 and after["num_running"] == 0 and time.monotonic() - t0 < 2
    assert after["num_steps"] - steps < PREFILL_STEPS  # freed before the prefill could have finished
    assert _abort_count(server) == aborts + 1
    assert_healthy_and_accounted(server)
