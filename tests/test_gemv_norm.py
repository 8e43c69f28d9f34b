"""`gemv_rms_norm`: the decode GEMV with the residual add + RMSNorm of its input in its prologue, and the Llama
decoder layer wired through it (input_layernorm -> qkv_proj, post_attention_layernorm -> gate_up_proj).

The Triton kernel runs on the CPU under TRITON_INTERPRET=1 in a subprocess (this file run as a script prints one
JSON row per case); `@pytest.mark.gpu` runs Llama-8B shapes in-process. The interpreter rounds float32 ->
bfloat16 by truncation (a GPU rounds to nearest even, as torch does), so on the CPU the bf16 residual sum is held
to the Triton rms_norm's (same rounding) and to one ulp of the reference; fp16 and fp32 must match the reference
bit for bit.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from appliance.kernels.reference.linear import GEMV_MAX_ROWS
from appliance.kernels.registry import get

bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = {"bf16": bf, "f16": f16, "f32": f32}
# name -> (dtype, rows, residual, bias, K, N, config overrides): K is never a multiple of the interpreter's
# 32-wide K tile; the split-K and PDL variants cover the kernel's other two code paths
CASES: dict[str, tuple[str, int, bool, bool, int, int, dict[str, Any]]] = {
    f"{d}-m{m}-{'res' if r else 'nores'}-{'bias' if b else 'nobias'}": (d, m, r, b, 72, 40, {})
    for d, m, r, b in itertools.product(("f16", "bf16"), (1, 3, 16), (True, False), (True, False))
}
CASES |= {
    "f32-m3-res-bias": ("f32", 3, True, True, 72, 40, {}),
    "f32-m16-nores": ("f32", 16, False, False, 100, 24, {}),
    "f16-m16-res-k200": ("f16", 16, True, True, 200, 40, {}),  # the norm's pre-pass takes two K tiles
    "f16-m3-res-splitk": ("f16", 3, True, True, 136, 40, {"split_k": 3}),
    "bf16-m16-res-splitk": ("bf16", 16, True, False, 136, 24, {"split_k": 2}),
    "f16-m3-res-pdl": ("f16", 3, True, False, 72, 40, {"pdl": True}),
    "bf16-m1-nores-pdl": ("bf16", 1, False, True, 72, 40, {"pdl": True}),
}
MODEL_ARCHS = ("llama", "qwen2", "mixtral")
Y_REL = {f32: 1e-5, f16: 2e-3, bf: 2e-2}  # y vs the reference (the GEMV's own tolerance: fp32 sums, any order)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def inputs(dtype: torch.dtype, m: int, residual: bool, bias: bool, k: int, n: int, device: str,
           seed: int = 0) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    res = torch.randn(m, k, generator=g) if residual else None
    norm_w = 1 + 0.3 * torch.randn(k, generator=g)  # not ones: a missing weight multiply must show
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return tuple(t.to(device, dtype) if t is not None else None for t in (x, res, norm_w)) + (
        1e-6, w.to(device, dtype), b.to(device, dtype) if b is not None else None)


def run_case(spec: tuple[Any, ...], device: str) -> dict[str, Any]:
    """The Triton op vs the reference op and vs the unfused Triton chain (rms_norm kernel, then the GEMV)."""
    from appliance.kernels.triton.gemv import GemvConfig, config_for

    dname, m, residual, bias, k, n, overrides = spec
    dtype = DTYPES[dname]
    x, res, norm_w, eps, w, b = inputs(dtype, m, residual, bias, k, n, device)
    cfg = GemvConfig(**{**config_for(n, k).__dict__, **overrides})
    y, summed = get("gemv_rms_norm", "triton")(x, res, norm_w, eps, w, b, config=cfg)
    y_ref, summed_ref = get("gemv_rms_norm", "torch")(x, res, norm_w, eps, w, b)
    normed = get("rms_norm", "triton")(x, norm_w, eps, res)
    h, summed_chain = normed if res is not None else (normed, None)
    y_chain = get("gemv", "triton")(h, w, b, config=cfg)
    row: dict[str, Any] = {"y_shape": list(y.shape), "y_dtype": str(y.dtype).split(".")[-1],
                           "y_rel": rel(y, y_ref), "y_chain_rel": rel(y, y_chain),
                           "y_chain_exact": float((y == y_chain).float().mean()), "has_sum": summed is not None,
                           "x_untouched": True}
    if summed is not None:
        ulp = torch.finfo(dtype).eps * summed_ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
        row |= {"sum_equal_ref": bool(torch.equal(summed, summed_ref)),
                "sum_equal_chain": bool(torch.equal(summed, summed_chain)),
                "sum_ulps": float(((summed.float() - summed_ref.float()).abs() / ulp).max())}
    return row


def model_case(arch: str, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """A tiny model with the Triton GEMVs bound as the runner binds them: hidden states with the fused norm vs
    with the plain GEMV after the rms_norm op, at decode-sized batches."""
    from appliance.layers.linear import use_gemv_kernel

    model = _model(arch, device, dtype)
    use_gemv_kernel(model, "triton")
    calls = Recorder(get("gemv_rms_norm", "triton"))
    projections = [m for m in model.modules() if getattr(m, "gemv_norm", None) is calls.inner]
    for proj in projections:
        proj.gemv_norm = calls
    fused = {t: _hidden(model, t, device) for t in (1, 5)}
    for proj in projections:
        proj.gemv_norm = None
    unfused = {t: _hidden(model, t, device) for t in fused}
    return {"rel": max(rel(fused[t], unfused[t]) for t in fused), "fused_rows": calls.rows,
            "exact": min(float((fused[t] == unfused[t]).float().mean()) for t in fused)}


def main() -> None:
    """Under TRITON_INTERPRET=1: one JSON row per case."""
    import appliance.kernels.triton  # noqa: F401  (registers the ops)

    jobs = {name: lambda spec=spec: run_case(spec, "cpu") for name, spec in CASES.items()}
    jobs |= {f"model-{arch}": lambda arch=arch: model_case(arch, "cpu", f16) for arch in MODEL_ARCHS}
    for name, job in jobs.items():
        try:
            print(json.dumps({"case": name, **job()}), flush=True)
        except Exception as exc:  # noqa: BLE001  (one failing case must not hide the others)
            print(json.dumps({"case": name, "error": f"{type(exc).__name__}: {exc}"}), flush=True)


def check_row(row: dict[str, Any], spec: tuple[Any, ...], on_gpu: bool) -> None:
    dname, m, residual, _, _, n, _ = spec
    dtype = DTYPES[dname]
    assert "error" not in row, row.get("error")
    assert row["y_shape"] == [m, n] and row["y_dtype"] == str(dtype).split(".")[-1]
    assert row["y_rel"] < Y_REL[dtype], row
    # the same input rounding and the same GEMV: only the fp32 order of the sum of squares may differ, which
    # moves a half-precision input element by one ulp at most, now and then (fp32 inputs keep every bit of it)
    assert row["y_chain_rel"] < Y_REL[dtype] / 10, row
    if dtype != f32:
        assert row["y_chain_exact"] >= 0.9, row
    assert row["has_sum"] == residual
    if residual:
        assert row["sum_equal_chain"], "the residual sum must be rounded like the rms_norm kernel's"
        if on_gpu or dtype != bf:
            assert row["sum_equal_ref"], "the residual sum must equal the reference bit for bit"
        else:  # the interpreter truncates to bf16
            assert row["sum_ulps"] <= 1.0, row


# ------------------------------------------------------------------------------------------------ CPU, interpreted
@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    pytest.importorskip("triton")
    from selfcheck_runner import interpreted_rows

    rows = interpreted_rows("tests.test_gemv_norm", timeout=180)
    return {r["case"]: r for r in rows}


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_reference(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    assert name in interpreted, f"case {name} produced no result"
    check_row(interpreted[name], CASES[name], on_gpu=False)


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_interpreted_model_fused_matches_unfused(interpreted: dict[str, dict[str, Any]], arch: str) -> None:
    """Triton's GEMVs bound (fp16: the interpreter rounds to nearest like the GPU): the fused norm changes no
    hidden-state bit beyond the odd sum-of-squares ordering flip."""
    row = interpreted[f"model-{arch}"]
    assert "error" not in row, row.get("error")
    per_step = 2 if arch == "mixtral" else 4  # qkv per layer (+ gate_up per dense layer), two layers
    assert row["fused_rows"] == [1] * per_step + [5] * per_step
    assert row["rel"] < 1e-3 and row["exact"] >= 0.95, row


@pytest.mark.parametrize("residual", [True, False])
def test_reference_is_rms_norm_then_linear(residual: bool) -> None:
    """Bit for bit the reference rms_norm, then the reference linear: the CPU path's numbers do not move."""
    x, res, norm_w, eps, w, b = inputs(bf, 5, residual, True, 64, 24, "cpu", seed=1)
    y, summed = get("gemv_rms_norm", "torch")(x, res, norm_w, eps, w, b)
    if residual:
        h, want_sum = get("rms_norm", "torch")(x, norm_w, eps, res)
        assert summed is not None and torch.equal(summed, want_sum)
    else:
        h = get("rms_norm", "torch")(x, norm_w, eps)
        assert summed is None
    assert torch.equal(y, F.linear(h, w, b))


def test_bad_arguments_raise_clear_errors() -> None:
    pytest.importorskip("triton")
    import appliance.kernels.triton  # noqa: F401

    op = get("gemv_rms_norm", "triton")
    x, res, norm_w, eps, w, b = inputs(bf, 3, True, False, 64, 24, "cpu")
    with pytest.raises(ValueError, match="gemv_rms_norm: x"):
        op(torch.zeros(GEMV_MAX_ROWS + 1, 64, dtype=bf), None, norm_w, eps, w)
    with pytest.raises(ValueError, match="gemv_rms_norm: x"):
        op(x[:, :32], None, norm_w[:32], eps, w)
    with pytest.raises(ValueError, match="norm weight"):
        op(x, res, norm_w[:32], eps, w)
    with pytest.raises(ValueError, match="norm weight"):
        op(x, res, norm_w.float(), eps, w)
    with pytest.raises(ValueError, match="residual"):
        op(x, res[:2], norm_w, eps, w)


# ------------------------------------------------------------------------------------------------ the layers
class Recorder:
    """A bound op that runs `inner` and notes the row count of every call."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner, self.rows = inner, []

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.rows.append(x.shape[0])
        return self.inner(x, *args, **kwargs)


def _tiny_cfg(**extra: Any) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=96, num_hidden_layers=2, vocab_size=128, max_position_embeddings=64,
                           rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                           **extra)


def _model(arch: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from appliance.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
    from appliance.models.mixtral import MixtralForCausalLM

    torch.manual_seed(0)
    if arch == "mixtral":
        model = MixtralForCausalLM(_tiny_cfg(num_local_experts=4, num_experts_per_tok=2), "torch")
    else:
        model = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[arch](_tiny_cfg(), "torch")
    model = model.to(device, dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.5)  # norm weights too: ones would hide a missing multiply
    return model


def _hidden(model: torch.nn.Module, tokens: int, device: str) -> torch.Tensor:
    """The final hidden states of one prompt of `tokens` tokens (fresh KV caches each call)."""
    from appliance.layers.attention import AttentionMetadata

    page, blocks = 4, 8
    i32 = {"dtype": torch.int32, "device": device}
    for attn in model.attention_layers():
        attn.bind_kv_cache(*(torch.zeros(blocks, page, 2, 16, dtype=model.lm_head.weight.dtype, device=device)
                             for _ in range(2)))
    meta = AttentionMetadata(slot_mapping=torch.arange(tokens, device=device), num_decode_tokens=0,
                             decode_block_tables=torch.zeros(0, blocks, **i32), decode_seq_lens=torch.zeros(0, **i32),
                             prefill_cu_seqlens=torch.tensor([0, tokens], **i32),
                             prefill_seq_lens=torch.tensor([tokens], **i32),
                             prefill_block_tables=torch.arange(blocks, **i32)[None])
    ids = torch.randint(0, 128, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(device)
    with torch.inference_mode():
        return model(ids, torch.arange(tokens, device=device), meta)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_layers_take_the_fused_op_at_decode_sizes_only(arch: str) -> None:
    """With the reference ops bound (the reference fused op is the unfused composition), hidden states equal the
    unbound model's bit for bit; the fused op serves qkv (and gate_up, dense MLPs only) at <= 16 rows."""
    model = _model(arch, "cpu", bf)
    want = {t: _hidden(model, t, "cpu") for t in (1, 5, GEMV_MAX_ROWS + 1)}
    fused = Recorder(get("gemv_rms_norm", "torch"))
    for module in model.modules():
        if hasattr(module, "gemv_norm"):
            module.gemv, module.gemv_norm = get("gemv", "torch"), fused
    for t, ref in want.items():
        assert torch.equal(_hidden(model, t, "cpu"), ref), t
    per_step = 2 if arch == "mixtral" else 4  # qkv per layer (+ gate_up per dense layer), two layers
    assert fused.rows == [1] * per_step + [5] * per_step


def test_normed_linear_fuses_only_what_the_gemv_serves() -> None:
    """ColumnParallelLinear.normed: fp32 and batches above GEMV_MAX_ROWS run the norm, then the layer; a
    decode-sized half batch runs the bound fused op once, with the same results (reference op bound)."""
    from appliance.layers.linear import ColumnParallelLinear
    from appliance.layers.norm import RMSNorm

    linear, norm = ColumnParallelLinear(32, 16, bias=True), RMSNorm(32)
    for p in (*linear.parameters(), *norm.parameters()):
        p.data.normal_()
    fused = Recorder(get("gemv_rms_norm", "torch"))
    linear.gemv_norm = fused
    for dtype, rows in ((f32, 2), (bf, GEMV_MAX_ROWS + 1), (bf, 2)):
        linear.to(dtype), norm.to(dtype)
        x, res = torch.randn(rows, 32, dtype=dtype), torch.randn(rows, 32, dtype=dtype)
        y, summed = linear.normed(norm, x, res)
        h, want_sum = norm(x, res)
        assert torch.equal(y, linear(h)) and torch.equal(summed, want_sum)
        y, same_x = linear.normed(norm, x, None)  # the first layer: no residual yet, x is what later layers add
        assert torch.equal(y, linear(norm(x))) and same_x is x
    assert fused.rows == [2, 2]


def test_use_gemv_kernel_binds_the_fused_op_to_column_parallel_layers() -> None:
    pytest.importorskip("triton")
    from appliance.layers.linear import use_gemv_kernel

    model = _model("llama", "cpu", bf)
    assert use_gemv_kernel(model, "torch") == 0
    assert all(getattr(m, "gemv_norm", None) is None for m in model.modules())
    use_gemv_kernel(model, "triton")
    layer = model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert proj.gemv_norm is get("gemv_rms_norm", "triton")
    assert not hasattr(layer.mlp.down_proj, "gemv_norm")  # its input is sharded across ranks: no norm to fuse


def test_kernel_lab_norm_chain_smoke() -> None:
    """tools/kernel_lab.py's norm_chain section on the CPU: every variant runs, the fused one matches the chain."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "tools" / "kernel_lab.py"), "--smoke", "--only", "norm_chain"],
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert not [r for r in rows if "error" in r]
    checks = [r for r in rows if r["section"] == "norm_chain_check"]
    assert len(checks) == 4 and all(r["err"] < 1e-4 for r in checks)  # float32 in the smoke
    timed = [r for r in rows if r["section"] == "norm_chain"]
    assert {r["impl"] for r in timed} == {"gemv only", "rms_norm+gemv", "fused", "rms_norm+gemv+pdl", "fused+pdl"}


# ------------------------------------------------------------------------------------------------ GPU
LLAMA_8B = {"qkv": (6144, 4096), "gate_up": (28672, 4096)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("shape", "m", "residual"), list(itertools.product(LLAMA_8B, (1, 8), (True, False))))
def test_gpu_llama_8b_shapes_match_rms_norm_then_gemv(shape: str, m: int, residual: bool) -> None:
    import appliance.kernels.triton  # noqa: F401

    n, k = LLAMA_8B[shape]
    spec = ("bf16", m, residual, False, k, n, {})
    row = run_case(spec, "cuda")
    print(shape, json.dumps(row))
    check_row(row, spec, on_gpu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gpu_model_fused_matches_unfused(arch: str) -> None:
    """The Triton GEMVs bound (as the runner binds them), with and without the fused norm."""
    import appliance.kernels.triton  # noqa: F401
    from appliance.layers.linear import use_gemv_kernel

    model = _model(arch, "cuda", bf)
    use_gemv_kernel(model, "triton")
    fused = {t: _hidden(model, t, "cuda") for t in (1, 8)}
    for module in model.modules():
        if hasattr(module, "gemv_norm"):
            module.gemv_norm = None
    for t, got in fused.items():
        want = _hidden(model, t, "cuda")
        assert rel(got, want) < 1e-2, (t, rel(got, want))


if __name__ == "__main__":
    main()
