"""The real pipeline (supervisor, worker, scheduler, tokenizer processes) with scheduler.enable_overlap: greedy
completions equal the offline synchronous engine's, concurrent and aborted streams leave every block free."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from appliance import LLM, SamplingParams
from tests.test_pipeline_e2e import Server, _free_port, alive, client

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8, 9], [77], list(range(200, 217)), [90, 90, 90, 100, 101]]


@pytest.fixture(scope="module")
def overlap_server(make_tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model("llama")
    port = _free_port()
    cfg = tmp_path_factory.mktemp("overlap") / "serve.toml"
    cfg.write_text(f'''
[model]
path = "{model}"
device = "cpu"
[cache]
max_total_tokens = 4096
[scheduler]
enable_overlap = true
chunked_prefill_size = 16
[api]
port = {port}
served_model_name = "tiny"
[observability]
log_level = "warning"
''')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli.main", "run", str(cfg)], env=env)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "the supervisor exited during start-up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "not ready in 120 s"
        time.sleep(0.2)
    srv = Server(proc, port)
    yield srv
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not any(alive(pid) for pid in srv.stages)


def test_overlap_pipeline_equals_the_synchronous_engine(overlap_server: Server, make_tiny_model: Any) -> None:
    llm = LLM(model=str(make_tiny_model("llama")), max_total_tokens=4096)
    want = [o.outputs[0].text for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    c = client(overlap_server)

    def complete(prompt: list[int]) -> str:
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 12
        return r.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(complete, PROMPTS * 2))
    assert got == want * 2 and all(want)
    # a stream closed after two chunks is aborted while a step is in flight
    stream = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=200, temperature=0.0, stream=True,
                                  extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()
    s = overlap_server.wait_idle()
    assert (s["num_running"], s["num_waiting"], s["kv_blocks_owned"]) == (0, 0, 0), s
    assert s["kv_blocks_free"] + s["kv_blocks_cached"] == s["kv_blocks_total"] and s["accounting_ok"], s
