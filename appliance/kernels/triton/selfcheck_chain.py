"""Random inputs for the decode chain's ops (kernels/triton/gemv_chain.py) and how their outputs compare with the
torch reference's: shared by tests/test_decode_chain.py (small shapes, CPU under TRITON_INTERPRET=1) and
selfcheck.py's cases, which benchmarks/kernels.py runs at Llama-3.1-8B shapes.

Partial sums are compared by their row sums (a backend writes as many columns as it likes); the residual and the
KV caches, which the ops write in place, are compared in full.
"""
from __future__ import annotations

from typing import Any

import torch

from appliance.kernels.reference.rope import cos_sin_cache

CHAIN_OPS = ("norm_prep", "gemv_residual", "gemv_normed_silu", "gemv_normed_rope_store")
BLOCK_SIZE = 4


def chain_args(m: int, hidden: int, inter: int, nq: int, nkv: int, d: int, dtype: torch.dtype, bias: bool,
               cache_dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, Any]:
    """One layer's worth of random inputs for every chain op: weights scaled like a trained layer's, a norm
    weight near one, caches with spare slots and every fourth row a padding row (slot -1)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0, ty: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(ty).to(device)

    max_pos = 64
    blocks = (m + BLOCK_SIZE - 1) // BLOCK_SIZE + 2
    slots = torch.randperm(blocks * BLOCK_SIZE, generator=gen)[:m]
    slots[1::4] = -1
    h = rnd(m, hidden)
    g = (1 + rnd(hidden, scale=0.3, ty=torch.float32)).to(dtype)
    hf = h.float()
    return {
        "h": h, "g": g, "eps": 1e-6, "xs": (hf * g.float()).to(dtype), "partials": hf.pow(2).sum(-1, keepdim=True),
        "w_qkv": rnd((nq + 2 * nkv) * d, hidden, scale=hidden**-0.5),
        "b_qkv": rnd((nq + 2 * nkv) * d) if bias else None, "w_gu": rnd(2 * inter, hidden, scale=hidden**-0.5),
        "w_down": rnd(hidden, inter, scale=inter**-0.5), "act": rnd(m, inter), "nq": nq, "nkv": nkv, "d": d,
        "positions": torch.randint(0, max_pos, (m,), generator=gen).to(device),
        "cos_sin": cos_sin_cache(d, max_pos).to(device), "slots": slots.to(device),
        "k_cache": rnd(blocks, BLOCK_SIZE, nkv, d, ty=cache_dtype),
        "v_cache": rnd(blocks, BLOCK_SIZE, nkv, d, ty=cache_dtype),
    }


def op_args(op: str, x: dict[str, Any]) -> tuple[Any, ...]:
    """The positional args of `op` out of chain_args' dict."""
    if op == "norm_prep":
        return x["h"], x["g"]
    if op == "gemv_residual":
        return x["act"], x["w_down"], x["h"], x["g"]
    if op == "gemv_normed_silu":
        return x["xs"], x["w_gu"], x["partials"], x["eps"]
    return (x["xs"], x["w_qkv"], x["b_qkv"], x["partials"], x["eps"], x["positions"], x["nq"], x["nkv"], x["d"],
            x["cos_sin"], x["k_cache"], x["v_cache"], x["slots"])


def op_bytes(op: str, args: tuple[Any, ...]) -> int:
    """The least bytes `op` moves: its weight for the GEMVs (the activations are tiny), h in and h * g out for
    norm_prep."""
    t = args[0] if op == "norm_prep" else args[1]
    return (2 if op == "norm_prep" else 1) * t.numel() * t.element_size()


def chain_errors(op: str, fast_args: tuple[Any, ...], ref_args: tuple[Any, ...], out: Any, want: Any,
                 err: Any) -> float:
    """The largest of err(fast, reference) over what `op` writes: its outputs (partials by row sum) and the
    tensors it updates in place (the residual; both KV caches in full, untouched slots included)."""
    if op in ("norm_prep", "gemv_residual"):
        errs = [err(out[0], want[0]), err(out[1].sum(1), want[1].sum(1))]
        return max(errs + ([err(fast_args[2], ref_args[2])] if op == "gemv_residual" else []))
    if op == "gemv_normed_rope_store":
        return max(err(out, want), err(fast_args[10], ref_args[10]), err(fast_args[11], ref_args[11]))
    return err(out, want)
