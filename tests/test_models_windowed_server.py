"""gpt-oss and Gemma 3 served by the real pipeline (`appliance run`: supervisor, tokenizer, scheduler, worker
processes) answer the official openai client with transformers' greedy tokens, streamed and not, with 16-token
chunked prefill and prefix-cache hits on the second pass; alone and split over two tensor-parallel workers (gloo):
heads, sinks and the experts' intermediate dimension sliced per rank."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from pipeline_server import free_port, launch, stop
from test_models_vs_transformers import PROMPTS
from test_models_windowed import FAMILIES, build_family

NEW = 6


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_served_greedy_matches_transformers(family: str, tp: int, tmp_path: Path, tiny_tokenizer_dir: Path,
                                            hf_greedy: Any) -> None:
    from transformers import AutoTokenizer

    model = build_family(family, tmp_path / family, tiny_tokenizer_dir)
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3]]  # 19, 29 and 12 tokens, the first and last sharing a prefix
    tok = AutoTokenizer.from_pretrained(str(model))
    want = [tok.decode(tokens) for tokens, _ in hf_greedy(model, prompts, NEW)]
    port = free_port()
    config = f'''
[model]
path = "{model}"
device = "cpu"
[precision]
dtype = "float32"
[cache]
block_size = 4
max_total_tokens = 1024
enable_prefix_caching = true
[scheduler]
chunked_prefill_size = 16
[parallelism]
tp = {tp}
[api]
port = {port}
served_model_name = "tiny"
[observability]
log_level = "warning"
'''
    srv = launch(config, port, cfg_path=tmp_path / "serve.toml")
    try:
        client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(2):  # the second pass hits the prefix cache
            for prompt, text in zip(prompts, want):
                kw: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                                      "extra_body": {"ignore_eos": True}}
                assert client.completions.create(**kw).choices[0].text == text
                streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
                assert streamed == text
        stats = srv.stats()
        assert stats["prefix_hit_rate"] > 0 and stats["accounting_ok"]
    finally:
        stop(srv)
