"""model.skip_tokenizer_init through the real pipeline: the HTTP server starts without a tokenizer, takes token
ids and answers token ids (greedy ids equal transformers'); text prompts and stop strings are a clear 400."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from agentic_fixtures import served
from pipeline_server import free_port

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 99, 7, 130]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from conftest import build_tiny_model, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("token_ids")
    model = build_tiny_model("llama", root / "model", build_tiny_tokenizer(root / "tok"))
    port = free_port()
    config = f'''
[model]
path = "{model}"
device = "cpu"
skip_tokenizer_init = true
[cache]
max_total_tokens = 1024
[api]
port = {port}
served_model_name = "tiny"
[observability]
log_level = "warning"
'''
    with served(config, root / "serve.toml", port) as url:
        yield url, model


def test_token_ids_in_token_ids_out(server: tuple[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    base, model_dir = server
    r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                   "logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)
    want = out[0, len(PROMPT):].tolist()
    assert choice["token_ids"] == want and choice["prompt_token_ids"] == PROMPT
    assert choice["text"] == ""
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want]


def test_text_needs_a_tokenizer(server: tuple[str, Path]) -> None:
    base, _ = server
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "skip_tokenizer_init" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stop": ["x"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
