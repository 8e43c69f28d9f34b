"""Paged KV store and attention over a paged KV cache, in plain torch.

Caches are [num_blocks, block_size, num_kv_heads, head_dim]; a request's tokens live in the blocks its block
table names, token t in block_table[t // block_size] at offset t % block_size. An fp8 cache holds x / scale
saturated (kv_quant.py); `k_scale` / `v_scale` ([Hkv] float32) are its per-head scales, ones when not given.

Two optional arguments serve gpt-oss and Gemma 3 (None: plain causal attention):
- `sliding_window` W: a query at position p sees keys at positions > p - W (the last W tokens, itself included),
  as transformers' sliding-window mask does;
- `sinks` [H] float: a learned logit per query head that joins each row's softmax and is then dropped (its
  probability mass goes nowhere), gpt-oss's attention sinks.
"""
from __future__ import annotations

import torch

from appliance.kernels.reference.kv_quant import dequantize, kv_scale, quantize
from appliance.kernels.registry import register


def _stored(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return quantize(x, scale, cache.dtype) if scale is not None else x.to(cache.dtype)


@register("store_kv", "torch")
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    k_scale, v_scale = kv_scale(k_cache, k_scale, "store_kv"), kv_scale(v_cache, v_scale, "store_kv")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = _stored(key[keep], k_cache, k_scale)
    v_cache[blocks, offsets] = _stored(value[keep], v_cache, v_scale)


def attention_out(op: str, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The tensor an attention op writes: `out` when the caller gives one (rows of a larger output, so a mixed
    step's decode and prefill rows need no copy), checked against q, else a new one like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"{op}: out {tuple(out.shape)} {out.dtype} does not fit q {tuple(q.shape)} {q.dtype} "
                         "(same shape, dtype and device, head_dim contiguous)")
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int,
            scale: torch.Tensor | None) -> torch.Tensor:
    """The first `length` tokens of one request: [length, Hkv, D], float32 (dequantized when fp8)."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return dequantize(cache[block_table[:n_blocks].long()].flatten(0, 1)[:length], scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
            sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Tq,H,D] at positions q_pos; k, v [Tk,Hkv,D] at positions 0..Tk-1; causal; float32 math."""
    h, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    hidden = k_pos[None, None, :] > q_pos[None, :, None]
    if sliding_window is not None:
        hidden = hidden | (k_pos[None, None, :] <= q_pos[None, :, None] - sliding_window)
    scores.masked_fill_(hidden, float("-inf"))
    if sinks is not None:  # one more logit per row, dropped after the softmax
        sink = sinks.float()[:, None, None].expand(h, scores.shape[1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


@register("decode_attention", "torch")
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, order: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None, fresh_rows: int = 1) -> torch.Tensor:
    """`order`: the order a kernel may take the rows in, `fresh_rows`: how many newest cache rows of each row
    this step's kernels wrote (when a kernel may read the others; scheduling hints, results never depend on
    them). `out`:
    where to write (attention_out). `sliding_window`, `sinks`: see the module docstring."""
    out = attention_out("decode_attention", q, out)
    k_scale, v_scale = kv_scale(k_cache, k_scale, "decode_attention"), kv_scale(v_cache, v_scale, "decode_attention")
    for b, length in enumerate(seq_lens.tolist()):
        k = _gather(k_cache, block_tables[b], length, k_scale)
        v = _gather(v_cache, block_tables[b], length, v_scale)
        pos = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, pos, scale, sliding_window, sinks)[0]
    return out


@register("prefill_attention", "torch")
def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = attention_out("prefill_attention", q, out)
    k_scale, v_scale = kv_scale(k_cache, k_scale, "prefill_attention"), kv_scale(v_cache, v_scale, "prefill_attention")
    cu = cu_seqlens_q.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        k = _gather(k_cache, block_tables[b], length, k_scale)
        v = _gather(v_cache, block_tables[b], length, v_scale)
        pos = torch.arange(length - (end - start), length, device=q.device)
        out[start:end] = _attend(q[start:end], k, v, pos, scale, sliding_window, sinks)
    return out
