"""The MoE presets (appliance/bench/presets.py) are the published shapes, and the weight-read floor
(appliance/bench/floor.py) counts only the weights a decode step reads (top-k experts, no embedding table). The
whole benchmarks/moe.sh is dry-run with `bash benchmarks/moe.sh --smoke` (tiny shapes, CPU, ~1 minute)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.executor.memory_check import build_on_meta
from appliance.models.registry import model_class

from appliance.bench.floor import active_weight_bytes
from appliance.bench.presets import SHAPES


def _meta_model(cfg: dict[str, Any], tmp_path: Path) -> torch.nn.Module:
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(str(tmp_path))
    return build_on_meta(model_class(hf), hf, torch.bfloat16, {"backend": "torch", "moe_backend": "torch"})


# published totals: DeepSeek-V2-Lite 15.7B parameters (2.4B active), Qwen3-30B-A3B 30.5B (3.3B active, embeddings in)
@pytest.mark.parametrize("name, total_b, active_b", [("deepseek-v2-lite", 15.7, 2.45), ("qwen3-30b-a3b", 30.5, 3.35)])
def test_moe_presets_are_the_published_shapes(tmp_path: Path, name: str, total_b: float,
                                              active_b: float) -> None:
    model = _meta_model(SHAPES[name], tmp_path)
    total = sum(p.numel() for p in model.parameters()) / 1e9
    emb = model.model.embed_tokens.weight.numel() / 1e9
    active = active_weight_bytes(model) / 2 / 1e9  # bf16: 2 bytes a parameter
    assert abs(total - total_b) < 0.1, total
    # V2-Lite's 2.4B is without the input embedding; Qwen's 3.3B with it
    assert abs(active + (emb if name == "qwen3-30b-a3b" else 0.0) - active_b) < 0.1, active


def test_active_weights_count_top_k_experts_only(tmp_path: Path) -> None:
    cfg = dict(SHAPES["qwen3-30b-a3b"], num_hidden_layers=2, hidden_size=128, moe_intermediate_size=64,
               num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               vocab_size=1000)
    model = _meta_model(cfg, tmp_path)
    every = sum(p.numel() * 2 for p in model.parameters())
    experts = sum(p.numel() * 2 for n, p in model.named_parameters() if ".experts." in n)
    emb = model.model.embed_tokens.weight.numel() * 2
    assert active_weight_bytes(model) == every - emb - experts * 6 // 8

