"""Count what a hybrid model's prefix-hit turn launches, on the CPU: the second turn of a multi-turn session (its
state snapshot restored, the tokens after the checkpoint prefilled, one token sampled), as
`python -m benchmarks.hybrid --multi-turn-only` times it on a GPU. Torch ops (aten calls that compute) and Triton
launches under the interpreter (and reshapes that copy), per part: the whole engine step, the forward, one linear-attention decoder layer
(its Gated DeltaNet mixer and its MoE apart) and one full-attention layer. The gated delta rule itself counts as
one call ("fla.chunk_gated_delta_rule"): on a GPU fla-core runs it, here the torch reference stands in.

    python -m tools.hybrid_turn_ops                 # turn of 640 tokens, checkpoints every 64 (128 computed)
    python -m tools.hybrid_turn_ops --json

A prefill step of a few thousand tokens on this shape spends more host time issuing ops than device time running
them (docs/kernels.md "Hybrid models"), so the counts stand for the host's share; they do not depend on the size.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's first import; this process is the tool's

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tools.step_ops import Counts, counting

# a tiny Qwen3-Next: 8 layers (every 4th full attention), 8 experts top-2, a shared expert
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32}


def model_dir(out: Path, layers: int = 8) -> Path:
    from transformers import Qwen3NextConfig

    from appliance.bench.presets import write_word_tokenizer

    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    cfg = Qwen3NextConfig(num_hidden_layers=layers, layer_types=kinds, architectures=["Qwen3NextForCausalLM"],
                          bos_token_id=0, eos_token_id=1, max_position_embeddings=32768, **TINY)
    cfg.save_pretrained(str(out))
    write_word_tokenizer(out, cfg.vocab_size, 0, 1)
    return out


class _ReshapeCopies(TorchDispatchMode):
    """A reshape that cannot view its input copies it (one launch), which step_ops' counter, taking every reshape
    for a view, leaves out: counted here as "aten.reshape(copy)"."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (func.overloadpacket.__name__ == "reshape" and self.counts.on and not self.counts.in_triton
                and out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()):
            self.counts.ops["aten.reshape(copy)"] += 1
        return out


def _watch(module: torch.nn.Module, counts: Counts, step: Counts) -> None:
    module.register_forward_pre_hook(lambda *_: setattr(counts, "on", step.on))
    module.register_forward_hook(lambda *_: setattr(counts, "on", False))


def _opaque(layer: Any, parts: dict[str, Counts]) -> None:
    """The layer's gated delta rule counts as one call, its insides (the CPU's stand-in) not at all."""
    inner: Callable[..., torch.Tensor] = layer._prefill

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        for c in parts.values():
            if c.on:
                c.ops["fla.chunk_gated_delta_rule"] += 1
            c.in_triton += 1
        try:
            return inner(*args, **kwargs)
        finally:
            for c in parts.values():
                c.in_triton -= 1

    layer._prefill = call


def measure(turn_len: int, interval: int, workdir: Path) -> dict[str, Any]:
    from appliance import LLM, SamplingParams

    llm = LLM(model=str(model_dir(workdir / "qwen3-next")), load_format="dummy", device="cpu", dtype="float32",
              attention_backend="triton", max_model_len=turn_len + 1, max_num_seqs=4, block_size=16,
              enable_prefix_caching=True, ssm_checkpoint_interval=interval)
    model = llm.executor.runner.model.model
    names = ("step", "forward", "linear_layer", "gated_delta_net", "moe", "full_layer")
    parts = {n: Counts() for n in names}
    linear = [m for m in model.layers if m.kind == "linear_attention"]
    full = next(m for m in model.layers if m.kind != "linear_attention")
    for module, name in ((model, "forward"), (linear[1], "linear_layer"), (linear[1].linear_attn, "gated_delta_net"),
                         (linear[1].mlp, "moe"), (full, "full_layer")):
        _watch(module, parts[name], parts["step"])
    for layer in linear:
        _opaque(layer.linear_attn, parts)
    first = [3 + (7 * j) % 500 for j in range(int(turn_len * 0.9) - 16)]
    answer = llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0.0, max_tokens=16,
                                                                       ignore_eos=True))[0].outputs[0].token_ids
    second = first + list(answer) + [3 + (11 * j) % 500 for j in range(turn_len - len(first) - len(answer))]
    hits = llm.engine.stats().prefix_hit_tokens
    entered = [m for c in parts.values() for m in (counting(c), _ReshapeCopies(c))]
    for c in entered:
        c.__enter__()
    parts["step"].on = True
    try:
        llm.generate([{"prompt_token_ids": second}], SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        parts["step"].on = False
        for c in reversed(entered):
            c.__exit__(None, None, None)
    computed = turn_len - (llm.engine.stats().prefix_hit_tokens - hits)
    llm.shutdown()
    return {"turn_len": turn_len, "interval": interval, "computed": computed,
            **{n: {"total": c.total(), "ops": dict(sorted(c.ops.items()))} for n, c in parts.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turn-len", type=int, default=640)
    p.add_argument("--interval", type=int, default=64, help="cache.ssm_checkpoint_interval")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        row = measure(args.turn_len, args.interval, Path(tmp))
    if args.json:
        print(json.dumps(row))
        return row
    print(f"second turn of {row['turn_len']} tokens, {row['computed']} computed after the restored checkpoint:")
    for name in ("step", "forward", "linear_layer", "gated_delta_net", "moe", "full_layer"):
        ops = ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in row[name]["ops"].items())
        print(f"  {name}: {row[name]['total']}  ({ops})")
    return row


if __name__ == "__main__":
    main()
