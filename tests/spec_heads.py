"""Small random draft checkpoints for the speculative-decoding tests: an EAGLE-3 head and an EAGLE head in the
layouts people publish (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, the speculators format's `layers.0.*`), for the tiny
Llama of conftest (hidden 64, 4 heads, 2 KV heads, vocabulary TINY_VOCAB), with the EAGLE-3 head written out as the
reference its drafts are checked against; and the MTP layer DeepSeek-V3 and GLM-4 MoE checkpoints ship, appended to
a target's tensors."""
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


# ---- the EAGLE-3 head written out (the reference of its drafts) ------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


class Eagle3Reference:
    """The EAGLE-3 head written from its published description, over a whole sequence at once: row i takes
    embed(token i + 1) and fc(captured states at i) (or the previous row's pre-norm output in the chain); one
    decoder layer whose attention reads [input_norm(embeds), hidden_norm(hidden)]; logits over the draft
    vocabulary, mapped to target ids by d2t."""

    def __init__(self, head_dir: Path, target_dir: Path) -> None:
        from safetensors.torch import load_file

        self.w = load_file(str(head_dir / "model.safetensors"))
        self.embed = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # (embeds, hidden) per row so far

    def step(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append rows (one token and hidden state each, at the next positions); returns (draft ids, pre-norm)
        of the new rows."""
        w, p = self.w, "midlayer."
        e = self.embed[torch.tensor(tokens)]
        self.rows += list(zip(e, hidden))
        embeds, hid = torch.stack([r[0] for r in self.rows]), torch.stack([r[1] for r in self.rows])
        x = torch.cat([_rms(embeds, w[p + "input_layernorm.weight"]), _rms(hid, w[p + "hidden_norm.weight"])], -1)
        n, d = x.shape[0], 16
        pos = torch.arange(n)
        q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, 4, d), pos)
        k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, 2, d), pos).repeat_interleave(2, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, 2, d).repeat_interleave(2, 1)
        att = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                               v.transpose(0, 1), is_causal=True)
        r1 = att.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T + hid
        y = _rms(r1, w[p + "post_attention_layernorm.weight"])
        m = (torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
             ) @ w[p + "mlp.down_proj.weight"].T
        pre = (m + r1)[-len(tokens):]
        self.logits = _rms(pre, w["norm.weight"]) @ w["lm_head.weight"].T  # the new rows' (draft vocabulary)
        draft = self.logits.argmax(-1)
        return draft + w["d2t"][draft], pre


def captured_states(target_dir: Path, tokens: list[int], layers: list[int]) -> torch.Tensor:
    """The target's decoder-layer outputs (residual stream) at `layers`, side by side, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    outs: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda mod, args, out, i=i: outs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in set(layers)]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.cat([outs[i].reshape(len(tokens), -1) for i in layers], -1)
