from __future__ import annotations

import torch

from appliance.kernels.registry import register


def cos_sin_cache(rot_dim: int, max_pos: int, base: float = 10000.0) -> torch.Tensor:
    """The unscaled cache the `rope` ops read, [max_pos, rot_dim] float32 rows of cat(cos, sin): random-input
    checks and labs (the models build theirs with scaling, layers/rotary.py)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot].float(), x[..., rot:]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # GPT-J style: interleaved pairs
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), x_pass), dim=-1)


@register("rope", "torch")
def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
         is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T,H,D] and k [T,Hkv,D]; cache rows are cat(cos, sin) over rot_dim/2 each."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)
