"""Small random draft checkpoints for the speculative-decoding tests: an EAGLE-3 head and an EAGLE head in the
layouts people publish (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, the speculators format's `layers.0.*`), for the tiny
Llama of conftest (hidden 64, 4 heads, 2 KV heads, vocabulary TINY_VOCAB); and the MTP layer DeepSeek-V3 and GLM-4
MoE checkpoints ship, appended to a target's tensors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

HIDDEN, HEADS, KV_HEADS, INTER = 64, 4, 2, 128


def _layer(prefix: str, gen: torch.Generator, qkv_in: int) -> dict[str, torch.Tensor]:
    d = HIDDEN // HEADS
    w = lambda *shape: 0.1 * torch.randn(*shape, generator=gen)
    return {f"{prefix}self_attn.q_proj.weight": w(HEADS * d, qkv_in),
            f"{prefix}self_attn.k_proj.weight": w(KV_HEADS * d, qkv_in),
            f"{prefix}self_attn.v_proj.weight": w(KV_HEADS * d, qkv_in),
            f"{prefix}self_attn.o_proj.weight": w(HIDDEN, HEADS * d),
            f"{prefix}mlp.gate_proj.weight": w(INTER, HIDDEN), f"{prefix}mlp.up_proj.weight": w(INTER, HIDDEN),
            f"{prefix}mlp.down_proj.weight": w(HIDDEN, INTER),
            f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=gen)}


def _config(arch: str, vocab: int, **extra: Any) -> dict[str, Any]:
    return {"architectures": [arch], "model_type": "llama", "hidden_size": HIDDEN, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "intermediate_size": INTER, "num_hidden_layers": 1,
            "vocab_size": vocab, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 10000.0,
            "hidden_act": "silu", "torch_dtype": "float32", **extra}


def build_eagle3_head(out: Path, vocab: int, draft_vocab: int, seed: int = 0, layout: str = "midlayer",
                      with_embedding: bool = False) -> Path:
    """An EAGLE-3 head: fc over three captured target states, one 2x-wide-input decoder layer, norm, lm_head of
    draft_vocab tokens and d2t / t2d (draft ids map to every third target id, offset by one)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    prefix = "midlayer." if layout == "midlayer" else "layers.0."
    t = _layer(prefix, gen, 2 * HIDDEN)
    t[f"{prefix}input_layernorm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    t[f"{prefix}hidden_norm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    t["fc.weight"] = 0.1 * torch.randn(HIDDEN, 3 * HIDDEN, generator=gen)
    t["norm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    t["lm_head.weight"] = 0.3 * torch.randn(draft_vocab, HIDDEN, generator=gen)
    targets = (torch.arange(draft_vocab) * 3 + 1) % vocab
    t["d2t"] = targets - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    t["t2d"] = t2d
    if with_embedding:
        t["embed_tokens.weight"] = 0.1 * torch.randn(vocab, HIDDEN, generator=gen)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config("LlamaForCausalLMEagle3", vocab, draft_vocab_size=draft_vocab)))
    return out


def build_eagle_head(out: Path, vocab: int, seed: int = 0) -> Path:
    """An EAGLE (EAGLE-1) head: fc [H, 2H] with bias over [embeds, hidden], one decoder layer without its input
    norm; no embedding and no LM head (the target's)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    t = _layer("layers.0.", gen, HIDDEN)
    t["fc.weight"] = 0.1 * torch.randn(HIDDEN, 2 * HIDDEN, generator=gen)
    t["fc.bias"] = 0.1 * torch.randn(HIDDEN, generator=gen)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config("LlamaForCausalLMEagle", vocab)))
    return out


def append_mtp_layer(tensors: dict[str, torch.Tensor], num_layers: int, hidden: int, gen: torch.Generator) -> None:
    """One MTP layer stored as layer `num_layers`, as DeepSeek ships it (transformers' save drops MTP weights): the
    last decoder layer perturbed, its enorm / hnorm / eh_proj, and a shared head with the target's LM head and
    embedding."""
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            tensors[name.replace(last, mtp)] = t + 0.05 * torch.randn(t.shape, generator=gen)
    head = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
            "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=gen),
            "shared_head.norm.weight": torch.ones(hidden), "shared_head.head.weight": tensors["lm_head.weight"],
            "embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    tensors.update({mtp + k: v.clone() for k, v in head.items()})
