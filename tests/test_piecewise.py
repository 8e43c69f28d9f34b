"""Piecewise CUDA graphs for eager steps (executor/piecewise.py): token buckets, the attention piece break, and on
the GPU the same greedy tokens with the pieces as without (mixed and prefill steps of several sizes)."""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_moe_models import FAMILIES as MOE_FAMILIES
from test_moe_models import build_family

from appliance import LLM, SamplingParams
from appliance.engine.config import StepTokens
from appliance.executor.piecewise import (
    SMALL_BUCKETS,
    PiecewiseGraphs,
    all_buckets,
    bucket_for,
    buckets,
    model_supports_pieces,
    piecewise_max_tokens,
)
from appliance.layers import attention as attention_layer
from appliance.layers.attention import Attention, AttentionMetadata


def test_buckets_round_up_and_stop_at_the_budget() -> None:
    assert [bucket_for(t, 8192) for t in (1, 16, 17, 300, 512, 513, 1025, 8000, 8192)] == [
        16, 16, 32, 320, 512, 576, 1152, 8192, 8192]
    assert bucket_for(8193, 8192) is None and bucket_for(0, 8192) is None
    assert bucket_for(990, 1000) == 1000 and bucket_for(20, 24) == 24
    assert all_buckets(1000)[:3] == [1000, 960, 896]  # largest first: captured in that order
    ladder = buckets(8192)
    assert list(ladder) == sorted(set(ladder)) and ladder[-1] == 8192 and len(ladder) <= 48
    assert all(b % 16 == 0 for b in ladder)  # the kernels' divisibility specialisations recur
    # above the small buckets a step pays at most 1/8 padding (compute-bound prefill steps)
    assert max(bucket_for(t, 8192) / t for t in range(SMALL_BUCKETS[-1] + 1, 8193)) <= 1.125


def test_attend_hands_q_to_the_piece_break_while_one_is_set() -> None:
    layer = Attention(2, 4, 1, 0.5)
    seen: list[torch.Tensor] = []
    marker = torch.full((3, 8), 7.0)

    def hook(att: Attention, q: torch.Tensor) -> torch.Tensor:
        seen.append(q)
        assert att is layer
        return marker

    q = torch.randn(3, 8)
    meta = AttentionMetadata(torch.zeros(3, dtype=torch.int64), 0, torch.zeros(0, 1, dtype=torch.int32),
                             torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                             torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32))
    assert attention_layer.set_piece_break(hook) is None
    try:
        assert layer.attend(q, meta) is marker and seen == [q]
    finally:
        assert attention_layer.set_piece_break(None) is hook
    with pytest.raises(RuntimeError, match="no KV cache"):  # the hook is gone: the real path runs again
        layer.attend(q, meta)


def test_models_declare_pieces() -> None:
    from appliance.models.deepseek import DeepseekV3ForCausalLM
    from appliance.models.llama import Qwen3ForCausalLM
    from appliance.models.mixtral import MixtralForCausalLM
    from appliance.models.qwen_moe import Qwen3MoeForCausalLM

    assert Qwen3ForCausalLM.piecewise_graphs and MixtralForCausalLM.piecewise_graphs
    assert Qwen3MoeForCausalLM.piecewise_graphs and not DeepseekV3ForCausalLM.piecewise_graphs  # MLA: no attend
    assert not model_supports_pieces(torch.nn.Linear(2, 2))


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


_PROMPTS = [[5, 6, 7], list(range(10, 80)), [9] * 21, [3] * 300, [i % 383 + 1 for i in range(498)]]


def _counting(pieces: PiecewiseGraphs, seen: list[int]) -> None:
    real_run = pieces.run

    def counting_run(*args: Any) -> torch.Tensor | None:
        hidden = real_run(*args)
        seen.append(0 if hidden is None else hidden.shape[0])
        return hidden

    pieces.run = counting_run  # type: ignore[method-assign]


def _model(make_tiny_model: Any, tmp_path_factory: pytest.TempPathFactory, arch: str) -> str:
    if arch in MOE_FAMILIES:
        return str(build_family(arch, tmp_path_factory.mktemp(arch)))
    return str(make_tiny_model(arch))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "qwen3_moe"])
def test_emulated_pieces_match_eager_on_cpu(make_tiny_model, tmp_path_factory, arch: str) -> None:
    """Without graphs (CPU) PiecewiseGraphs.run keeps everything but the capture: padded static inputs (pad rows
    with slot -1), q handed over through the shared buffer, eager attention over the real rows into the static
    output. Same greedy tokens and logprobs as the plain eager forward, mixed steps included; in the MoE models
    the pad rows are routed to experts too, and change no real row."""
    llm = LLM(model=_model(make_tiny_model, tmp_path_factory, arch), dtype="float32", block_size=16,
              max_total_tokens=4096, skip_tokenizer_init=True, chunked_prefill_size=128, enable_prefix_caching=False)
    runner = llm.executor.runner
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in _PROMPTS]
    plain = llm.generate(requests, sp)
    runner.pieces, runner.use_graphs = PiecewiseGraphs(runner.model, runner.device, runner.dtype, 128), True
    seen: list[int] = []
    _counting(runner.pieces, seen)
    try:
        pieces = llm.generate(requests, sp)
    finally:
        runner.pieces, runner.use_graphs = None, False
    assert seen and 0 not in seen and len(set(seen)) >= 2  # every step ran in pieces, padded to several buckets
    assert any(bucket_for(t, 128) != t for t in seen)  # and some were padded
    for a, b in zip(plain, pieces):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        got = [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        want = [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        assert got == pytest.approx(want, abs=1e-4)
    assert llm.engine.check_accounting().ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_pieces_match_eager_on_gpu(make_tiny_model, tmp_path_factory, arch: str) -> None:
    llm = LLM(model=_model(make_tiny_model, tmp_path_factory, arch), dtype="bfloat16", block_size=16,
              max_total_tokens=16384, skip_tokenizer_init=True, cuda_graph_max_bs=8, chunked_prefill_size=128)
    runner = llm.executor.runner
    assert runner.pieces is not None
    assert sorted(runner.pieces.pieces) == list(buckets(128))  # 16, 32 ... 128 tokens: captured at warm-up
    replayed: list[int] = []
    _counting(runner.pieces, replayed)
    # prompts longer than the chunk (the tiny models hold 512 positions, 384 tokens): mixed steps (decode rows + a
    # prefill chunk) of several token counts
    prompts = _PROMPTS
    with_pieces = _greedy(llm, prompts, 12)
    assert replayed and all(replayed) and len(set(replayed)) >= 2  # every eager step ran in pieces (128, 21 tokens)
    pieces, runner.pieces = runner.pieces, None
    assert _greedy(llm, prompts, 12) == with_pieces
    runner.pieces = pieces


def _settings(on: bool = True, max_tokens: int | None = None, chunk: int = 8192, *, graphs: bool = True,
              tp: int = 1, max_len: int = 40960, model: object | None = None) -> int | None:
    cfg = SimpleNamespace(backends=SimpleNamespace(piecewise_cuda_graph=on, piecewise_cuda_graph_max_tokens=max_tokens),
                          scheduler=SimpleNamespace(chunked_prefill_size=chunk))
    dense = SimpleNamespace(supports_cuda_graphs=True, piecewise_graphs=True)
    steps = StepTokens.of(chunk, 8192, max_len)
    return piecewise_max_tokens(cfg, dense if model is None else model, graphs, tp, steps)


def test_settings_cap_the_largest_step_by_the_profiled_budget(caplog: pytest.LogCaptureFixture) -> None:
    assert _settings() == 8192 and _settings(max_len=2048) == 2048
    assert _settings(max_tokens=4096) == 4096 and _settings(max_tokens=16384) == 8192
    with caplog.at_level(logging.INFO, logger="appliance.executor.piecewise"):
        assert _settings(on=False) is None and _settings(graphs=False) is None
        assert not caplog.records  # switched off, or no graphs at all: nothing to explain
        assert _settings(tp=2) is None and _settings(chunk=-1) is None
        assert _settings(model=SimpleNamespace(supports_cuda_graphs=True)) is None
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "tensor parallelism" in said and "chunked prefill is off" in said and "does not declare" in said


def test_max_tokens_key_is_validated() -> None:
    from appliance.config import ApplianceConfig, ConfigError

    assert ApplianceConfig.model_validate({"backends": {"piecewise_cuda_graph_max_tokens": 512}}).backends \
        .piecewise_cuda_graph
    with pytest.raises((ValueError, ConfigError), match="piecewise_cuda_graph_max_tokens"):
        ApplianceConfig.model_validate({"backends": {"piecewise_cuda_graph_max_tokens": 8}})
