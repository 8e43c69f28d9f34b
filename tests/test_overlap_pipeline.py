"""The real pipeline (supervisor, worker, scheduler, tokenizer processes) with scheduler.enable_overlap: greedy
completions equal the offline synchronous engine's, concurrent and aborted streams leave every block free."""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from appliance import LLM, SamplingParams
from tests.pipeline_server import Server, free_port, launch, stop
from tests.test_pipeline_e2e import client

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8, 9], [77], list(range(200, 217)), [90, 90, 90, 100, 101]]


@pytest.fixture(scope="module")
def overlap_server(make_tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model("llama")
    port = free_port()
    cfg = tmp_path_factory.mktemp("overlap") / "serve.toml"
    config = f'''
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
'''
    srv = launch(config, port, cfg_path=cfg)
    yield srv
    stop(srv)


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
