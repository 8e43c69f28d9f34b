"""The sliding-window families on dummy weights: gpt-oss-20b and Gemma-3-12B (appliance/bench/presets.py shapes).

    python -m benchmarks.models                          # one H100: DEFAULT_MODELS, JSON lines to stdout
    python -m benchmarks.models --only gpt-oss-20b       # one model
    python -m benchmarks.models --only gpt-oss-20b --only gpt-oss-20b-mxfp4 --num-prompts 32 --output-len 128
                                                         # gpt-oss's experts dequantized, then kept in MXFP4
    python -m benchmarks.models --only gpt-oss-120b-mxfp4 --num-prompts 32 --output-len 128   # 120b, one GPU
    python -m benchmarks.models --only gemma-3-12b --enforce-eager   # the same without CUDA graphs
    python -m benchmarks.models --quick                  # tiny shapes of the same families on the CPU (a test)
    python -m benchmarks.models --write-configs DIR      # DIR/<model>/: config.json and workload.json, not run
                                                         # (the peer's input: benchmarks/peer_models.py)

Per model, through the offline runners of appliance/bench (EOS ignored: every request makes its output length):
- batch-1 decode: `bench latency` of one request, --b1-input prompt tokens and --b1-output tokens (mean TPOT);
- throughput: `bench throughput` of --num-prompts prompts, --input-len in / --output-len out (output tok/s);
- KV memory per sequence of --kv-context tokens: the blocks per sequence this run allocates in each KV cache group
  (engine/kv_groups.py: a sliding-window layer's group keeps the blocks of its window, at most
  ceil((W + block - 1) / block)) when its sliding layers have pools of their own (executor/window_groups.py: eager
  steps, decode graphs and piecewise graphs alike; speculative decoding, the host tier and recurrent state still
  keep one table for every layer, the whole context), the bytes, and their ratio to every layer keeping the whole
  context (`ratio`: the groups'; `allocated_ratio`: this run's).
- KV pools (`kv_pools`): each pool's blocks (the full group's, each sliding group's; or the one pool every group
  shares) and how many sequences of the throughput workload's length (in + out) it holds at once; the smallest
  bounds the batch the run can keep.
`gpt-oss-20b-mxfp4` is gpt-oss-20b with precision.moe_weight_format = mxfp4: dummy experts drawn as MXFP4 codes
and scales, run by the fused_moe_mxfp4 kernel (kernels/moe/triton_mxfp4.py); --quick leaves it out (on the CPU that
kernel needs Triton's interpreter). `gpt-oss-120b-mxfp4` (only when named) is gpt-oss-120b on one GPU that way.
Each model runs in its own process (a GPU engine's memory is only certainly back when its process ends).
--write-configs writes, for the same arguments, each model's directory with the exact prompts and limits of its
run (benchmarks/peer_models.py write_workload), so vLLM measures the same tokens; an MXFP4 row's config.json carries
the quantization_config gpt-oss checkpoints ship, vLLM's switch to its MXFP4 experts.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from appliance.bench import offline
from appliance.bench.presets import write_model_dir
from appliance.bench.workloads import Workload, random_workload
from appliance.engine.kv_groups import kv_groups
from benchmarks.peer_models import write_workload

MODELS = ("gpt-oss-20b", "gemma-3-12b", "gpt-oss-20b-mxfp4", "gpt-oss-120b-mxfp4")
# a measured name -> (its preset in appliance/bench/presets.py, the LLM settings that differ)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-oss-20b-mxfp4": ("gpt-oss-20b", {"moe_weight_format": "mxfp4"}),
    "gpt-oss-120b-mxfp4": ("gpt-oss-120b", {"moe_weight_format": "mxfp4"}),  # one GPU only this way
}
# the MXFP4 row last, so a run cut short by a time limit still has the earlier rows; the 120b runs when named
DEFAULT_MODELS = ("gpt-oss-20b", "gemma-3-12b", "gpt-oss-20b-mxfp4")
QUICK_MODELS = ("gpt-oss-20b", "gemma-3-12b")
# --quick: the same families at a size the CPU runs in seconds (two layers, one of each kind)
QUICK = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "query_pre_attn_scalar": 16,
         "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 4096,
         "torch_dtype": "float32", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


# config.json's quantization_config of the gpt-oss checkpoints as shipped: the peer keeps experts in MXFP4 by it
MXFP4_CHECKPOINT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def model_dir(name: str, out: Path, quick: bool) -> Path:
    path = write_model_dir(VARIANTS.get(name, (name, {}))[0], out)
    if quick:
        config = json.loads((path / "config.json").read_text())
        config.update({k: v for k, v in QUICK.items() if k in config})
        (path / "config.json").write_text(json.dumps(config))
    return path


def kv_per_sequence(runner: Any, context: int) -> dict[str, Any]:
    """Blocks and bytes of one sequence of `context` tokens: what this run allocates (its KV cache groups when the
    sliding-window layers have pools of their own, executor/window_groups.py; else one table for every layer)
    against what the groups hold (engine/kv_groups.py: a sliding group keeps the blocks of its window)."""
    bs = runner.block_size
    layers = runner.model.attention_layers()
    layer_block = runner.kv_spec.bytes_per_block / len(layers)  # one layer's K and V of one block
    blocks = -(-context // bs)
    groups = kv_groups([a.sliding_window for a in layers])
    held = {("full" if g.window is None else f"window_{g.window}"): {"layers": len(g.layers),
                                                                     "blocks": g.blocks_held(context, bs)}
            for g in groups}
    grouped = bool(runner.kv_layout.groups)
    every_layer = blocks * len(layers) * layer_block
    windowed = sum(h["layers"] * h["blocks"] for h in held.values()) * layer_block
    allocated = windowed if grouped else every_layer
    return {"context": context, "block_size": bs, "kv_groups": grouped,
            "blocks_per_sequence": ({k: h["blocks"] for k, h in held.items()} if grouped else {"all": blocks}),
            "group_blocks": held, "allocated_gib": allocated / 2**30, "window_share_gib": windowed / 2**30,
            "ratio": windowed / every_layer, "allocated_ratio": allocated / every_layer,
            "sliding_layers": sum(a.sliding_window is not None for a in layers), "layers": len(layers)}


def pool_capacity(runner: Any, tokens: int) -> dict[str, Any]:
    """Each KV pool's blocks and how many sequences of `tokens` tokens it holds at once (a sliding pool: each at
    most its window's blocks, engine/kv_groups.py; its null block left out): the smallest bounds the batch."""
    bs, layout = runner.block_size, runner.kv_layout
    need = -(-tokens // bs)
    if layout.shared:  # one pool: a sequence holds its blocks in every group (executor/window_groups.py)
        per_seq = need + sum(g.blocks_held(tokens, bs) for g in layout.groups)
        pools = {"shared": {"blocks": layout.num_blocks, "groups": 1 + len(layout.groups),
                            "sequences": (layout.num_blocks - 1) // per_seq}}
        return {"tokens": tokens, "pools": pools, "sequences": pools["shared"]["sequences"]}
    pools = {"full": {"blocks": layout.num_blocks, "sequences": layout.num_blocks // need}}
    for g, n in zip(layout.groups, layout.window_blocks):
        pools[f"window_{g.window}"] = {"blocks": n, "sequences": (n - 1) // g.blocks_held(tokens, bs)}
    return {"tokens": tokens, "pools": pools, "sequences": min(p["sequences"] for p in pools.values())}


def workloads(args: argparse.Namespace, vocab: int) -> tuple[Workload, Workload]:
    """The batch-1 prompts (one warm-up, one timed) and the throughput workload of a model's run."""
    one = random_workload(vocab, 2, (args.b1_input,) * 2, (args.b1_output,) * 2, seed=1)
    work = random_workload(vocab, args.num_prompts, (args.input_len,) * 2, (args.output_len,) * 2, seed=2)
    return one, work


def write_configs(names: list[str], args: argparse.Namespace, out: Path) -> list[Path]:
    """out/<name>/: the config.json ours loads and workload.json, the run's prompts and limits (for the peer)."""
    dirs = []
    for order, name in enumerate(names):
        path = model_dir(name, out / name, args.quick)
        config = json.loads((path / "config.json").read_text())
        if VARIANTS.get(name, (name, {}))[1].get("moe_weight_format") == "mxfp4":
            config["quantization_config"] = MXFP4_CHECKPOINT
            (path / "config.json").write_text(json.dumps(config, indent=1))
        one, work = workloads(args, config["vocab_size"])
        write_workload(path, {
            "kind": "models", "model": name, "order": order, "kv_context": args.kv_context,
            "engine": {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                       "enforce_eager": args.enforce_eager},
            "batch1": {"prompts": one.prompts, "output_len": args.b1_output},
            "throughput": {"prompts": work.prompts, "output_lens": work.output_lens, "input_len": args.input_len,
                           "output_len": args.output_len}})
        dirs.append(path)
    return dirs


def measure(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from appliance import LLM

    path = model_dir(name, workdir / name, args.quick)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    settings = VARIANTS.get(name, (name, {}))[1]
    llm = LLM(model=str(path), load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, **settings,
              **({"device": "cpu", "dtype": "float32"} if args.quick else {}))
    runner = llm.executor.runner
    out: dict[str, Any] = {"model": name, "settings": settings, "backend": runner.backend,
                           "device": str(runner.device),
                           "cuda_graphs": runner.graphs is not None,
                           "kv_per_sequence": kv_per_sequence(runner, args.kv_context),
                           "kv_pools": pool_capacity(runner, args.input_len + args.output_len)}
    offline.capture_graphs(llm, args.b1_input + args.b1_output)
    one, work = workloads(args, vocab)
    b1 = offline.latency(llm, one, batch_size=1, num_iters=1, num_iters_warmup=1, temperature=0.0)
    out["batch1_decode_ms_per_token"] = b1["mean_tpot_ms"]
    offline.warm_up(llm, work, 0.0)
    tput = offline.throughput(llm, work, temperature=0.0)
    out["throughput"] = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                         "seconds": tput["duration"], "output_tok_s": tput["output_throughput"],
                         "preemptions": tput["preemptions"]}
    llm.shutdown()
    del llm, runner
    gc.collect()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=MODELS, action="append",
                   help=f"a model (repeatable); default: {', '.join(DEFAULT_MODELS)}")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--b1-input", type=int, default=1024)
    p.add_argument("--b1-output", type=int, default=256)
    p.add_argument("--kv-context", type=int, default=32768)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (the sliding-window layers keep only their window either way)")
    p.add_argument("--write-configs", type=Path, metavar="DIR",
                   help="write each model's config.json and workload.json under DIR (the peer's input) and stop")
    args = p.parse_args(argv)
    if args.quick:  # sizes the CPU runs in seconds
        args.num_prompts, args.input_len, args.output_len = 4, 24, 8
        args.b1_input, args.b1_output, args.kv_context, args.max_model_len, args.max_num_seqs = 24, 8, 64, 128, 8
    return args


def without_only(argv: list[str]) -> list[str]:
    """argv less its `--only NAME` / `--only=NAME` choices (each child process is given one of its own)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip or arg.startswith("--only="):
            skip = False
            continue
        skip = arg == "--only"
        if not skip:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    names = args.only or list(QUICK_MODELS if args.quick else DEFAULT_MODELS)
    if args.write_configs is not None:
        for path in write_configs(names, args, args.write_configs):
            print(path)
        return []
    if len(names) > 1 and not args.quick:
        # one process per model: a GPU engine's memory is only certainly back when its process ends
        rest = without_only(sys.argv[1:] if argv is None else argv)
        for name in names:
            subprocess.run([sys.executable, "-m", "benchmarks.models", *rest, "--only", name], check=True)
        return []
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        for name in names:
            results.append(measure(name, args, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    return results


if __name__ == "__main__":
    main()
