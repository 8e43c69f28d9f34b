"""A Qwen3-Next (hybrid linear-attention) model behind the real pipeline, driven by the official openai client:
greedy completions equal transformers', streamed or not, and /metrics shows the state cache."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pipeline_server import Server, free_port, launch, stop
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

PROMPTS = [list(range(3, 3 + 45)), [5, 6, 7, 8, 9], [77]]
NEW = 6


@pytest.fixture(scope="module")
def hybrid_model(make_tiny_model: Any):
    return make_tiny_model("qwen3_next")


@pytest.fixture(scope="module")
def server(hybrid_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    config = f'''
[model]
path = "{hybrid_model}"
device = "cpu"
[scheduler]
chunked_prefill_size = 16
max_num_seqs = 4
[cache]
max_total_tokens = 1024
[api]
port = {port}
served_model_name = "tiny"
[observability]
enable_metrics = true
log_level = "warning"
'''
    srv = launch(config, port, cfg_path=tmp_path_factory.mktemp("hybrid") / "serve.toml")
    yield srv
    stop(srv)


def test_greedy_completions_match_transformers(server: Server, hybrid_model: Any, hf_greedy: Any) -> None:
    refs = hf_greedy(hybrid_model, PROMPTS, NEW)
    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt, (tokens, _) in zip(PROMPTS, refs):
        out = c.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == tokens
        streamed = c.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [t for chunk in streamed for t in (chunk.choices[0].token_ids or [])] == tokens


def test_metrics_show_the_state_cache(server: Server) -> None:
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["appliance:state_slots_total"] == 4
    # 2 linear-attention layers x (conv 128 x 3 + state 4 x 16 x 16) float32, 4 slots + the scratch slot
    assert values["appliance:state_cache_bytes"] == 5 * 2 * (128 * 3 * 4 + 4 * 16 * 16 * 4)
    assert values["appliance:state_slots_used"] == 0
