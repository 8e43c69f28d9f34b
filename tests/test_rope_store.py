"""The fused attention prologue `rope_store_kv` (per-head q/k RMSNorm + rotary + KV-cache store) against the
composition of the reference ops, and the Llama-family layer wired through it.

The Triton kernel runs on the CPU under TRITON_INTERPRET=1 in a subprocess (this file run as a script prints one
JSON row per case); `@pytest.mark.gpu` runs larger shapes in-process. Errors are counted in ulps of each head's
largest |reference value| ("head ulps"): rotation mixes the two halves of a pair, so an ulp of an input shows up
at the head's scale, not at a small output's own. The interpreter rounds float32 -> bfloat16 by truncation (a GPU
rounds to nearest even), so bf16 on the CPU gets a few head ulps; fp16 conversions round to nearest there and
must agree exactly almost everywhere, which pins the rounding order (normed value rounded to the input dtype
before the weight multiply, the rotation rounded once).
"""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from appliance.kernels.registry import get
from appliance.kernels.triton.selfcheck import rope_store_inputs

MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
# name -> rope_store_inputs args: tokens, heads, kv heads, head_dim, rot_dim, neox, qk norm, dtype, block_size, row_pad
# [, its keyword args]
CASES: dict[str, tuple[Any, ...]] = {
    "qwen3-like-bf16": (7, 4, 2, 64, 64, True, True, bf, 4, 0),
    "qwen3-like-f16": (7, 4, 2, 64, 64, True, True, f16, 4, 0),
    "qwen3-like-f32-rowpad": (6, 4, 2, 64, 64, True, True, f32, 4, 40),
    "llama-like-bf16-rowpad": (6, 8, 2, 64, 64, True, False, bf, 8, 64),
    "llama-like-f16": (5, 4, 1, 64, 64, True, False, f16, 4, 0),
    "gptj-partial-norm-f16": (5, 6, 2, 64, 32, False, True, f16, 4, 0),
    "gptj-partial-f32": (4, 2, 2, 64, 16, False, False, f32, 4, 8),
    "d80-norm-bf16": (6, 3, 1, 80, 80, True, True, bf, 4, 16),
    "d80-partial-gptj-norm-f16": (5, 4, 2, 80, 48, False, True, f16, 8, 0),
    "many-heads-blocked-f16": (3, 40, 8, 128, 128, True, True, f16, 16, 0),  # > one head block per program
    "f16-model-f32-cache": (5, 4, 2, 64, 64, True, True, f16, 4, 0, {"cache_dtype": f32}),
    "f16-model-f32-norm-weights": (5, 4, 2, 64, 64, True, True, f16, 4, 0, {"weight_dtype": f32}),
}
CPU_HEAD_ULPS = {f32: 16.0, f16: 1.0, bf: 4.0}
GPU_HEAD_ULPS = {f32: 16.0, f16: 2.0, bf: 2.0}


def head_ulps(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest |out - ref| in ulps (of `dtype`) of the largest |ref| in the same head (last axis)."""
    scale = ref.float().abs().amax(-1, keepdim=True).clamp_min(2.0**-14)
    _, exp = torch.frexp(scale)
    ulp = torch.ldexp(torch.ones_like(scale), exp - 1 - MANTISSA[dtype])
    return float(((out.float() - ref.float()).abs() / ulp).max())


def run_case(spec: tuple[Any, ...], device: str, seed: int = 0) -> dict[str, Any]:
    """Triton and reference on the same inputs; what the tests assert on."""
    t, h, hkv, d, rot, neox, norm, dtype, block_size, pad = spec[:10]
    extra = spec[10] if len(spec) > 10 else {}
    args = rope_store_inputs(t, h, hkv, d, rot, neox, norm, dtype, device, block_size, row_pad=pad, seed=seed,
                             **extra).args
    qkv, k0, v0, slots = args[1], args[10], args[11], args[12]
    fast_caches, ref_caches = (k0.clone(), v0.clone()), (k0.clone(), v0.clone())
    q = get("rope_store_kv", "triton")(*args[:10], *fast_caches, slots)
    q_ref = get("rope_store_kv", "torch")(*args[:10], *ref_caches, slots)
    written = torch.zeros(k0.shape[:2], dtype=torch.bool, device=device)
    keep = slots[slots >= 0]
    written.view(-1)[keep] = True
    return {
        "row_stride_padded": qkv.stride(0) > qkv.shape[1],
        "q_shape": list(q.shape), "q_contiguous": q.is_contiguous(), "q_dtype": str(q.dtype).split(".")[-1],
        "q_head_ulps": head_ulps(q, q_ref, dtype),
        "q_exact_frac": float((q == q_ref).float().mean()),
        "padding_rows": int((slots < 0).sum()),
        "k_head_ulps": head_ulps(fast_caches[0][written], ref_caches[0][written], dtype),
        "k_exact_frac": float((fast_caches[0][written] == ref_caches[0][written]).float().mean()),
        "v_equal": bool(torch.equal(fast_caches[1], ref_caches[1])),
        "untouched_equal": bool(torch.equal(fast_caches[0][~written], k0[~written])
                                and torch.equal(fast_caches[1][~written], v0[~written])),
        "written_changed": bool((fast_caches[0][written] != k0[written]).any()),
    }


def main() -> None:
    """Under TRITON_INTERPRET=1: one JSON row per case."""
    from tests.selfcheck_runner import (
        print_case_rows,  # run as `python -m tests.<this module>`
    )

    print_case_rows(CASES, run_case)


def check_row(row: dict[str, Any], spec: tuple[Any, ...], limits: dict[torch.dtype, float]) -> None:
    t, h, _, d, _, _, _, dtype, _, pad = spec[:10]
    extra = spec[10] if len(spec) > 10 else {}
    assert "error" not in row, row.get("error")
    assert row["q_shape"] == [t, h, d] and row["q_contiguous"]
    # a float32 norm weight promotes q (and the k stored), as the reference's weight multiply does
    assert row["q_dtype"] == str(extra.get("weight_dtype", dtype)).split(".")[-1]
    assert row["row_stride_padded"] == (pad > 0)
    assert row["padding_rows"] > 0  # padding rows are in every case: q computed for them, nothing stored
    assert row["q_head_ulps"] <= limits[dtype], row
    assert row["k_head_ulps"] <= limits[dtype], row
    if dtype == torch.float16 and limits is CPU_HEAD_ULPS:  # round-to-nearest on both sides: the same bits
        assert row["q_exact_frac"] >= 0.99 and row["k_exact_frac"] >= 0.99, row
    assert row["v_equal"], "v must be copied to the cache bit for bit"
    assert row["untouched_equal"], "slots not in slot_mapping (and padding rows) must stay as they were"
    assert row["written_changed"]


# ------------------------------------------------------------------------------------------------ CPU, interpreted
@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    pytest.importorskip("triton")
    from selfcheck_runner import interpreted_cases

    return interpreted_cases("tests.test_rope_store", timeout=180)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_reference(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    assert name in interpreted, f"case {name} produced no result"
    check_row(interpreted[name], CASES[name], CPU_HEAD_ULPS)


def test_reference_is_the_unfused_composition() -> None:
    """The torch op equals rms_norm per head, rope and store_kv run one after the other (bit for bit)."""
    args = rope_store_inputs(9, 4, 2, 64, 32, True, True, bf, "cpu", 4, row_pad=8, seed=3).args
    pos, qkv, h, hkv, d, cache, neox, qw, kw, eps, k0, v0, slots = args
    fused = (k0.clone(), v0.clone())
    q = get("rope_store_kv", "torch")(pos, qkv, h, hkv, d, cache, neox, qw, kw, eps, *fused, slots)
    qs, ks, vs = qkv.split([h * d, hkv * d, hkv * d], -1)
    rms = get("rms_norm", "torch")
    q2, k2 = get("rope", "torch")(pos, rms(qs.reshape(9, h, d), qw, eps), rms(ks.reshape(9, hkv, d), kw, eps),
                                  cache, neox)
    chain = (k0.clone(), v0.clone())
    get("store_kv", "torch")(k2, vs.reshape(9, hkv, d), *chain, slots)
    assert torch.equal(q, q2) and torch.equal(fused[0], chain[0]) and torch.equal(fused[1], chain[1])


def test_bad_arguments_raise_clear_errors() -> None:
    pytest.importorskip("triton")
    import appliance.kernels.triton  # noqa: F401

    args = list(rope_store_inputs(3, 4, 2, 64, 64, True, True, f32, "cpu", 4).args)
    for backend in ("torch", "triton"):
        op = get("rope_store_kv", backend)
        with pytest.raises(ValueError, match="rope_store_kv: qkv"):
            op(args[0], args[1][:, :-64], *args[2:])  # width does not fit the head counts
        with pytest.raises(ValueError, match="both q and k norm"):
            op(*args[:7], args[7], None, *args[9:])
        with pytest.raises(ValueError, match="positions"):
            op(args[0][:2], *args[1:])
        with pytest.raises(ValueError, match="caches"):
            op(*args[:10], args[10][:, :, :1], args[11][:, :, :1], args[12])
    with pytest.raises(ValueError, match="cache width"):
        get("rope_store_kv", "triton")(*args[:5], torch.randn(20, 130), *args[6:])


# ------------------------------------------------------------------------------------------------ the layer
def _tiny_cfg(qk_norm: bool) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                           attention_bias=False, qk_norm=qk_norm)


def _layers_fused_and_unfused(qk_norm: bool, backend: str, device: str, dtype: torch.dtype,
                              monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, ...]]:
    """(output, k cache, v cache) of one LlamaAttention forward with the fused op, then with it unregistered."""
    from appliance.kernels import registry
    from appliance.layers.attention import AttentionMetadata
    from appliance.models.llama import LlamaAttention

    torch.manual_seed(0)
    fused = LlamaAttention(_tiny_cfg(qk_norm), False, qk_norm, backend).to(device, dtype)
    for p in fused.parameters():
        p.data.normal_()  # norm weights too: ones would hide a missing multiply
    assert fused._rope_store is registry.get("rope_store_kv", backend)
    monkeypatch.delitem(registry._REGISTRY["rope_store_kv"], backend)
    unfused = LlamaAttention(_tiny_cfg(qk_norm), False, qk_norm, backend).to(device, dtype)
    assert unfused._rope_store is None
    unfused.load_state_dict(fused.state_dict())

    t, block_size = 6, 4
    i32 = {"dtype": torch.int32, "device": device}
    meta = AttentionMetadata(slot_mapping=torch.tensor([5, 6, 7, 8, 9, -1], device=device), num_decode_tokens=0,
                             decode_block_tables=torch.zeros(0, 3, **i32), decode_seq_lens=torch.zeros(0, **i32),
                             prefill_cu_seqlens=torch.tensor([0, 5, 6], **i32),
                             prefill_seq_lens=torch.tensor([5, 1], **i32),
                             prefill_block_tables=torch.tensor([[1, 2, 0], [3, 0, 0]], **i32))
    x = torch.randn(t, 64).to(device, dtype)
    positions = torch.tensor([0, 1, 2, 3, 4, 0], device=device)
    outs = []
    for layer in (fused, unfused):
        caches = tuple(torch.randn(4, block_size, 2, 32, generator=torch.Generator().manual_seed(s)).to(device, dtype)
                       for s in (1, 2))
        layer.attn.bind_kv_cache(*caches)
        with torch.inference_mode():
            outs.append((layer(positions, x, meta), *caches))
    return outs


@pytest.mark.parametrize("qk_norm", [True, False])
def test_layer_fused_and_unfused_paths_agree(qk_norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaAttention takes the fused op when the attention backend has one and the unfused chain when it has
    none (not torch's store behind another backend); on the torch backend both give the same bits."""
    fused, unfused = _layers_fused_and_unfused(qk_norm, "torch", "cpu", torch.float32, monkeypatch)
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


def test_attend_needs_a_bound_cache() -> None:
    from appliance.layers.attention import Attention, AttentionMetadata

    attn = Attention(2, 8, 1, 0.3, "torch")
    with pytest.raises(RuntimeError, match="no KV cache bound"):
        attn.attend(torch.randn(1, 16), AttentionMetadata(torch.zeros(1, dtype=torch.long), 1, *[torch.zeros(1)] * 5))


# ------------------------------------------------------------------------------------------------ GPU
GPU_CASES: dict[str, tuple[Any, ...]] = {
    "qwen3-0.6b-t256-bf16": (256, 16, 8, 128, 128, True, True, bf, 16, 0),
    "qwen3-0.6b-t7-bf16": (7, 16, 8, 128, 128, True, True, bf, 16, 0),
    "llama-8b-t256-bf16-rowpad": (256, 32, 8, 128, 128, True, False, bf, 16, 128),
    "gptj-partial-d80-f16": (100, 20, 4, 80, 32, False, True, f16, 16, 0),
    "qwen3-f32": (64, 16, 8, 128, 128, True, True, f32, 16, 0),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_kernel_matches_reference(name: str) -> None:
    import appliance.kernels.triton  # noqa: F401

    spec = GPU_CASES[name]
    row = run_case(spec, "cuda")
    print(name, json.dumps(row))
    check_row(row, spec, GPU_HEAD_ULPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qk_norm", [True, False])
def test_gpu_layer_triton_fused_matches_unfused(qk_norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import appliance.kernels.triton  # noqa: F401

    (out, k, v), (out_ref, k_ref, v_ref) = _layers_fused_and_unfused(qk_norm, "triton", "cuda", bf, monkeypatch)
    assert torch.equal(v, v_ref)
    assert head_ulps(k, k_ref, bf) <= GPU_HEAD_ULPS[bf]
    assert float((out.float() - out_ref.float()).norm() / out_ref.float().norm()) < 1e-2


if __name__ == "__main__":
    main()
