"""Training LlamaForCausalLM on the token streams: bf16 autocast on CUDA, AdamW, warmup + cosine LR, residual
dropout, the best-validation checkpoint kept. Without --max-steps the step count comes from the time budget."""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def model_config(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads, "hidden_act": "silu", "max_position_embeddings": args.seq_len,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
    }


def add_residual_dropout(model: torch.nn.Module, p: float) -> None:
    """Dropout on each block's two residual branches (HF Llama has only attention dropout); training only,
    so the saved model is plain LlamaForCausalLM. The corpus is small and repeated, so this matters."""
    import torch

    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(output, p, module.training)

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(hook)
        layer.mlp.down_proj.register_forward_hook(hook)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    # A fixed warmup keeps the first steps identical whether or not the total is known yet (see --minutes).
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(model: torch.nn.Module, val: torch.Tensor, seq_len: int, batch: int, device: str,
             max_windows: int = 256) -> float:
    import torch

    n = min(max_windows, (len(val) - 1) // seq_len)
    windows = val[: n * seq_len + 1]
    x_all = windows[:-1].view(n, seq_len).long()
    y_all = windows[1:].view(n, seq_len).long()
    total = 0.0
    model.eval()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        for i in range(0, n, batch):
            x, y = x_all[i:i + batch].to(device), y_all[i:i + batch].to(device)
            logits = model(input_ids=x).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train()
    return total / (n * seq_len)


def train_model(args: argparse.Namespace, config: dict[str, Any], train_ids: torch.Tensor, val_ids: torch.Tensor,
                log: list[dict[str, Any]]) -> tuple[tuple[float, int, dict[str, torch.Tensor]], int, float]:
    """Returns ((best val loss, its step, its float32 state dict on the CPU), steps run, training seconds)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "dtype")})
    cfg.attention_dropout = args.dropout
    model = LlamaForCausalLM(cfg).to(args.device)
    add_residual_dropout(model, args.dropout)
    model.config._attn_implementation = "sdpa"
    fwd = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=args.device == "cuda")
    data = train_ids.to(args.device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    total = args.max_steps or 10**9
    budget = args.minutes * 60
    best = (float("inf"), -1, None)
    start = warm = time.time()
    step = 0
    while step < total:
        if args.max_steps is None and step == 10:
            warm = time.time()  # the first steps pay for CUDA initialisation and would inflate the estimate
        if args.max_steps is None and step == 40:
            per_step = (time.time() - warm) / 30
            epoch_cap = int(args.max_epochs * len(data) / (args.batch * args.seq_len))
            total = max(args.warmup + 40, min(int(budget / per_step * 0.93), epoch_cap))
            print(f"measured {per_step * 1000:.1f} ms/step; epoch cap {epoch_cap} steps -> total_steps={total} "
                  f"(pass --max-steps {total} to repeat)", flush=True)
        lr = lr_at(step, total, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=gen).to(args.device)
        idx = offsets[:, None] + torch.arange(args.seq_len + 1, device=args.device)[None, :]
        chunk = data[idx].long()
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            logits = fwd(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0 or step == total:
            val_loss = evaluate(model, val_ids, args.seq_len, args.batch, args.device)
            entry = {"step": step, "train_loss": round(loss.item(), 4), "val_loss": round(val_loss, 4),
                     "lr": lr, "elapsed_s": round(time.time() - start, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
            if val_loss < best[0]:
                best = (val_loss, step, {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()})
        if args.max_steps is None and time.time() - start > budget * 1.1:
            print(f"stopping at step {step}: over the time budget")
            break
    if best[2] is None:  # fewer steps than one evaluation interval
        best = (evaluate(model, val_ids, args.seq_len, args.batch, args.device), step,
                {k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    return best, step, time.time() - start
