"""`appliance run` with no file serves the embedded default model: one completion and one chat request through
the official openai client, with the completion checked against transformers' greedy output."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from pipeline_server import free_port, terminate, wait_healthy

import appliance

MODEL_DIR = Path(appliance.__file__).resolve().parent / "assets" / "default_model"
READY_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli.main", "run", "--set", f"api.port={port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, READY_TIMEOUT_S, probe_timeout_s=2)
        yield base
    finally:
        terminate(proc)


@pytest.mark.slow
def test_completion_matches_transformers_greedy(server: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model_id = client.models.list().data[0].id
    prompt = "def fibonacci(n):"
    resp = client.completions.create(model=model_id, prompt=prompt, max_tokens=16, temperature=0)
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=16, do_sample=False)
    expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert resp.choices[0].text == expected
    assert resp.usage.prompt_tokens == ids.shape[1] and 0 < resp.usage.completion_tokens <= 16


@pytest.mark.slow
def test_chat_answers(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model_id = client.models.list().data[0].id
    resp = client.chat.completions.create(
        model=model_id, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "Write a Python function `is_prime(n)`."}])
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert "<|im_end|>" not in choice.message.content and "<|im_start|>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 48
