"""transformers' `layer_types`: which layers attend over a sliding window (Gemma 3, gpt-oss)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(cfg: PretrainedConfig) -> list[str]:
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != cfg.num_hidden_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types {types} must name {SLIDING!r} or {FULL!r} for each of the "
                         f"{cfg.num_hidden_layers} layers")
    return types
