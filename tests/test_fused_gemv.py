"""The decode path of the Llama family through `fused_gemv` (norm, SiLU-and-mul and residual add inside the
projections): same hidden states as the unfused path, taken only where it applies. The kernel itself is checked
against its reference by the selfcheck cases (tests/test_kernels_triton.py, and on the GPU tools/gpu_suite.py)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from appliance.kernels.reference.linear import GEMV_MAX_ROWS
from appliance.kernels.registry import get
from appliance.layers.attention import AttentionMetadata
from appliance.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

DTYPE = torch.bfloat16
PAGE = 4


class Counting:
    """The reference fused op, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.op = get("fused_gemv", "torch")

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.op(*args, **kwargs)


def _model(cls: type[LlamaForCausalLM], **overrides: Any) -> LlamaForCausalLM:
    kw: dict[str, Any] = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                          "rms_norm_eps": 1e-6, "head_dim": 16}
    kw.update(overrides)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = cls(transformers.LlamaConfig(**kw), backend="torch").to(DTYPE)
    for p in model.parameters():
        p.data.normal_(0, 0.3)  # norm weights too: ones would hide a missing multiply
    return model.eval()


def _forward(model: LlamaForCausalLM, rows: int) -> torch.Tensor:
    """Hidden states of one prefill chunk of `rows` tokens, over fresh caches (the same for every call)."""
    blocks = -(-rows // PAGE)
    for i, layer in enumerate(model.attention_layers()):
        g = torch.Generator().manual_seed(i)
        layer.bind_kv_cache(*(torch.randn(blocks + 1, PAGE, 2, 16, generator=g).to(DTYPE) for _ in range(2)))
    i32 = {"dtype": torch.int32}
    meta = AttentionMetadata(slot_mapping=torch.arange(PAGE, PAGE + rows), num_decode_tokens=0,
                             decode_block_tables=torch.zeros(0, 1, **i32), decode_seq_lens=torch.zeros(0, **i32),
                             prefill_cu_seqlens=torch.tensor([0, rows], **i32),
                             prefill_seq_lens=torch.tensor([rows], **i32),
                             prefill_block_tables=torch.arange(1, blocks + 1, **i32)[None])
    ids = torch.randint(0, 97, (rows,), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        return model.model(ids, torch.arange(rows), meta)


def _bind(model: LlamaForCausalLM, op: Any) -> None:
    for layer in model.model.layers:
        layer.bind_fused_gemv(op)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM])
def test_fused_path_matches_unfused(cls: type[LlamaForCausalLM]) -> None:
    """Qwen2 adds a qkv bias after the fused product, Qwen3 its per-head q/k norm in the attention prologue."""
    model = _model(cls)
    want = _forward(model, 5)
    op = Counting()
    _bind(model, op)
    got = _forward(model, 5)
    assert op.calls == 4 * len(model.model.layers)  # qkv, o, gate_up, down per layer: the norms and SiLU inside
    assert _rel(got, want) < 2e-2


def test_large_batches_and_fp32_stay_unfused() -> None:
    model = _model(LlamaForCausalLM)
    op = Counting()
    _bind(model, op)
    _forward(model, GEMV_MAX_ROWS + 1)
    assert op.calls == 0
    _forward(model, GEMV_MAX_ROWS)
    assert op.calls == 4 * len(model.model.layers)
    fp32 = _model(LlamaForCausalLM).float()
    _bind(fp32, op)  # tl.dot would round fp32 through tf32: fp32 models keep cuBLAS
    assert all(layer.fused_gemv is None for layer in fp32.model.layers)


def test_layers_that_cannot_fuse_stay_unbound() -> None:
    """An o_proj bias (attention_bias) or fp8 weights keep the unfused path; so does the whole model when any
    layer stays unbound (the stream form needs every layer)."""
    biased = _model(LlamaForCausalLM, attention_bias=True)
    _bind(biased, Counting())
    assert all(layer.fused_gemv is None for layer in biased.model.layers)
    model = _model(LlamaForCausalLM)
    op = Counting()
    model.model.layers[0].bind_fused_gemv(op)
    _forward(model, 3)
    assert op.calls == 0
    model.model.layers[1].mlp.down_proj.weight.data = model.model.layers[1].mlp.down_proj.weight.data.float()
    model.model.layers[1].bind_fused_gemv(op)
    assert model.model.layers[1].fused_gemv is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_decode_matches_unfused(make_tiny_model: Any) -> None:
    """bf16 on the GPU: the runner binds the Triton fused_gemv, a decode-sized forward gives the hidden states of
    the unfused path to bf16 accuracy, and greedy generation runs through it."""
    from appliance import LLM, SamplingParams

    path = make_tiny_model("llama", hidden_size=256, intermediate_size=512)
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
              attention_backend="triton", enforce_eager=True)
    model = llm.executor.runner.model
    layers = model.model.layers
    assert all(layer.fused_gemv is get("fused_gemv", "triton") for layer in layers)
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fast = [layer.fused_gemv(x, layer.mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight,
                                 layer.post_attention_layernorm.eps, gated=True) for layer in layers]
        ref = get("fused_gemv", "torch")
        slow = [ref(x, layer.mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.eps, gated=True) for layer in layers]
    for a, b in zip(fast, slow):
        assert _rel(a, b) < 2e-2
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    fused_tokens = out[0].outputs[0].token_ids
    for layer in layers:
        layer.fused_gemv = None
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(fused_tokens) == 6
    assert fused_tokens[:2] == out[0].outputs[0].token_ids[:2]  # bf16 rounding may split near-ties later
