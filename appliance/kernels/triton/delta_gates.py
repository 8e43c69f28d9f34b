"""The elementwise ends of a Gated DeltaNet layer, one launch each instead of a dozen small torch ops: its gates
(`gdn_gating`: the log decay g and beta from the a and b projections) and its gated output norm
(`gated_rms_norm`). A hybrid model's prefill step of a few thousand tokens spends more host time issuing a
layer's small ops than the GPU spends running them (docs/kernels.md "Hybrid models"). Both round where the
torch references (kernels/reference/gated_delta.py, norm.py) round, so they differ from them by the last bits of
exp and log only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register

_ROWS = 16  # rows per program of the gates: a row is one token's value heads, a few dozen values


@triton.jit
def _log1p(y):
    """log(1 + y) for y >= 0, accurate for small y (log(u) * y / (u - 1), u = 1 + y rounded: Goldberg's trick)."""
    u = 1.0 + y
    exact = u == 1.0  # y below half an ulp of 1: log1p(y) = y to float32's precision
    return tl.where(exact, y, tl.log(u) * (y / tl.where(exact, 1.0, u - 1.0)))


@triton.jit
def _gdn_gating_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, rows, heads, group, stride_at,
                       stride_ak, stride_ag, stride_bt, stride_bk, stride_bg, ROWS: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    h = tl.arange(0, BLOCK_H)
    kh, j = h // group, h % group  # value head h is entry j of key head kh's group
    mask = (r < rows)[:, None] & (h < heads)[None, :]
    a = tl.load(a_ptr + r[:, None] * stride_at + (kh * stride_ak + j * stride_ag)[None, :], mask=mask,
                other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r[:, None] * stride_bt + (kh * stride_bk + j * stride_bg)[None, :], mask=mask,
                other=0.0).to(tl.float32)
    x = a + tl.load(dt_bias_ptr + h, mask=h < heads, other=0.0).to(tl.float32)[None, :]
    # softplus as torch's (threshold 20): log1p(exp(x)), written so that neither branch overflows
    softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x))))
    decay = tl.exp(tl.load(a_log_ptr + h, mask=h < heads, other=0.0).to(tl.float32))
    out = r[:, None] * heads + h[None, :]
    tl.store(g_ptr + out, -decay[None, :] * softplus, mask=mask)
    tl.store(beta_ptr + out, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=mask)


def _grouped(t: torch.Tensor) -> torch.Tensor:
    """[T, Hv] as [T, 1, Hv]; [T, Hk, G] as it is (any strides)."""
    return t[:, None, :] if t.dim() == 2 else t


@register("gdn_gating", "triton")
def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/reference/gated_delta.py's gdn_gating: a, b [T, Hv] or [T, Hk, G] (Qwen3-Next's projection, grouped
    per key head), any strides: read in place, one launch."""
    a3, b3 = _grouped(a), _grouped(b)
    rows, heads = a3.shape[0], a3.shape[1] * a3.shape[2]
    if b3.shape != a3.shape or a_log.shape != (heads,) or dt_bias.shape != (heads,):
        raise ValueError(f"gdn_gating: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(a_log.shape)} and "
                         f"dt_bias {tuple(dt_bias.shape)} disagree")
    g = torch.empty(rows, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(rows, heads, dtype=b.dtype, device=b.device)
    if rows:
        _gdn_gating_kernel[(triton.cdiv(rows, _ROWS),)](a3, b3, a_log, dt_bias, g, beta, rows, heads, a3.shape[2],
                                                      *a3.stride(), *b3.stride(), ROWS=_ROWS,
                                                      BLOCK_H=triton.next_power_of_2(heads))
    return g, beta


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, heads, group, stride_x, stride_zt, stride_zk, n, eps,
                           ROUND_PRODUCT: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (token, value head)
    t, h = row // heads, row % heads
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    h32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h32 * h32, 0) / n + eps)
    normed = (h32 * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * normed
    if ROUND_PRODUCT:  # weight * h is a product of two 16-bit tensors in the reference: rounded to their dtype
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    z_row = z_ptr + t * stride_zt + (h // group) * stride_zk + (h % group) * n
    z = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (y * z * tl.sigmoid(z)).to(out_ptr.dtype.element_ty), mask=mask)


@register("gated_rms_norm", "triton")
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels/reference/norm.py's gated_rms_norm for x [T, H, D]: one program per (token, head). gate is [T, H, D]
    or [T, Hk, G * D] (Qwen3-Next's z, grouped per key head), its rows read in place."""
    if x.dim() != 3 or gate.dim() != 3 or gate.shape[0] != x.shape[0] or gate.numel() != x.numel():
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and gate {tuple(gate.shape)} disagree")
    tokens, heads, n = x.shape
    if weight.shape != (n,) or gate.shape[2] % n:
        raise ValueError(f"gated_rms_norm: weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    round_product = x.dtype != torch.float32 and torch.promote_types(weight.dtype, x.dtype) == x.dtype
    block = triton.next_power_of_2(n)
    if tokens * heads:
        _gated_rms_norm_kernel[(tokens * heads,)](x2, gate, weight, out, heads, gate.shape[2] // n, x2.stride(0),
                                                  gate.stride(0), gate.stride(1), n, eps,
                                                  ROUND_PRODUCT=round_product, BLOCK_N=block,
                                                  num_warps=min(8, max(1, block // 256)))
    return out
