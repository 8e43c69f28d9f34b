"""A step's token sizes are derived once (engine/config.py StepTokens) and the scheduler, the warm-up and the GPU
memory profile agree on them: the largest chunk the scheduler issues is the one the profile runs, with chunked
prefill on and off (off, a prompt longer than max_prefill_tokens runs whole).

    python -m pytest -q tests/test_step_tokens.py
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from appliance.engine import EngineConfig, EngineCore, SamplingParams
from appliance.engine.config import StepTokens
from appliance.engine.fake_executor import FakeExecutor

MAX_MODEL_LEN = 96


def _largest_scheduled_chunk(chunked_prefill_size: int, max_prefill_tokens: int, prompt_lens: list[int]) -> int:
    config = EngineConfig(num_blocks=256, block_size=4, max_num_seqs=8, chunked_prefill_size=chunked_prefill_size,
                          max_prefill_tokens=max_prefill_tokens, max_model_len=MAX_MODEL_LEN)
    ex = FakeExecutor(config.num_blocks, config.block_size, vocab_size=50)
    core = EngineCore(config, ex)
    for i, n in enumerate(prompt_lens):
        core.add_request(f"r{i}", [1 + (i + j) % 40 for j in range(n)], SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in range(1000):
        if not core.has_work():
            break
        core.step()
    assert not core.has_work()
    return max(s.num_tokens for plan in ex.plans for s in plan.scheduled)


@pytest.mark.parametrize(("chunk", "max_prefill"), [(-1, 32), (-1, 128), (48, 8192), (256, 8192)])
def test_the_largest_chunk_scheduled_is_the_derived_one(chunk: int, max_prefill: int) -> None:
    steps = StepTokens.of(chunk, max_prefill, MAX_MODEL_LEN)
    assert _largest_scheduled_chunk(chunk, max_prefill, [MAX_MODEL_LEN - 2, 20, 7]) <= steps.largest_chunk
    # a prompt as long as the model allows (less its two outputs) reaches it, up to the output room
    assert _largest_scheduled_chunk(chunk, max_prefill, [MAX_MODEL_LEN - 2]) == min(steps.largest_chunk,
                                                                                     MAX_MODEL_LEN - 2)


def test_unchunked_steps_size_the_profile_by_the_longest_prompt() -> None:
    """Without chunking a prompt longer than max_prefill_tokens runs whole: the profile must count max_model_len,
    while the scheduler's (and the warm-up's) budget stays max_prefill_tokens."""
    steps = StepTokens.of(-1, 32, MAX_MODEL_LEN)
    assert (steps.budget, steps.largest_chunk, steps.chunking) == (32, MAX_MODEL_LEN, False)
    steps = StepTokens.of(64, 8192, MAX_MODEL_LEN)
    assert (steps.budget, steps.largest_chunk, steps.chunking) == (64, 64, True)
    assert EngineConfig(num_blocks=64, chunked_prefill_size=-1, max_prefill_tokens=32,
                        max_model_len=MAX_MODEL_LEN).step_token_budget == 32


@pytest.mark.parametrize("chunk", [-1, 24])
def test_runner_warm_up_and_profile_read_the_engine_s_step_tokens(tiny_model: Path, chunk: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's StepTokens (read by warmup.py and piecewise.py) equal the engine's, and the memory profile runs
    the largest chunk (its torch.cuda calls stubbed so the CPU runs it)."""
    import torch

    from appliance import LLM
    from appliance.executor import memory_profile

    llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, skip_tokenizer_init=True, max_num_seqs=3,
              chunked_prefill_size=chunk, max_prefill_tokens=16, max_model_len=MAX_MODEL_LEN,
              max_total_tokens=1024)
    runner = llm.executor.runner
    engine_config = EngineConfig.from_appliance(runner.config, runner.num_blocks, runner.eos_token_ids,
                                                runner.max_model_len)
    assert runner.step_tokens == engine_config.step_tokens
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 1 << 40)
    profiled: list[int] = []
    real = memory_profile.build_inputs

    def build_inputs(chunks: list[Any], *args: Any, **kwargs: Any) -> Any:
        profiled.append(sum(c.num_tokens for c in chunks))
        return real(chunks, *args, **kwargs)

    monkeypatch.setattr(memory_profile, "build_inputs", build_inputs)
    memory_profile.peak_bytes(runner.model, runner.config, runner.kv_spec, runner.step_tokens, runner.device, 0)
    assert profiled == [24 if chunk > 0 else MAX_MODEL_LEN]
