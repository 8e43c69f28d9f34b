"""FP8 experts of MoE models in the formats people ship: compressed-tensors (per-tensor or per-channel expert
weights, dynamic or static activations), ModelOpt FP8 (per-tensor, static) and w8a8_fp8 on a 16-bit checkpoint.
Each checkpoint is written here from a random tiny Qwen3-MoE / Mixtral (every expert's gate / up / down weight
and the attention projections in e4m3) and compared with the 16-bit model: mean |logprob difference| and top-1
agreement over every prompt position. The kernels' per-row scales against the reference: kernels/moe/selfcheck.py
(fp8_rows cases, run under the interpreter by test_moe_kernels.py).

Run: python -m pytest -q -p no:cacheprovider tests/test_fp8_moe.py
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import test_moe_models
import torch
from safetensors.torch import load_file, save_file
from test_fp8_kv_cache import COMMON, _prompt_logprobs, _stats, input_amax

from appliance import LLM
from appliance.kernels.fp8_gemm import FP8, FP8_MAX
from appliance.kernels.moe.reference import fused_moe, row_quantize
from appliance.layers.moe import FusedMoE

DENSE = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
MOE_BLOCK = ("mlp", "block_sparse_moe")

family_dir = test_moe_models.family_dir  # a fixture: the tiny MoE checkpoints, built once a module


def _calibrated(module: str) -> str | None:
    """input_amax's key for transformers' modules: an attention projection's own name, an MoE block's ".moe" name
    (transformers' and the checkpoint's block names differ: Mixtral), shared by every expert."""
    if module.endswith(DENSE):
        return module
    return f"{module.rsplit('.', 1)[0]}.moe" if module.endswith(MOE_BLOCK) else None


def _quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if per_channel:
        q, scale = row_quantize(w)
        return q, scale[:, None]  # compressed-tensors' [N, 1]
    scale = (w.abs().max() / FP8_MAX).clamp_min(1e-12).reshape(1).float()
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _input_scale_key(module: str) -> str:
    """The amax key of a projection's input: its own (attention) or its MoE block's (every expert)."""
    if module.rsplit(".", 1)[-1] in DENSE:
        return module
    return next(f"{module[: module.index(f'.{b}.')]}.moe" for b in MOE_BLOCK if f".{b}." in module)


def write_fp8_moe_checkpoint(src: Path, dst: Path, layout: str, per_channel: bool = False, static: bool = False,
                             attention: bool = True) -> Path:
    """`src` (a float MoE checkpoint) in `layout` (compressed-tensors or modelopt): every expert's weights and,
    with `attention`, the attention projections in e4m3 with `weight_scale` (and `input_scale` when static); the
    router stays 16-bit, as the quantizers leave it."""
    shutil.copytree(src, dst)
    amax = input_amax(src, _calibrated) if static else {}
    tensors = load_file(str(dst / "model.safetensors"))
    projections = (DENSE if attention else ()) + EXPERT
    names = [n for n in tensors if n.endswith(tuple(f".{p}.weight" for p in projections))]
    assert any(".experts." in n for n in names)
    for name in names:
        module = name.removesuffix(".weight")
        tensors[name], scale = _quantize(tensors[name], per_channel)
        tensors[f"{module}.weight_scale"] = scale if per_channel or layout != "modelopt" else scale.reshape(())
        if static:
            tensors[f"{module}.input_scale"] = torch.tensor([amax[_input_scale_key(module)] / FP8_MAX])
    cfg = json.loads((dst / "config.json").read_text())
    if layout == "compressed-tensors":
        act = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True} if static
               else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$",
                       *([] if attention else ["re:.*self_attn.*"])], "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": act,
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel" if per_channel else "tensor",
                            "dynamic": False, "symmetric": True}}}}
    else:
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "FP8", "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head", "*.gate", *([] if attention else ["*self_attn*"])]}}))
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _experts(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.executor.runner.model.modules() if isinstance(m, FusedMoE)]


# (family, layout, per-channel, static activations, attention in fp8 too) -> measured (bf16, CPU) mean |logprob
# diff| and top-1 agreement. W8A8 attention dominates (the dense checkpoints' bounds, test_fp8_checkpoints.py:
# 0.15 / 0.7); the weight-only experts alone sit near the bf16 / float32 difference (0.005 / 0.96), bounds ~2x.
CASES = [
    ("qwen3_moe", "compressed-tensors", True, False, True),  # 0.089 / 0.80
    ("qwen3_moe", "compressed-tensors", False, True, True),  # 0.081 / 0.81
    ("qwen3_moe", "modelopt", False, True, True),  # 0.081 / 0.81
    ("mixtral", "compressed-tensors", True, False, True),  # 0.072 / 0.83
    ("mixtral", "modelopt", False, True, True),  # 0.090 / 0.75
    ("qwen3_moe", "compressed-tensors", True, False, False),  # experts only: 0.011 / 0.93
    ("mixtral", "compressed-tensors", True, False, False),  # experts only: 0.034 / 0.90
]


@pytest.mark.parametrize("family,layout,per_channel,static,attention", CASES)
def test_fp8_expert_checkpoints_stay_close_to_16_bit(family_dir: Any, tmp_path: Path, family: str, layout: str,
                                                     per_channel: bool, static: bool, attention: bool) -> None:
    src = family_dir(family)
    dst = write_fp8_moe_checkpoint(src, tmp_path / "fp8", layout, per_channel, static, attention)
    base = LLM(model=str(src), **COMMON)
    fp8 = LLM(model=str(dst), **COMMON)
    experts = _experts(fp8)
    assert experts and all(m.w13_weight.dtype is FP8 and m.w2_weight.dtype is FP8 for m in experts)
    e, two_i, _ = experts[0].w13_weight.shape
    assert experts[0].w13_weight_scale.shape == (e, two_i)
    assert experts[0].w2_weight_scale.shape == experts[0].w2_weight.shape[:2]
    if not per_channel:  # a per-tensor scale repeated over the rows of its part (gate, up)
        s = experts[0].w13_weight_scale[0]
        assert torch.all(s[: two_i // 2] == s[0]) and torch.all(s[two_i // 2 :] == s[two_i // 2])
    mean, agree = _stats(_prompt_logprobs(base), _prompt_logprobs(fp8))
    bound, floor = (0.15, 0.7) if attention else (0.07, 0.85)
    assert mean < bound and agree >= floor, (mean, agree)


def test_w8a8_fp8_quantizes_the_experts_online(family_dir: Any) -> None:
    src = family_dir("qwen3_moe")
    base = LLM(model=str(src), **COMMON)
    fp8 = LLM(model=str(src), quantization="w8a8_fp8", **COMMON)
    experts = _experts(fp8)
    assert experts and all(m.w13_weight.dtype is FP8 and m.w13_weight_scale is not None for m in experts)
    mean, agree = _stats(_prompt_logprobs(base), _prompt_logprobs(fp8))
    assert mean < 0.15 and agree >= 0.7, (mean, agree)


def test_row_scaled_experts_match_the_dequantized_product() -> None:
    """The reference fused MoE with per-row scales equals the 16-bit MoE on the dequantized weights (exactly),
    and stays within e4m3's rounding of the float weights."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 32, generator=g)
    w13, w2 = torch.randn(4, 48, 32, generator=g) * 0.2, torch.randn(4, 32, 24, generator=g) * 0.2
    weights, ids = torch.randn(9, 4, generator=g).softmax(-1).topk(2, dim=-1)
    (q13, s13), (q2, s2) = row_quantize(w13), row_quantize(w2)
    got = fused_moe(x, q13, q2, weights, ids, s13, s2, None)
    want = fused_moe(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights, ids)
    assert torch.allclose(got, want, atol=1e-6)
    exact = fused_moe(x, w13, w2, weights, ids)
    assert (got - exact).norm() / exact.norm() < 0.08
    with pytest.raises(ValueError, match="no block_shape"):
        fused_moe(x, q13, q2, weights, ids, s13, s2, (16, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_experts_through_the_triton_moe(family_dir: Any, tmp_path: Path) -> None:
    """Qwen3-MoE per-channel compressed-tensors on the GPU: the Triton fused MoE (per-row scales dequantized in the
    GEMM), decode graphs, bf16; within the CPU bounds of the 16-bit model."""
    src = family_dir("qwen3_moe")
    dst = write_fp8_moe_checkpoint(src, tmp_path / "fp8", "compressed-tensors", per_channel=True)
    kw = {**COMMON, "device": "cuda", "gpu_memory_utilization": 0.3, "moe_backend": "triton", "block_size": 16}
    base, fp8 = LLM(model=str(src), **kw), LLM(model=str(dst), **kw)
    assert fp8.executor.runner.graphs is not None
    mean, agree = _stats(_prompt_logprobs(base), _prompt_logprobs(fp8))
    assert mean < 0.15 and agree >= 0.7, (mean, agree)
