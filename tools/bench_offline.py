#!/usr/bin/env python
"""Offline throughput benchmark, like `vllm bench throughput`: random-token prompts through the LLM API.

    python tools/bench_offline.py --preset qwen3-0.6b --num-prompts 200 --input-len 512 --output-len 128
    python tools/bench_offline.py --model /path/to/model --load-format auto --range-ratio 0.5
    python tools/bench_offline.py --config-json my/config.json --set max_num_seqs=64
    python tools/bench_offline.py --preset deepseek-v2-lite --input-len 1024 --output-len 1024 --batch1 128

Any model shape: a model directory, a bare config.json (weights are then dummy), or a named preset whose
config is written inline below. EOS is ignored so every request produces exactly its output length.
Prints requests/s, output tokens/s and total tokens/s (and writes them as JSON with --output-json).
--batch1 N then decodes N tokens of one request alone on the same engine: the mean decode step time against
the weight-read floor, i.e. the bytes of the weights one step reads (for MoE models at batch 1 only the top-k
experts of each layer; never the input embedding table, of which one row is read) over the device's copy
bandwidth.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "rope_theta": 1000000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # the published config.json shapes; both fit one 80 GB GPU in bf16 with dummy weights (Qwen3-30B-A3B: 57 GiB)
    "deepseek-v2-lite": {  # MLA + 64 routed experts (top-6) + 2 shared, one leading dense layer, ~16B
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": False, "scoring_func": "softmax", "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 100000, "eos_token_id": 100001,
    },
    "qwen3-30b-a3b": {  # GQA + 128 routed experts (top-8), ~30B (3B active)
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 48, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    },
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory (config.json + weights)")
    src.add_argument("--config-json", help="a config.json: the model shape, run with dummy weights")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model shape, dummy weights")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)] (0: fixed lengths)")
    p.add_argument("--load-format", default=None, help="default: auto for --model, dummy otherwise")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a flat config override (max_num_seqs=64, chunked_prefill_size=2048, device=cuda ...)")
    p.add_argument("--output-json", help="write the results here")
    p.add_argument("--batch1", type=int, default=0, metavar="N",
                   help="then decode N tokens of one request (input-len prompt) alone: step time vs the weight-read "
                        "floor (0: skip)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or not 0 <= args.range_ratio < 1:
        p.error("num-prompts, input-len, output-len must be >= 1 and range-ratio in [0, 1)")
    if args.batch1 < 0 or args.batch1 == 1:
        p.error("--batch1 needs at least 2 tokens (the first one comes from the prefill)")
    return args


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _model_dir(args: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    if args.model:
        return args.model, args.load_format or "auto"
    cfg = PRESETS[args.preset] if args.preset else json.loads(Path(args.config_json).read_text())
    (tmp / "config.json").write_text(json.dumps(cfg))
    if args.load_format not in (None, "dummy"):
        raise SystemExit("a preset or bare config.json has no weights: load_format must be dummy")
    return str(tmp), "dummy"


def _lengths(rng: random.Random, base: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def run(argv: list[str] | None = None) -> dict[str, float]:
    from appliance import LLM, SamplingParams

    args = parse_args(argv)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    with tempfile.TemporaryDirectory() as tmp:
        path, load_format = _model_dir(args, Path(tmp))
        llm = LLM(model=path, load_format=load_format, dtype=args.dtype, seed=args.seed, skip_tokenizer_init=True,
                  **{k: _value(v) for k, v in overrides.items()})
    vocab = int(llm.executor.hf_config.vocab_size)
    rng = random.Random(args.seed)
    in_lens = _lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
    out_lens = _lengths(rng, args.output_len, args.range_ratio, args.num_prompts)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in in_lens]
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=m, ignore_eos=True) for m in out_lens]
    steps_before = llm.engine.stats().num_steps
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    steps = llm.engine.stats().num_steps - steps_before
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(in_lens)
    result = {"elapsed_s": elapsed, "num_requests": len(outs), "input_tokens": n_in, "output_tokens": n_out,
              "requests_per_s": len(outs) / elapsed, "output_tokens_per_s": n_out / elapsed,
              "total_tokens_per_s": (n_in + n_out) / elapsed, "preemptions": llm.engine.scheduler.num_preemptions,
              "max_num_seqs": llm.engine.config.max_num_seqs, "num_blocks": llm.engine.config.num_blocks,
              "steps": steps}
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.2f} total tokens/s, "
          f"{result['output_tokens_per_s']:.2f} output tokens/s ({len(outs)} requests, {n_in} input + {n_out} "
          f"output tokens in {elapsed:.2f} s, {steps} steps; {result['preemptions']} preemptions, max_num_seqs "
          f"{result['max_num_seqs']}, {result['num_blocks']} KV blocks)")
    if args.output_json:  # written now too: the throughput survives a failure of the batch-1 run
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    if args.batch1:
        result.update(batch1(llm, prompts[0], args.batch1))
        print(f"Batch 1: {result['b1_step_ms']:.3f} ms per decode step; weight-read floor {result['floor_ms']:.3f} ms "
              f"({result['active_weight_GB']:.2f} GB read per step at {result['copy_GBps']:.0f} GB/s): "
              f"{result['b1_over_floor']:.2f}x the floor")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


def active_weight_bytes(model: Any) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter except an untied input embedding (one row
    is read) and, in each sparse MoE block, all but the top_k of its experts."""
    from appliance.layers.moe import SparseMoeBlock

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not getattr(model, "tie_word_embeddings", False):
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            experts = sum(p.numel() * p.element_size() for p in block.experts.parameters())
            num_local = block.experts.num_local
            total -= experts - experts * min(block.gate.cfg.top_k, num_local) // num_local
    mtp = getattr(model, "mtp", None)  # DeepSeek-V3's MTP layers are loaded, not run
    if mtp is not None:
        total -= sum(p.numel() * p.element_size() for p in mtp.parameters())
    return total


def copy_bandwidth(device: Any, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 10."""
    import statistics

    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def batch1(llm: Any, prompt: list[int], n: int) -> dict[str, float]:
    """Mean wall time of the decode steps of one request alone, and the floor the weight reads put under it."""
    from appliance import SamplingParams

    runner, engine = llm.executor.runner, llm.engine
    engine.add_request(f"batch1-{time.monotonic_ns()}", prompt,
                       SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True))
    times = []
    while engine.has_work():  # every step returns its sampled token to the host: a complete step each
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    step_s = sum(times[1:]) / max(1, len(times) - 1)  # the first step is the prefill
    active = active_weight_bytes(runner.model)
    bw = copy_bandwidth(runner.device)
    return {"b1_step_ms": step_s * 1e3, "active_weight_GB": active / 1e9, "copy_GBps": bw / 1e9,
            "floor_ms": active / bw * 1e3, "b1_over_floor": step_s / (active / bw)}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    run()
