"""Benchmarks of the newer model families on dummy weights (published config shapes, random values).

    python -m benchmarks.models                      # on one H100: every measurement below, JSON to stdout
    python -m benchmarks.models --only gpt-oss-20b   # one model
    python -m benchmarks.models --quick              # tiny shapes on the CPU (the test runs this)

Measured per model, through the offline API with EOS ignored (every request makes exactly its output length):
- batch-1 decode: one request of `--b1-input` prompt tokens decoding `--b1-output` tokens; the mean time per
  output token after the first (ms/token);
- throughput: `--num-prompts` random prompts of `--input-len` tokens, `--output-len` tokens each (output tok/s);
- KV memory per sequence at `--kv-context` tokens: what this build allocates (blocks x bytes per block, every
  layer keeping the whole context) against the sliding-window share (local layers holding only their window),
  for the families with sliding windows.
Each model gets a fresh engine (`LLM`), which frees its memory before the next one.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

YARN_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
GEMMA_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}


def _alternating(n: int, every: int) -> list[str]:
    """`every`-th layer full, the others sliding (gpt-oss: 2, Gemma 3: 6)."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]


# name -> (transformers config class, its kwargs): the published config.json shapes
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-oss-20b": ("GptOssConfig", {
        "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 131072,
        "layer_types": _alternating(24, 2), "rope_parameters": YARN_OSS, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "dtype": "bfloat16", "eos_token_id": 200002, "pad_token_id": 199999}),
    "gemma-3-12b": ("Gemma3TextConfig", {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "query_pre_attn_scalar": 256, "sliding_window": 1024, "max_position_embeddings": 131072,
        "layer_types": _alternating(48, 6), "rope_parameters": GEMMA_ROPE, "tie_word_embeddings": True,
        "dtype": "bfloat16", "eos_token_id": 1, "pad_token_id": 0}),
}
# --quick: the same families at a size the CPU runs in seconds
QUICK = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "query_pre_attn_scalar": 16,
         "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "layer_types": _alternating(2, 2),
         "dtype": "float32", "eos_token_id": 1, "pad_token_id": 0, "max_position_embeddings": 4096}


def write_config(name: str, out: Path, quick: bool) -> Path:
    import transformers

    cls, kwargs = MODELS[name]
    kwargs = {**kwargs, **{k: v for k, v in QUICK.items() if k in kwargs or k == "dtype"}} if quick else kwargs
    config = getattr(transformers, cls)(**kwargs)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    return out


def kv_per_sequence(runner: Any, context: int) -> dict[str, Any]:
    """Bytes this build allocates for one sequence of `context` tokens, and the sliding-window share."""
    spec, bs = runner.kv_spec, runner.block_size
    allocated = -(-context // bs) * spec.bytes_per_block
    layers = runner.model.attention_layers()
    per_layer = allocated / len(layers)
    windowed = sum(per_layer if a.sliding_window is None else per_layer * min(1.0, a.sliding_window / context)
                   for a in layers)
    return {"context": context, "allocated_gib": allocated / 2**30, "window_share_gib": windowed / 2**30,
            "ratio": windowed / allocated, "sliding_layers": sum(a.sliding_window is not None for a in layers),
            "layers": len(layers)}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(length)]} for _ in range(n)]


def measure(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from appliance import LLM, SamplingParams

    path = write_config(name, workdir / name, args.quick)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    llm = LLM(model=str(path), load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, **({"device": "cpu", "dtype": "float32"} if args.quick else {}))
    runner = llm.executor.runner
    out: dict[str, Any] = {"model": name, "backend": runner.backend, "device": str(runner.device)}
    out["kv_per_sequence"] = kv_per_sequence(runner, args.kv_context)

    one = SamplingParams(temperature=0.0, max_tokens=args.b1_output, ignore_eos=True)
    llm.generate(_prompts(1, args.b1_input, vocab, 0), SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(_prompts(1, args.b1_input, vocab, 1), first)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(_prompts(1, args.b1_input, vocab, 1), one)
    total_s = time.perf_counter() - t0
    out["batch1_decode_ms_per_token"] = 1000 * max(total_s - prefill_s, 0.0) / max(args.b1_output - 1, 1)

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(_prompts(args.num_prompts, args.input_len, vocab, 2), params)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    out["throughput"] = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                         "seconds": elapsed, "output_tok_s": produced / elapsed}
    del llm, runner
    gc.collect()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=sorted(MODELS), action="append", help="a model (repeatable); default: all")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--b1-input", type=int, default=1024)
    p.add_argument("--b1-output", type=int, default=256)
    p.add_argument("--kv-context", type=int, default=32768)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--max-num-seqs", type=int, default=256)
    args = p.parse_args(argv)
    if args.quick:  # sizes the CPU runs in seconds
        args.num_prompts, args.input_len, args.output_len = 4, 24, 8
        args.b1_input, args.b1_output, args.kv_context, args.max_model_len, args.max_num_seqs = 24, 8, 64, 128, 8
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        for name in args.only or list(MODELS):
            results.append(measure(name, args, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    return results


if __name__ == "__main__":
    main()
