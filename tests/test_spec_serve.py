"""`appliance serve` with n-gram, standalone-draft and EAGLE-3 speculative decoding (chains, and an EAGLE-3 draft
tree; flags on the command line) on the tiny Llama, asked with the official openai client: greedy completions
(text, logprobs, usage) equal the offline engine's without speculation, a stop string ends the text where it ends
without speculation, /metrics shows the speculative counters, and the KV pool is whole afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TINY_VOCAB
from spec_heads import build_eagle3_head
from test_pipeline_e2e import client

from appliance import LLM, SamplingParams
from tests.pipeline_server import Server, free_port, stop, wait_healthy

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], list(range(40, 60)) + list(range(40, 50))]
NEW = 12


@pytest.fixture(scope="module", params=["NGRAM", "STANDALONE", "EAGLE3", "EAGLE3-tree"])
def served(request: pytest.FixtureRequest, tiny_model: Path, make_tiny_model: Callable[..., Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Server]]:
    algorithm, _, shape = request.param.partition("-")
    flags = ["--speculative-algorithm", algorithm, "--speculative-num-steps", "3"]
    if shape == "tree":  # a draft tree: top 3 per step, the best 6 nodes verified with the root
        flags += ["--speculative-eagle-topk", "3", "--speculative-num-draft-tokens", "7"]
    if algorithm == "STANDALONE":
        flags += ["--speculative-draft-model-path", str(make_tiny_model("llama", seed=1, num_hidden_layers=1))]
    if algorithm == "EAGLE3":
        head = build_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head", TINY_VOCAB, 128)
        flags += ["--speculative-draft-model-path", str(head)]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli.main", "serve", str(tiny_model), "--device", "cpu",
                             "--port", str(port), "--dtype", "float32", "--block-size", "4", "--max-total-tokens",
                             "2048", "--served-model-name", "tiny", "--log-level", "warning", "--enable-metrics",
                             *flags], env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 120)
        srv = Server(proc, port)
        yield algorithm, srv
    finally:
        if proc.poll() is None:
            stop(Server(proc, port) if "srv" not in locals() else srv)


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> LLM:
    return LLM(model=str(tiny_model), dtype="float32", block_size=4, max_total_tokens=2048)


def test_greedy_completions_equal_the_engine_without_speculation(served: tuple[str, Server], offline: LLM) -> None:
    algorithm, srv = served
    want = offline.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1))
    c = client(srv)
    for prompt, ref in zip(PROMPTS, want):
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0.0, logprobs=1,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == NEW
        assert r.choices[0].text == ref.outputs[0].text
        o = ref.outputs[0]
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(
            [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)], abs=1e-3)
    stats: dict[str, Any] = srv.wait_idle()
    assert stats["accounting_ok"] and stats["kv_blocks_owned"] == 0
    assert stats["spec_num_drafts"] > 0, algorithm


def test_a_stop_string_ends_where_it_ends_without_speculation(served: tuple[str, Server], offline: LLM) -> None:
    _, srv = served
    full = offline.generate([{"prompt_token_ids": PROMPTS[1]}],
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))[0].outputs[0].text
    stop_at = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop_at.strip(), full
    want = offline.generate([{"prompt_token_ids": PROMPTS[1]}],
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, stop=[stop_at]))[0]
    stream = client(srv).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=NEW, temperature=0.0,
                                            stop=[stop_at], stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.outputs[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]


def test_metrics_show_the_speculative_counters(served: tuple[str, Server]) -> None:
    _, srv = served
    client(srv).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0.0,
                                   extra_body={"ignore_eos": True})
    srv.wait_idle()
    body = httpx.get(f"{srv.base}/metrics", timeout=10).text
    drafts = [line for line in body.splitlines() if line.startswith("appliance:spec_decode_num_drafts_total{")]
    assert drafts and float(drafts[0].split()[-1]) > 0, body
