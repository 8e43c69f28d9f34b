#!/usr/bin/env python
"""Offline throughput benchmark, like `vllm bench throughput`: random-token prompts through the LLM API.

    python tools/bench_offline.py --preset qwen3-0.6b --num-prompts 200 --input-len 512 --output-len 128
    python tools/bench_offline.py --model /path/to/model --load-format auto --range-ratio 0.5
    python tools/bench_offline.py --config-json my/config.json --set max_num_seqs=64

Any model shape: a model directory, a bare config.json (weights are then dummy), or a named preset whose
config is written inline below. EOS is ignored so every request produces exactly its output length.
Prints requests/s, output tokens/s and total tokens/s (and writes them as JSON with --output-json).
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
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or not 0 <= args.range_ratio < 1:
        p.error("num-prompts, input-len, output-len must be >= 1 and range-ratio in [0, 1)")
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
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(in_lens)
    result = {"elapsed_s": elapsed, "num_requests": len(outs), "input_tokens": n_in, "output_tokens": n_out,
              "requests_per_s": len(outs) / elapsed, "output_tokens_per_s": n_out / elapsed,
              "total_tokens_per_s": (n_in + n_out) / elapsed}
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.2f} total tokens/s, "
          f"{result['output_tokens_per_s']:.2f} output tokens/s ({len(outs)} requests, {n_in} input + {n_out} "
          f"output tokens in {elapsed:.2f} s)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    run()
