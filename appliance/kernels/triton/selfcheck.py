"""Random inputs for every triton op and their comparison with the torch reference.

Shared by the tests (small shapes, CPU under TRITON_INTERPRET=1) and benchmarks/kernels.py (realistic shapes on the
GPU), so both check the same thing. Inputs are random normals (never zeros); outputs are compared by
||out - ref|| / ||ref|| in float64 (selfcheck_case.py). The paged-KV ops' inputs, on a random permutation of cache
blocks so wrong block indexing cannot pass: selfcheck_attention.py; the decode chain's: selfcheck_chain.py. This
module holds the other ops' inputs, the comparison and the case lists.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from appliance.kernels.reference.rope import cos_sin_cache
from appliance.kernels.registry import get
from appliance.kernels.triton.selfcheck_attention import (
    decode_inputs,
    prefill_inputs,
    store_kv_inputs,
    window_sink_cases,
)
from appliance.kernels.triton.selfcheck_case import (
    TOL,
    Case,
    CheckResult,
    Inputs,
    rel_err,
)
from appliance.kernels.triton.selfcheck_chain import (
    CHAIN_OPS,
    chain_args,
    chain_errors,
    op_args,
    op_bytes,
)

BIGK_MIN = 2100  # above sampling.BLOCK_V


def rms_norm_inputs(rows: int, hidden: int, dtype: torch.dtype, device: str, residual: bool,
                    seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    r = torch.randn(rows, hidden, generator=gen).to(dtype).to(device) if residual else None
    passes = 4 if residual else 2
    return Inputs((x, w, 1e-6, r), passes * x.numel() * x.element_size())


def norm_add_norm_inputs(rows: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    """Args of `norm_add_norm`: a block's output, its norm's weight, the residual stream, the next norm's weight
    (weights around 1, like Gemma's folded 1 + w)."""
    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(rows, hidden, generator=gen)).to(dtype).to(device)
    w1, w2 = ((1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(device) for _ in range(2))
    r = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    return Inputs((x, w1, r, w2, 1e-6), 4 * x.numel() * x.element_size())


def gdn_gating_inputs(rows: int, heads: int, dtype: torch.dtype, device: str, seed: int = 0,
                      group: int = 0) -> Inputs:
    """Args of `gdn_gating`: a and b as slices of one projection's rows (strided, as a layer passes them), with
    values past softplus's threshold (20) and far below zero, where log1p must stay accurate; group > 0: Qwen3-Next's
    [T, Hk, G] views of a projection grouped per key head (b's G values, then a's, per key head)."""
    gen = torch.Generator().manual_seed(seed)
    ba = (4 * torch.randn(rows, 2 * heads, generator=gen)).to(dtype).to(device)
    ba[0, heads:heads + 2] = torch.tensor([25.0, -30.0], dtype=dtype)
    a_log, dt_bias = (torch.randn(heads, generator=gen).to(dtype).to(device) for _ in range(2))
    if group:
        b, a = ba.view(rows, heads // group, 2 * group).split([group, group], dim=-1)
        return Inputs((a, b, a_log, dt_bias), 2 * ba.numel() * ba.element_size())
    return Inputs((ba[:, heads:], ba[:, :heads], a_log, dt_bias), 2 * ba.numel() * ba.element_size())


def gated_norm_inputs(rows: int, heads: int, dim: int, dtype: torch.dtype, device: str, seed: int = 0,
                      group: int = 0) -> Inputs:
    """Args of `gated_rms_norm`: x and gate [rows, heads, dim], a weight around 1; group > 0: the gate is
    Qwen3-Next's z, a [rows, heads / group, group * dim] slice of a wider projection."""
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(rows, heads, dim, generator=gen)).to(dtype).to(device)
    z = (2 * torch.randn(rows, heads, dim, generator=gen)).to(dtype).to(device)
    if group:
        wide = (2 * torch.randn(rows, heads // group, 3 * group * dim, generator=gen)).to(dtype).to(device)
        z = wide[:, :, group * dim: 2 * group * dim]
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype).to(device)
    return Inputs((x, z, w, 1e-6), 3 * x.numel() * x.element_size())


def rope_inputs(tokens: int, heads: int, kv_heads: int, head_dim: int, rot_dim: int, is_neox: bool,
                dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    max_pos = 4 * tokens + 8
    cache = cos_sin_cache(rot_dim, max_pos).to(device)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    return Inputs((positions, q, k, cache, is_neox), 2 * (q.numel() + k.numel()) * q.element_size())


def rope_store_inputs(tokens: int, heads: int, kv_heads: int, head_dim: int, rot_dim: int, is_neox: bool,
                      qk_norm: bool, dtype: torch.dtype, device: str, block_size: int = 16, row_pad: int = 0,
                      seed: int = 0, cache_dtype: torch.dtype | None = None,
                      weight_dtype: torch.dtype | None = None) -> Inputs:
    """Args of `rope_store_kv`: a qkv GEMM output (row stride width + row_pad), random caches with spare blocks
    (so untouched slots exist), every 5th row a padding row (slot -1). Norm weights and caches default to dtype."""
    cache_dtype, weight_dtype = cache_dtype or dtype, weight_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    rope = rope_inputs(tokens, heads, kv_heads, head_dim, rot_dim, is_neox, dtype, device, seed)
    positions, cache = rope.args[0], rope.args[3]
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + row_pad, generator=gen).to(dtype).to(device)[:, :width]
    qw, kw = ((1 + 0.3 * torch.randn(head_dim, generator=gen)).to(weight_dtype).to(device) if qk_norm else None
              for _ in range(2))
    num_blocks = (tokens + block_size - 1) // block_size + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1
    elem = qkv.element_size()
    return Inputs((positions, qkv, heads, kv_heads, head_dim, cache, is_neox, qw, kw, 1e-6, k_cache, v_cache,
                   slots.to(device)), (2 * heads + 4 * kv_heads) * head_dim * tokens * elem)


def silu_inputs(tokens: int, inter: int, dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 2 * inter, generator=gen).to(dtype).to(device)
    return Inputs((x,), 3 * tokens * inter * x.element_size())


def gemv_inputs(rows: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool = False,
                split_k: int = 1, seed: int = 0) -> Inputs:
    """Weights scaled like a trained layer's (std 1/sqrt(k)): outputs of order one, errors comparable."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    extra: tuple[tuple[str, Any], ...] = ()
    if split_k > 1:  # force the split-K (atomic) path, tiles small enough for the interpreter
        from appliance.kernels.triton.gemv import GemvConfig, config_for

        extra = (("config", GemvConfig(**{**config_for(n, k).__dict__, "split_k": split_k})),)
    return Inputs((x, w, b), w.numel() * w.element_size(), extra)


def skinny_inputs(rows: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool = False) -> Inputs:
    """gemv_inputs past the GEMV's 16 rows, with the config the kernel runs: the one measured on sm_90 where its
    table has it, else config_for's. Always the kernel: without a config the op answers with cuBLAS wherever the
    table has no winner, and would be checked against itself."""
    from appliance.kernels.triton.skinny_gemm import config_for, tuned_config

    inputs = gemv_inputs(rows, n, k, dtype, device, bias)
    config = tuned_config(rows, n, k, "sm90") or config_for(rows, n, k)
    return Inputs(inputs.args, inputs.nbytes, (("config", config),))


def sample_inputs(batch: int, vocab: int, dtype: torch.dtype, device: str, mode: str, seed: int = 0) -> Inputs:
    """mode: greedy, plain (temperature only), filtered (top-k, top-p and min-p mixed per row), mixed."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(batch, vocab, generator=gen)).to(dtype).to(device)
    temp = 0.5 + torch.rand(batch, generator=gen)
    top_k = torch.zeros(batch, dtype=torch.int32)
    top_p = torch.ones(batch)
    min_p = torch.zeros(batch)
    if mode == "greedy":
        temp.zero_()
    elif mode == "bigk":  # top-k beyond the sort fast path: bisection
        top_k = torch.randint(BIGK_MIN, vocab, (batch,), generator=gen).to(torch.int32)
        top_p[::2] = 0.9
    elif mode in ("filtered", "mixed"):
        top_k = torch.randint(1, min(vocab, 100), (batch,), generator=gen).to(torch.int32)
        top_p = 0.5 + 0.5 * torch.rand(batch, generator=gen)
        min_p = 0.05 * torch.rand(batch, generator=gen)
        top_k[1::3] = 0  # some rows without top-k
        top_p[2::3] = 1.0  # some without top-p
        if mode == "mixed":
            temp[::4] = 0.0
    seeds = torch.randint(0, 2**40, (batch,), generator=gen)
    steps = torch.randint(0, 4096, (batch,), generator=gen)
    args = tuple(t.to(device) for t in (logits, temp, top_k, top_p, min_p, seeds, steps))
    return Inputs(args, logits.numel() * logits.element_size())


def chain_inputs(op: str, spec: tuple[Any, ...], device: str) -> Inputs:
    """A decode-chain op's inputs (selfcheck_chain.chain_args: rows, hidden, inter, heads, kv heads, head_dim,
    dtype, qkv bias, cache dtype)."""
    args = op_args(op, chain_args(*spec, device))
    return Inputs(args, op_bytes(op, args))


def compare(op: str, inputs: Inputs, case: str) -> CheckResult:
    """Run the triton op and the reference on the same inputs (cloned: some ops write in place)."""
    fast: Callable[..., Any] = get(op, "triton")
    ref: Callable[..., Any] = get(op, "torch")
    a = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs.args)
    r = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs.args)
    out, want = fast(*a, **dict(inputs.fast_kwargs), **dict(inputs.kwargs)), ref(*r, **dict(inputs.kwargs))
    dtype = inputs.args[1].dtype if op in ("rope", "rope_store_kv") else inputs.args[0].dtype
    if op == "store_kv":
        err = max(rel_err(a[2], r[2]), rel_err(a[3], r[3]))
        return CheckResult(op, case, err, 0.0)
    if op == "rope_store_kv":  # q, and both caches in full (slots it must not touch included)
        err = max(rel_err(out, want), rel_err(a[10], r[10]), rel_err(a[11], r[11]))
        return CheckResult(op, case, err, TOL[dtype])
    if op == "sample":
        mismatch = float((out != want).float().mean())
        return CheckResult(op, case, mismatch, 0.0)
    if op in CHAIN_OPS:
        return CheckResult(op, case, chain_errors(op, a, r, out, want, rel_err), TOL[dtype])
    outs = out if isinstance(out, tuple) else (out,)
    wants = want if isinstance(want, tuple) else (want,)
    err = max(rel_err(o, w) for o, w in zip(outs, wants))
    return CheckResult(op, case, err, TOL[dtype])


def small_cases(device: str = "cpu") -> list[Case]:
    """Small shapes that cover every branch; fast enough for the CPU interpreter (a few seconds in all)."""
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    d = device
    return [
        ("store_kv", "bf16-page16", lambda: store_kv_inputs(20, 2, 64, 16, bf, d)),
        ("store_kv", "f16-page8-d80", lambda: store_kv_inputs(9, 3, 80, 8, f16, d)),
        ("decode_attention", "bf16-gqa4-d64-page16", lambda: decode_inputs(3, 8, 2, 64, 16, [1, 37, 100], bf, d)),
        ("decode_attention", "f16-mha-d128-page8", lambda: decode_inputs(2, 2, 2, 128, 8, [5, 64], f16, d)),
        ("decode_attention", "f32-gqa8-page32", lambda: decode_inputs(2, 8, 1, 64, 32, [33, 7], f32, d)),
        ("decode_attention", "bf16-splitk3", lambda: decode_inputs(3, 4, 2, 64, 16, [300, 1, 130], bf, d,
                                                                 num_splits=3)),
        ("decode_attention", "f32-padding-row-len0", lambda: decode_inputs(3, 4, 2, 64, 16, [0, 40, 0], f32, d)),
        ("decode_attention", "f32-padding-row-len0-split", lambda: decode_inputs(2, 4, 2, 64, 16, [0, 300], f32, d,
                                                                               num_splits=2)),
        ("decode_attention", "f16-splitk5-page64", lambda: decode_inputs(2, 4, 1, 64, 64, [250, 20], f16, d,
                                                                      num_splits=5)),
        ("decode_attention", "bf16-longest-first", lambda: decode_inputs(4, 8, 2, 64, 16, [37, 1, 100, 0], bf, d,
                                                                       longest_first=True)),
        ("decode_attention", "f32-longest-first-split", lambda: decode_inputs(3, 4, 2, 64, 16, [40, 300, 7], f32, d,
                                                                            num_splits=2, longest_first=True)),
        # splits of one 64-token tile (decode._decode_tile_kernel): newest rows at a tile's start and end
        ("decode_attention", "bf16-one-tile-splits", lambda: decode_inputs(4, 4, 2, 64, 16, [0, 65, 64, 130], bf, d,
                                                                         num_splits=3)),
        ("decode_attention", "f32-one-tile-splits-longest-first", lambda: decode_inputs(
            3, 8, 2, 64, 16, [129, 1, 70], f32, d, num_splits=4, longest_first=True)),
        ("prefill_attention", "bf16-prefix", lambda: prefill_inputs([5, 1, 70], [0, 20, 33], 4, 2, 64, 16, bf, d)),
        ("prefill_attention", "f16-empty-seq-d128", lambda: prefill_inputs([3, 0, 17], [4, 9, 0], 2, 1, 128, 8,
                                                                         f16, d)),
        ("prefill_attention", "bf16-long-prefix-unmasked-tiles", lambda: prefill_inputs(
            [20, 70], [130, 64], 2, 1, 64, 16, bf, d)),
        ("prefill_attention", "f32-page32", lambda: prefill_inputs([40], [50], 2, 2, 64, 32, f32, d)),
        *window_sink_cases(d),
        ("rms_norm", "bf16-residual", lambda: rms_norm_inputs(5, 96, bf, d, True)),
        ("rms_norm", "f16", lambda: rms_norm_inputs(4, 256, f16, d, False)),
        ("rms_norm", "f32-residual", lambda: rms_norm_inputs(3, 130, f32, d, True)),
        ("rope", "bf16-neox", lambda: rope_inputs(5, 4, 2, 64, 64, True, bf, d)),
        ("rope", "f16-gptj", lambda: rope_inputs(4, 3, 1, 128, 128, False, f16, d)),
        ("rope", "f32-neox-partial", lambda: rope_inputs(3, 2, 2, 64, 32, True, f32, d)),
        ("rope", "bf16-gptj-partial", lambda: rope_inputs(3, 2, 1, 80, 64, False, bf, d)),
        ("rope_store_kv", "bf16-qknorm-gqa", lambda: rope_store_inputs(6, 4, 2, 64, 64, True, True, bf, d, 4)),
        ("rope_store_kv", "f16-nonorm-rowpad", lambda: rope_store_inputs(5, 4, 4, 64, 64, True, False, f16, d, 8,
                                                                        row_pad=24)),
        ("rope_store_kv", "f32-gptj-partial-d80", lambda: rope_store_inputs(4, 3, 1, 80, 48, False, True, f32, d,
                                                                            4)),
        ("silu_and_mul", "bf16", lambda: silu_inputs(3, 1500, bf, d)),
        ("silu_and_mul", "f16", lambda: silu_inputs(2, 64, f16, d)),
        ("gelu_tanh_and_mul", "bf16", lambda: silu_inputs(3, 1500, bf, d, seed=1)),
        ("gelu_tanh_and_mul", "f32-ragged", lambda: silu_inputs(2, 70, f32, d, seed=2)),
        ("norm_add_norm", "bf16", lambda: norm_add_norm_inputs(5, 96, bf, d)),
        ("norm_add_norm", "f32-ragged", lambda: norm_add_norm_inputs(3, 130, f32, d, seed=1)),
        ("gdn_gating", "bf16-strided", lambda: gdn_gating_inputs(37, 8, bf, d)),
        ("gdn_gating", "f32-ragged-heads", lambda: gdn_gating_inputs(5, 6, f32, d, seed=1)),
        ("gated_rms_norm", "bf16", lambda: gated_norm_inputs(5, 4, 64, bf, d)),
        ("gated_rms_norm", "f32-ragged", lambda: gated_norm_inputs(3, 2, 48, f32, d, seed=1)),
        ("gdn_gating", "f32-grouped", lambda: gdn_gating_inputs(9, 8, f32, d, seed=2, group=2)),
        ("gated_rms_norm", "bf16-grouped-gate", lambda: gated_norm_inputs(4, 8, 32, bf, d, seed=2, group=2)),
        ("gemv", "bf16-m1-ragged", lambda: gemv_inputs(1, 50, 70, bf, d)),
        ("gemv", "f16-m5-bias", lambda: gemv_inputs(5, 40, 96, f16, d, bias=True)),
        ("gemv", "f32-m16-splitk3", lambda: gemv_inputs(16, 33, 200, f32, d, split_k=3)),
        ("skinny_gemm", "bf16-m40-ragged-bias", lambda: skinny_inputs(40, 50, 70, bf, d, bias=True)),
        ("skinny_gemm", "f16-m130-ragged", lambda: skinny_inputs(130, 33, 100, f16, d)),
        *[(op, "f16-m5-bias", lambda op=op: chain_inputs(op, (5, 96, 160, 2, 1, 64, f16, True, f16), d))
          for op in CHAIN_OPS],
        ("sample", "greedy-bf16", lambda: sample_inputs(4, 700, bf, d, "greedy")),
        ("sample", "plain-f32", lambda: sample_inputs(4, 300, f32, d, "plain")),
        ("sample", "filtered-f32", lambda: sample_inputs(6, 500, f32, d, "filtered")),
        ("sample", "mixed-f16", lambda: sample_inputs(8, 257, f16, d, "mixed", seed=3)),
        ("sample", "bigk-bisection-f32", lambda: sample_inputs(2, 2200, f32, d, "bigk")),
    ]


def realistic_cases(device: str = "cuda") -> list[Case]:
    """Llama-3.1-8B-like shapes (32 q / 8 kv heads, head_dim 128), bf16 and fp16, for the GPU."""
    bf, f16 = torch.bfloat16, torch.float16
    g = torch.Generator().manual_seed(1)
    d = device
    cases: list[Case] = []
    for dt in (bf, f16):
        name = "bf16" if dt is bf else "f16"
        for bsz, ctx in ((1, 4096), (7, 1000), (64, 1024), (256, 300)):
            lens = torch.randint(1, ctx + 1, (bsz,), generator=g).tolist()
            lens[0] = ctx
            cases.append(("decode_attention", f"{name}-b{bsz}-ctx{ctx}",
                          lambda lens=lens, bsz=bsz, dt=dt: decode_inputs(bsz, 32, 8, 128, 16, lens, dt, d)))
        cases += [
            ("decode_attention", f"{name}-d64-page32-split7", lambda dt=dt: decode_inputs(
                5, 16, 4, 64, 32, [2000, 1, 77, 1500, 640], dt, d, num_splits=7)),
            ("prefill_attention", f"{name}-prefix", lambda dt=dt: prefill_inputs(
                [512, 1, 300, 77], [512, 1000, 0, 3], 32, 8, 128, 16, dt, d)),
            ("store_kv", name, lambda dt=dt: store_kv_inputs(1000, 8, 128, 16, dt, d)),
            ("rms_norm", f"{name}-residual", lambda dt=dt: rms_norm_inputs(300, 4096, dt, d, True)),
            ("rms_norm", name, lambda dt=dt: rms_norm_inputs(64, 4096, dt, d, False)),
            ("rope", f"{name}-neox", lambda dt=dt: rope_inputs(500, 32, 8, 128, 128, True, dt, d)),
            ("rope", f"{name}-gptj-partial", lambda dt=dt: rope_inputs(100, 32, 8, 128, 64, False, dt, d)),
            ("rope_store_kv", f"{name}-qwen3-t256", lambda dt=dt: rope_store_inputs(
                256, 16, 8, 128, 128, True, True, dt, d, 16, row_pad=64)),
            ("rope_store_kv", f"{name}-llama-t300", lambda dt=dt: rope_store_inputs(300, 32, 8, 128, 128, True,
                                                                                   False, dt, d, 16)),
            ("rope_store_kv", f"{name}-gptj-partial-d80", lambda dt=dt: rope_store_inputs(
                50, 12, 4, 80, 32, False, True, dt, d, 16)),
            ("silu_and_mul", name, lambda dt=dt: silu_inputs(300, 14336, dt, d)),
            ("gelu_tanh_and_mul", f"{name}-gemma3-12b", lambda dt=dt: silu_inputs(256, 15360, dt, d)),
            ("norm_add_norm", f"{name}-gemma3-12b", lambda dt=dt: norm_add_norm_inputs(256, 3840, dt, d)),
            ("gdn_gating", f"{name}-qwen3-next-t1024", lambda dt=dt: gdn_gating_inputs(1024, 32, dt, d, group=2)),
            ("gated_rms_norm", f"{name}-qwen3-next-t1024", lambda dt=dt: gated_norm_inputs(1024, 32, 128, dt, d,
                                                                                          group=2)),
            ("gemv", f"{name}-m1-qkv", lambda dt=dt: gemv_inputs(1, 6144, 4096, dt, d)),
            ("gemv", f"{name}-m16-down-bias", lambda dt=dt: gemv_inputs(16, 4096, 14336, dt, d, bias=True)),
            ("gemv", f"{name}-m3-splitk4", lambda dt=dt: gemv_inputs(3, 1000, 14336, dt, d, split_k=4)),
            ("skinny_gemm", f"{name}-m128-qwen3-qkv", lambda dt=dt: skinny_inputs(128, 4096, 1024, dt, d)),
            ("skinny_gemm", f"{name}-m256-down-bias", lambda dt=dt: skinny_inputs(256, 4096, 14336, dt, d, bias=True)),
            ("decode_attention", f"{name}-b256-longest-first", lambda dt=dt: decode_inputs(
                256, 16, 8, 128, 16, torch.randint(1, 1500, (256,), generator=g).tolist(), dt, d,
                longest_first=True)),
        ]
        cases += [(op, f"{name}-llama-8b-m{m}", lambda op=op, m=m, dt=dt: chain_inputs(
            op, (m, 4096, 14336, 32, 8, 128, dt, False, dt), d)) for op in CHAIN_OPS for m in (1, 16)]
    cases += [
        ("sample", "mixed-bf16", lambda: sample_inputs(64, 32000, bf, d, "mixed")),
        ("sample", "greedy-f32", lambda: sample_inputs(16, 128256, torch.float32, d, "greedy")),
        ("sample", "filtered-bf16-128k", lambda: sample_inputs(8, 128256, bf, d, "filtered")),
        ("sample", "bigk-bisection-bf16-128k", lambda: sample_inputs(4, 128256, bf, d, "bigk")),
    ]
    return cases


def main() -> None:
    """Run the small cases; one JSON line per case (the CPU tests run this under TRITON_INTERPRET=1)."""
    import json
    import sys

    import appliance.kernels.triton  # noqa: F401  (registers the ops)

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    for op, case, build in small_cases(device):
        try:
            res = compare(op, build(), case)
            print(json.dumps({"op": op, "case": case, "err": res.err, "tol": res.tol}), flush=True)
        except Exception as exc:  # noqa: BLE001  (one failing case must not hide the others)
            print(json.dumps({"op": op, "case": case, "error": f"{type(exc).__name__}: {exc}"}), flush=True)


if __name__ == "__main__":
    main()
