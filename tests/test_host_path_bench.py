"""benchmarks/host_path.py: the timed worker behaves as a device queue (steps back to back, idle time counted
only when a plan comes late), and the real tokenizer and scheduler stages in front of it stream every token of
every request, in order, with the usage and finish reason the engine gave."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from appliance.bench.presets import write_word_tokenizer
from appliance.config import build_config
from appliance.engine.step import NewRequestData, ScheduledRequest, StepPlan
from benchmarks.host_path import Options, TimedSupervisor, free_port
from benchmarks.host_path_stage import TimedRunner

VOCAB = 2000


def _model(tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}))
    write_word_tokenizer(tmp, VOCAB, 1, 2)
    return tmp


def _expected_ids(prompt_len: int, max_tokens: int) -> list[int]:
    span = VOCAB - 1000
    return [500 + (n * 7919) % span for n in range(prompt_len + 1, prompt_len + max_tokens + 1)]


def test_timed_runner_queues_steps_and_counts_idle_time(tmp_path: Path) -> None:
    config = build_config(dotlist=[f"model.path={_model(tmp_path / 'm')}"])
    runner = TimedRunner(config, 0.02)
    plan = StepPlan(0, [NewRequestData("a", [5, 6, 7], 3, 0, [1], {})], [ScheduledRequest("a", 3, [], True)])
    t0 = time.monotonic()
    first = runner.launch(plan)
    second = runner.launch(StepPlan(1, [], [ScheduledRequest("a", 1, [], True)]))  # queued behind the first
    assert not first.event.query() or time.monotonic() - t0 >= 0.02
    assert [t.token_id for t in runner.finish(first).sampled] == _expected_ids(3, 1)
    assert [t.token_id for t in runner.finish(second).sampled] == _expected_ids(4, 1)[:1] and \
        time.monotonic() - t0 >= 0.04
    assert runner.idle_s == 0.0  # the second plan came before the first step ended
    time.sleep(0.03)
    runner.finish(runner.launch(StepPlan(2, [], [ScheduledRequest("a", 1, [], True)])))
    assert 0.02 <= runner.idle_s < 0.5


@pytest.mark.slow
def test_the_pipeline_streams_every_token_through_the_timed_worker(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    config = build_config(dotlist=[f"model.path={model}", f"api.port={free_port()}", "api.host=127.0.0.1",
                                   "api.served_model_name=bench"])
    sup = TimedSupervisor(config, Options(2.0, None, tmp_path / "ledger.json"))
    words = [f"w{i}" for i in range(100, 100 + 40)]
    try:
        sup.start()
        base = f"http://127.0.0.1:{sup.port}"

        async def one(client: httpx.AsyncClient, k: int, max_tokens: int) -> tuple[str, dict, str | None]:
            body = {"model": "bench", "prompt": " ".join(words[: 10 + k]), "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            text, usage, finish = "", {}, None
            async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        obj = json.loads(line[6:])
                        usage = obj.get("usage") or usage
                        for c in obj["choices"]:
                            text += c["text"]
                            finish = c["finish_reason"] or finish
            return text, usage, finish

        async def run_all() -> list[tuple[str, dict, str | None]]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(one(client, k, 20 + 3 * k) for k in range(12)))

        for k, (text, usage, finish) in enumerate(asyncio.run(run_all())):
            prompt_len = 10 + k  # one token per word (the word-level tokenizer adds no BOS)
            ids = _expected_ids(prompt_len, 20 + 3 * k)
            assert text == "".join(f" w{i}" for i in ids)
            assert usage["prompt_tokens"] == prompt_len and usage["completion_tokens"] == len(ids)
            assert finish == "length"
        assert json.loads((tmp_path / "ledger.json").read_text())["steps"] > 0
    finally:
        sup.stop()
        sup.close()

