"""Plain-torch MLA kernels (the oracle and the CPU path); see the package docstring for the contracts.

An fp8 latent cache (kernels/reference/kv_quant.py) holds latent / kv_scale saturated; `kv_scale` ([1] float32,
ones when not given) is the cache's one scale: the latent is one tensor (MQA in latent space)."""
from __future__ import annotations

import torch

from appliance.kernels.reference.kv_quant import kv_scale as checked_scale
from appliance.kernels.reference.kv_quant import quantize
from appliance.kernels.registry import register


@register("mla_store", "torch")
def mla_store(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
              kv_scale: torch.Tensor | None = None) -> None:
    scale = checked_scale(cache, kv_scale, "mla_store")
    keep = slot_mapping >= 0
    rows = cache.view(-1, cache.shape[-1])
    lat = latent[keep]
    rows[slot_mapping[keep]] = (quantize(lat[:, None], scale, cache.dtype)[:, 0] if scale is not None
                                else lat.to(cache.dtype))


def gather_latents(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                   kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The first `length` latent rows of one request: [length, R+dr] (float32 and dequantized when fp8)."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    lat = cache[block_table[:n_blocks].long()].reshape(-1, cache.shape[-1])[:length]
    scale = checked_scale(cache, kv_scale, "mla")
    return lat.float() * scale if scale is not None else lat


def _softmax_attend(scores: torch.Tensor, values: torch.Tensor, equation: str) -> torch.Tensor:
    return torch.einsum(equation, torch.softmax(scores, dim=-1), values)


@register("mla_decode", "torch")
def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, kv_lora_rank: int, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    for b, length in enumerate(seq_lens.tolist()):
        lat = gather_latents(cache, block_tables[b], length, kv_scale).float()  # [L, R+dr]
        scores = torch.einsum("hd,ld->hl", q[b].float(), lat) * scale
        out[b] = _softmax_attend(scores, lat[:, :kv_lora_rank], "hl,lr->hr").to(q.dtype)
    return out


@register("mla_prefill", "torch")
def mla_prefill(q: torch.Tensor, cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    heads, nope, rank = w_uk.shape
    out = q.new_empty(q.shape[0], heads, w_uv.shape[1])
    cu = cu_seqlens_q.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        lo, hi = cu[b], cu[b + 1]
        lat = gather_latents(cache, block_tables[b], length, kv_scale).float()
        kv_c, k_pe = lat[:, :rank], lat[:, rank:]
        k_nope = torch.einsum("lr,hdr->hld", kv_c, w_uk.float())
        v = torch.einsum("lr,hvr->hlv", kv_c, w_uv.float())
        qb = q[lo:hi].float()
        scores = (torch.einsum("qhd,hld->hql", qb[..., :nope], k_nope)
                  + torch.einsum("qhd,ld->hql", qb[..., nope:], k_pe)) * scale
        q_pos = torch.arange(length - (hi - lo), length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[lo:hi] = _softmax_attend(scores, v, "hql,hlv->qhv").to(q.dtype)
    return out
