"""Qwen3-Next-80B-A3B's shape, reduced in depth, with dummy weights, through the offline LLM on one GPU: batch-1
decode, throughput at 256 requests x 1024 in / 1024 out, and the time to first token of multi-turn requests
whose prompt shares 90% with an earlier one, with and without recurrent-state snapshots (prefix caching of a
hybrid model needs them; without, the prefix is recomputed): each second turn is the first turn's prompt and
answer plus 10% new tokens. Prints one JSON record per measurement.

    python -m benchmarks.hybrid                 # one GPU: 8 layers (6 Gated DeltaNet + 2 full attention)
    python -m benchmarks.hybrid --layers 4
    python -m benchmarks.hybrid --multi-turn-only   # the two multi-turn records alone
    python -m benchmarks.hybrid --multi-turn-only --profile DIR   # and one more second turn per phase profiled
    python -m benchmarks.hybrid --quick         # CPU: tiny dims, short lengths (tests/test_bench_hybrid.py)
    python -m benchmarks.hybrid --write-configs DIR   # DIR/qwen3-next/: config.json and workload.json, not run
                                                      # (the peer's input: benchmarks/peer_models.py)

Multi-turn TTFT: the sessions run one after another, each alone on the engine, as the turns of separate users
would; a second turn's TTFT is from its submission to its first token's arrival from an engine step
(appliance/bench/offline.py run_batch: admission, the snapshot restore, the prefill and the sample). Both phases
first run one untimed warm-up session of the same lengths (its own tokens), so every shape the timed turns meet
(the first turn's chunks, the restored prefill, its decode-graph widths) is compiled, autotuned and captured
before any turn is timed. Each record has the mean, the median and every session's TTFT, the engine steps
and the tokens computed from submission to the first token (per session, mean). --profile DIR runs one more
session per phase after the timed ones (its own tokens, untimed) and records its second turn with torch.profiler:
where a turn's time goes, host and device, op by op.

Shape: transformers' Qwen3NextConfig defaults (hidden 2048, 512 experts of 512, 10 active + a shared expert, 16 q
/ 2 kv heads of 256 for full attention, 16 key / 32 value heads of 128 for the linear attention, every 4th layer
full attention), num_hidden_layers from --layers. On a GPU the gated delta rule runs flash-linear-attention's
Triton kernels where fla-core is installed (`pip install fla-core einops`, the `hybrid` extra), else the torch
reference (kernels/reference/gated_delta.py); decode replays CUDA graphs. Each record names both
(`gated_delta`, `decode_graphs`). --write-configs writes the model directory with the exact prompts of the same
arguments (benchmarks/peer_models.py write_workload), so vLLM measures the same tokens.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.bench.presets import write_word_tokenizer
from appliance.bench.workloads import Workload, random_workload
from benchmarks.peer_models import write_workload

MODEL = "qwen3-next"

QUICK_DIMS: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "linear_key_head_dim": 16,
                              "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "shared_expert_intermediate_size": 32}


def write_model_dir(out: Path, layers: int, quick: bool) -> Path:
    from transformers import Qwen3NextConfig

    dims = QUICK_DIMS if quick else {}
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    cfg = Qwen3NextConfig(num_hidden_layers=layers, layer_types=kinds, architectures=["Qwen3NextForCausalLM"],
                          bos_token_id=0, eos_token_id=1, max_position_embeddings=32768, **dims)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out))
    write_word_tokenizer(out, cfg.vocab_size, 0, 1)
    return out


def make_llm(model_dir: Path, args: argparse.Namespace, snapshots: bool) -> Any:
    from appliance import LLM

    extra: dict[str, Any] = {"device": "cpu", "dtype": "float32"} if args.quick else {"dtype": "bfloat16"}
    if snapshots:
        extra.update(enable_prefix_caching=True, ssm_checkpoint_interval=args.interval)
    return LLM(model=str(model_dir), load_format="dummy", max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, block_size=16, **extra)


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def timed(llm: Any, batch: list[list[int]], new: int) -> float:
    from appliance import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in batch], params)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Turns:
    """The multi-turn workload: per session the first turn's prompt and the new tokens its second turn adds."""

    firsts: list[list[int]]
    tails: list[list[int]]
    answer: int  # the first turn's output tokens
    shared: int  # the second prompt's tokens that repeat the first turn (its prompt and answer)
    warmup: tuple[list[int], list[int]]  # an untimed session of the same lengths (first prompt, tail), run first
    probe: tuple[list[int], list[int]]  # another, run last under the profiler with --profile


@dataclass(frozen=True)
class Prompts:
    """Every prompt of a run: batch 1 (one warm-up, one timed), the throughput batch, the multi-turn sessions."""

    one: Workload
    batch: list[list[int]]
    turns: Turns


def make_prompts(args: argparse.Namespace, vocab: int) -> Prompts:
    one = random_workload(vocab, 2, (args.input_len,) * 2, (args.output_len,) * 2, seed=1)
    batch = prompts(random.Random(0), args.num_prompts, args.input_len, vocab)
    rng = random.Random(1)
    shared = int(args.turn_len * 0.9)
    answer = min(16, shared // 4)
    firsts = prompts(rng, args.sessions, shared - answer, vocab)
    tails = [prompts(rng, 1, args.turn_len - shared, vocab)[0] for _ in firsts]
    warmup, probe = ((prompts(rng, 1, shared - answer, vocab)[0], prompts(rng, 1, args.turn_len - shared, vocab)[0])
                     for _ in range(2))
    return Prompts(one, batch, Turns(firsts, tails, answer, shared, warmup, probe))


def decode_and_throughput(llm: Any, args: argparse.Namespace, work: Prompts) -> list[dict[str, Any]]:
    from appliance.bench import offline

    # TPOT from each request's own token times (one warm-up request, then one timed): never a difference of runs
    tpot_ms = offline.latency(llm, work.one, batch_size=1, num_iters=1, num_iters_warmup=1,
                              temperature=0.0)["mean_tpot_ms"]
    wall = timed(llm, work.batch, args.output_len)
    return [{"metric": "batch1_decode", "tpot_ms": round(tpot_ms, 3), "input_len": args.input_len,
             "output_len": args.output_len},
            {"metric": "throughput", "output_tok_s": round(args.num_prompts * args.output_len / wall, 1),
             "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
             "wall_s": round(wall, 2)}]


@dataclass(frozen=True)
class TurnTiming:
    """A second turn, alone on the engine: submission to first token."""

    ttft: float  # seconds
    steps: int  # engine steps run meanwhile
    computed: int  # prompt tokens computed (not reused from the prefix cache)


def first_turn(llm: Any, first: list[int], tail: list[int], answer: int) -> list[int]:
    """A session's first turn (answer tokens); returns its second turn's prompt: that prompt, the answer, the tail."""
    from appliance import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": first}], params)[0].outputs[0].token_ids
    return first + list(out) + tail


def second_turn(llm: Any, prompt: list[int]) -> TurnTiming:
    """The second turn for one token, timed to its arrival from an engine step (offline.run_batch)."""
    from appliance.bench import offline

    before = llm.engine.stats()
    (timing,) = offline.run_batch(llm, [prompt], 1, 0.0)
    after = llm.engine.stats()
    if not timing.success:
        raise RuntimeError(f"the second turn made no token: {timing.error}")
    return TurnTiming(timing.ttft, after.num_steps - before.num_steps,
                      len(prompt) - (after.prefix_hit_tokens - before.prefix_hit_tokens))


def profile_turn(llm: Any, turns: Turns, out: Path, snapshots: bool, device: str) -> Path:
    """The probe session, untimed: its second turn under torch.profiler (host, and device on a GPU); writes a
    Chrome trace and the ops by self time (device time on a GPU) to out/multi_turn_{plain,snapshots}.*"""
    from torch.profiler import ProfilerActivity, profile

    prompt = first_turn(llm, *turns.probe, turns.answer)
    gpu = device == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        second_turn(llm, prompt)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"multi_turn_{'snapshots' if snapshots else 'plain'}"
    prof.export_chrome_trace(str(stem.with_suffix(".trace.json")))
    table = prof.key_averages().table(sort_by="self_device_time_total" if gpu else "self_cpu_time_total",
                                      row_limit=40)
    stem.with_suffix(".ops.txt").write_text(table)
    return stem


def shared_prefix_ttft(llm: Any, args: argparse.Namespace, turns: Turns, snapshots: bool) -> dict[str, Any]:
    """The warm-up session untimed, then each session in turn: its second turn's time to first token."""
    second_turn(llm, first_turn(llm, *turns.warmup, turns.answer))
    hits_before = llm.engine.stats().prefix_hit_tokens
    timings = [second_turn(llm, first_turn(llm, first, tail, turns.answer))
               for first, tail in zip(turns.firsts, turns.tails)]
    hits = llm.engine.stats().prefix_hit_tokens - hits_before
    if args.profile is not None:
        profile_turn(llm, turns, args.profile, snapshots, args.device)
    ttft_ms = [t.ttft * 1e3 for t in timings]
    return {"metric": "multi_turn_ttft", "snapshots": snapshots,
            "mean_ttft_ms": round(statistics.mean(ttft_ms), 3), "median_ttft_ms": round(statistics.median(ttft_ms), 3),
            "ttft_ms": [round(t, 3) for t in ttft_ms], "turn_len": args.turn_len, "shared": turns.shared,
            "sessions": args.sessions, "warmup_sessions": 1, "prefix_hit_tokens": hits,
            "computed_tokens": statistics.mean(t.computed for t in timings),
            "steps_to_first_token": statistics.mean(t.steps for t in timings),
            "checkpoint_interval": args.interval if snapshots else None}


def served(llm: Any) -> dict[str, Any]:
    """What ran: the gated delta rule's kernels (fla-core's Triton ones or the torch reference) and decode graphs."""
    runner = llm.executor.runner
    layer = runner.model.state_layers()[0]
    module = getattr(layer._decode, "__module__", "")
    return {"gated_delta": "fla" if module.startswith("appliance.kernels.triton") else "torch",
            "decode_graphs": runner.graphs is not None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU, tiny dims, short lengths")
    p.add_argument("--layers", type=int, default=8, help="decoder layers, every 4th full attention (default 8)")
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--turn-len", type=int, help="tokens of each multi-turn prompt")
    p.add_argument("--sessions", type=int)
    p.add_argument("--interval", type=int, help="cache.ssm_checkpoint_interval of the snapshot run")
    p.add_argument("--multi-turn-only", action="store_true",
                   help="only the multi-turn TTFT, without then with state snapshots (no decode or throughput run)")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="after the timed sessions, profile one more second turn per phase (torch.profiler; untimed): "
                        "DIR/multi_turn_{plain,snapshots}.trace.json and .ops.txt")
    p.add_argument("--output-json", default=None)
    p.add_argument("--write-configs", type=Path, metavar="DIR",
                   help="write DIR/qwen3-next/ (config.json, workload.json: the peer's input) and stop")
    args = p.parse_args(argv)
    quick = {"input_len": 24, "output_len": 4, "num_prompts": 4, "turn_len": 64, "sessions": 2, "interval": 16}
    full = {"input_len": 1024, "output_len": 1024, "num_prompts": 256, "turn_len": 8192, "sessions": 8,
            "interval": 512}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.layers = min(args.layers, 4)
    args.max_model_len = max(args.input_len + args.output_len, args.turn_len + 1)
    args.device = "cpu" if args.quick else "cuda"
    args.max_num_seqs = max(args.num_prompts, 1)
    return args


def write_configs(args: argparse.Namespace, out: Path) -> Path:
    """out/qwen3-next/: the config.json ours loads and workload.json, this run's prompts and limits (for the peer)."""
    model_dir = write_model_dir(out / MODEL, args.layers, args.quick)
    work = make_prompts(args, json.loads((model_dir / "config.json").read_text())["vocab_size"])
    turns = work.turns
    write_workload(model_dir, {
        "kind": "hybrid", "model": MODEL, "layers": args.layers,
        "engine": {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs},
        "batch1": {"prompts": work.one.prompts, "output_len": args.output_len},
        "throughput": {"prompts": work.batch, "output_lens": [args.output_len] * len(work.batch),
                       "input_len": args.input_len, "output_len": args.output_len},
        "multi_turn": {"firsts": turns.firsts, "tails": turns.tails, "answer": turns.answer, "shared": turns.shared,
                       "turn_len": args.turn_len, "warmup": list(turns.warmup)}})
    return model_dir


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.write_configs is not None:
        print(write_configs(args, args.write_configs))
        return []
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hybrid-bench-") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", args.layers, args.quick)
        work = make_prompts(args, json.loads((model_dir / "config.json").read_text())["vocab_size"])
        shape = {"layers": args.layers, "device": args.device}
        llm = make_llm(model_dir, args, snapshots=False)
        shape.update(served(llm))
        if not args.multi_turn_only:
            records += [{**shape, **r} for r in decode_and_throughput(llm, args, work)]
        records.append({**shape, **shared_prefix_ttft(llm, args, work.turns, snapshots=False)})
        for r in records:
            print(json.dumps(r), flush=True)
        del llm
        gc.collect()  # the runner's caches go with it (weakref finalizers) before the second engine sizes its own
        llm = make_llm(model_dir, args, snapshots=True)
        records.append({**shape, **shared_prefix_ttft(llm, args, work.turns, snapshots=True)})
        print(json.dumps(records[-1]), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
