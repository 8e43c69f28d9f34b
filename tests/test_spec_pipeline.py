"""The real pipeline (supervisor, worker, scheduler, tokenizer processes) with MTP speculative decoding on a tiny
DeepSeek-V3 (dummy weights, one MTP layer): completions equal the offline engine's without speculation, and the
KV pool is whole afterwards. Tensor parallelism (2 CPU worker processes, gloo): the MTP layer is sharded like the
model's layers, and the greedy tokens equal the single-process engine's without speculation."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import spec_fixtures
from spec_fixtures import MTP_PROMPTS, spec_serve_config

from appliance import LLM, SamplingParams
from tests.pipeline_server import Server, free_port, launch, stop
from tests.test_pipeline_e2e import client

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8, 9], list(range(200, 217))]
tiny_v3, tiny_v3_served = spec_fixtures.tiny_v3, spec_fixtures.tiny_v3_served


@pytest.fixture(scope="module")
def spec_server(tiny_v3_served: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    config = spec_serve_config(tiny_v3_served, port, "num_steps = 2\neagle_topk = 1\nnum_draft_tokens = 3")
    srv = launch(config, port, cfg_path=tmp_path_factory.mktemp("spec") / "serve.toml")
    yield srv
    stop(srv)


def test_speculative_pipeline_answers_like_the_engine_without_it(spec_server: Server, tiny_v3_served: Path) -> None:
    llm = LLM(model=str(tiny_v3_served), load_format="dummy", dtype="float32", block_size=4, max_total_tokens=2048)
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    c = client(spec_server)
    for prompt, text in zip(PROMPTS, want):
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 12
        assert r.choices[0].text == text
    stats: dict[str, Any] = spec_server.wait_idle()
    assert stats["accounting_ok"] and stats["kv_blocks_owned"] == 0


def test_tensor_parallel_mtp_equals_one_process_without_it(tiny_v3: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in MTP_PROMPTS]
    kw: dict[str, Any] = {"dtype": "float32", "block_size": 4, "skip_tokenizer_init": True}
    want = [o.outputs[0].token_ids for o in LLM(model=str(tiny_v3), **kw).generate(prompts, params)]
    llm = LLM(model=str(tiny_v3), tensor_parallel_size=2, speculative_algorithm="MTP", speculative_num_steps=2, **kw)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        stats = llm.engine.stats()
        assert stats.spec_num_drafts > 0 and llm.engine.check_accounting().ok
    finally:
        llm.shutdown()


def test_overlapped_speculative_pipeline_answers_like_the_engine_without_it(
        tiny_v3_served: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """scheduler.enable_overlap with MTP: the scheduler process plans each step before the workers' previous
    verification returns, and the completions are unchanged."""
    port = free_port()
    config = spec_serve_config(tiny_v3_served, port, "num_steps = 2") + "[scheduler]\nenable_overlap = true\n"
    srv = launch(config, port, cfg_path=tmp_path_factory.mktemp("spec_overlap") / "serve.toml")
    try:
        llm = LLM(model=str(tiny_v3_served), load_format="dummy", dtype="float32", block_size=4,
                  max_total_tokens=2048)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        c = client(srv)
        for prompt, text in zip(PROMPTS, want):
            r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 12 and r.choices[0].text == text
        stats: dict[str, Any] = srv.wait_idle()
        assert stats["accounting_ok"] and stats["kv_blocks_owned"] == 0
    finally:
        stop(srv)


def test_tensor_parallel_mtp_with_overlap_equals_one_process_without_it(tiny_v3: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in MTP_PROMPTS]
    kw: dict[str, Any] = {"dtype": "float32", "block_size": 4, "skip_tokenizer_init": True}
    want = [o.outputs[0].token_ids for o in LLM(model=str(tiny_v3), **kw).generate(prompts, params)]
    llm = LLM(model=str(tiny_v3), tensor_parallel_size=2, speculative_algorithm="MTP", speculative_num_steps=2,
              enable_overlap_schedule=True, **kw)
    try:
        assert llm.engine.overlap
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        stats = llm.engine.stats()
        assert stats.spec_num_drafts > 0 and llm.engine.check_accounting().ok
    finally:
        llm.shutdown()
