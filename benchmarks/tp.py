"""Tensor parallelism on 2 GPUs: tp=2 vs tp=1 greedy tokens, batch-1 decode time and 1024/1024 throughput with the
one-shot CUDA-IPC all-reduce on and off (parallelism.disable_custom_all_reduce), and the all-reduce alone.

    python -m benchmarks.tp --output-json tp.json                  # 2 GPUs: Llama-3.1-8B shape, dummy bf16
    python -m benchmarks.tp --smoke --output-json /tmp/smoke.json  # CPU: tiny shape, gloo, tp=2

Every engine runs in a child process of its own (so each starts with empty GPUs; tp=1 uses GPU 0); the child's
log is scanned for the line each worker prints at start-up ("tensor-parallel all-reduce: ..."), so the table says
which all-reduce really ran. The micro-benchmark times one all-reduce of rows x hidden bf16 per call, eagerly and
replayed inside a CUDA graph (20 calls per graph), one-shot vs NCCL, on 2 ranks started here. Prints one table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from appliance.bench.presets import SHAPES

ROOT = Path(__file__).resolve().parent.parent


def _child_env() -> dict[str, str]:
    """The children import appliance from this checkout and keep any PYTHONPATH the caller set (a GPU host
    may carry pydantic & co. there)."""
    extra = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([extra] if extra else []))}


LLAMA_8B = SHAPES["llama-3.1-8b"]
TINY = {**LLAMA_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "head_dim": 64, "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 4096,
        "rope_scaling": None}
AR_LINE = "tensor-parallel all-reduce:"
ON, OFF = {"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "disable_custom_all_reduce": True}
# name: (overrides, --skip part, real checkpoint, batch-1 ITL, throughput)
RUNS: dict[str, tuple[dict[str, Any], str, bool, bool, bool]] = {
    "parity_tp1": ({"tensor_parallel_size": 1}, "parity", True, False, False),
    "parity_tp2": (ON, "parity", True, False, False),
    "tp1": ({"tensor_parallel_size": 1}, "tp1", False, True, False),
    "tp2_one_shot": (ON, "on", False, True, True),
    "tp2_nccl": (OFF, "off", False, True, True),
}
GRAPH_CALLS = 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shape, gloo, small sizes")
    p.add_argument("--num-prompts", type=int, default=None, help="throughput prompts (default 128; smoke 4)")
    p.add_argument("--input-len", type=int, default=None, help="default 1024 (smoke 64)")
    p.add_argument("--output-len", type=int, default=None, help="throughput output length, default 1024 (smoke 16)")
    p.add_argument("--itl-output-len", type=int, default=None, help="batch-1 output length, default 256 (smoke 16)")
    p.add_argument("--rows", default=None, help="all-reduce rows, comma-separated (default 1,2,4,...,512)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: allreduce,parity,tp1,on,off")
    p.add_argument("--parity-dtype", default=None, help="dtype of the parity runs (default: bfloat16 on GPUs; "
                   "float32 makes the tp=1 / tp=2 comparison independent of bf16 reduction-order rounding)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one engine configuration (JSON)
    p.add_argument("--rank", help=argparse.SUPPRESS)  # internal: one all-reduce rank (JSON)
    a = p.parse_args(argv)
    s = a.smoke
    a.num_prompts = a.num_prompts or (4 if s else 128)
    a.input_len = a.input_len or (64 if s else 1024)
    a.output_len = a.output_len or (16 if s else 1024)
    a.itl_output_len = a.itl_output_len or (16 if s else 256)
    a.rows = [int(r) for r in (a.rows or ("1,8" if s else "1,2,4,8,16,32,64,128,256,512")).split(",")]
    return a


# ---- one engine configuration, in a child process ----------------------------------------------------------
def _prompts(seed: int, vocab: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def _itl(llm: Any, prompt: list[int], out_len: int) -> dict[str, float]:
    """Decode steps of one request alone, timed one by one (each ends with its token back on the host)."""
    from appliance import SamplingParams

    eng = llm.engine
    eng.add_request(f"itl-{time.monotonic_ns()}", prompt,
                    SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    start = time.perf_counter()
    ttft, last, gaps = None, start, []
    while eng.has_work():
        got = sum(len(d.new_token_ids) for d in eng.step())
        now = time.perf_counter()
        if got and ttft is None:
            ttft = now - start  # the prefill step(s) up to the first token
        elif got:
            gaps.append((now - last) / got)  # token-producing decode steps only
        if got:
            last = now
    return {"ttft_ms": round((ttft or 0.0) * 1e3, 2), "itl_ms": round(statistics.mean(gaps) * 1e3, 3),
            "itl_p50_ms": round(statistics.median(gaps) * 1e3, 3), "decode_tokens": len(gaps)}


def _throughput(llm: Any, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    from appliance import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": round(elapsed, 2), "output_tokens": n_out, "output_tok_s": round(n_out / elapsed, 1),
            "total_tok_s": round((n_out + sum(map(len, prompts))) / elapsed, 1)}


def run_child(spec: dict[str, Any]) -> None:
    from appliance import LLM, SamplingParams

    llm = LLM(model=spec["model"], load_format=spec["load_format"], seed=0, skip_tokenizer_init=True,
              enable_prefix_caching=False, **spec["overrides"])
    vocab = int(spec["vocab"])
    out: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        sp = SamplingParams(temperature=0.0, max_tokens=spec["parity_tokens"], ignore_eos=True)
        parity = _prompts(1, vocab, spec["parity_lens"])  # 3 prompts: decode batches padded to a graph of 4
        out["greedy_tokens"] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p}
                                                                             for p in parity], sp)]
        if spec["itl"]:
            out["itl"] = _itl(llm, _prompts(2, vocab, [spec["input_len"]])[0], spec["itl_output_len"])
        if spec["throughput"]:
            tput = _prompts(3, vocab, [spec["input_len"]] * spec["num_prompts"])
            out["throughput"] = _throughput(llm, tput, spec["output_len"])
        out["measure_s"] = round(time.perf_counter() - t0, 1)
    finally:
        llm.shutdown()
    Path(spec["out"]).write_text(json.dumps(out))


def engine(name: str, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run one configuration in a child; its result plus the all-reduce lines its workers logged."""
    spec = {**spec, "out": str(tmp / f"{name}.json")}
    log_path = tmp / f"{name}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.call([sys.executable, __file__, "--child", json.dumps(spec)], stdout=log, stderr=log,
                               cwd=ROOT, env=_child_env())
    text = log_path.read_text(errors="replace")
    lines = sorted({ln.split(AR_LINE, 1)[1].strip() for ln in text.splitlines() if AR_LINE in ln})
    if code != 0:
        print(f"[{name}] failed with exit code {code}; log tail:\n" + "\n".join(text.splitlines()[-40:]),
              file=sys.stderr)
        return {"error": f"exit code {code}", "all_reduce": lines}
    res = json.loads(Path(spec["out"]).read_text())
    res["all_reduce"] = lines
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"[{name}] done in {res['wall_s']} s; all-reduce: {lines or ['(none logged: tp=1)']}", file=sys.stderr)
    return res


# ---- the all-reduce alone, on 2 ranks --------------------------------------------------------------------
def _time_eager(fn: Any, x: Any, iters: int, cuda: bool) -> float:
    import torch

    for _ in range(3):
        fn(x)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn(x)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


def _time_graph(fn: Any, x: Any, replays: int) -> float:
    import torch

    fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * GRAPH_CALLS)


def run_rank(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from appliance.executor.distributed import (
        DistributedEnv,
        init_distributed,
        shutdown_distributed,
    )
    from appliance.layers import parallel_state

    cuda = spec["device"] == "cuda"
    rank = int(spec["rank"])
    init_distributed(spec["device"], DistributedEnv(rank, 2, rank, "127.0.0.1", int(spec["port"])))
    one_shot = parallel_state._ONE_SHOT
    nccl = lambda x: dist.all_reduce(x)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows_out = []
    for rows in spec["rows"]:
        x = torch.ones(rows, spec["hidden"], dtype=dtype, device="cuda" if cuda else "cpu")
        entry: dict[str, Any] = {"rows": rows, "bytes": x.numel() * x.element_size()}
        methods = {"nccl": nccl}
        if one_shot is not None and one_shot.fits(x):
            methods["one_shot"] = one_shot
            a = x.clone().normal_(generator=torch.Generator(x.device).manual_seed(rank))
            b = a.clone()
            one_shot(a)
            nccl(b)
            entry["equal_to_nccl"] = bool(torch.equal(a, b))
        for name, fn in methods.items():
            dist.barrier()
            entry[f"{name}_eager_us"] = round(_time_eager(fn, x, 50 if cuda else 10, cuda), 2)
            if cuda:
                dist.barrier()
                entry[f"{name}_graph_us"] = round(_time_graph(fn, x, 20), 2)
        rows_out.append(entry)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(rows_out))
    shutdown_distributed()


def allreduce(args: argparse.Namespace, hidden: int, tmp: Path) -> list[dict[str, Any]] | dict[str, str]:
    from appliance.runtime.topology import free_port

    port, out = free_port(), tmp / "allreduce.json"
    device = "cpu" if args.smoke else "cuda"
    env = _child_env()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", json.dumps(
        {"rank": r, "port": port, "device": device, "rows": args.rows, "hidden": hidden, "out": str(out)})],
        cwd=ROOT, env=env) for r in range(2)]
    codes = [p.wait(timeout=300) for p in procs]
    return json.loads(out.read_text()) if codes == [0, 0] else {"error": f"exit codes {codes}"}


# ---- the run and its table -------------------------------------------------------------------------------
def write_checkpoint(shape: dict[str, Any], layers: int, path: Path) -> None:
    """A real safetensors Llama checkpoint of `shape` with `layers` layers and random N(0, 0.02) weights: tp=2
    reads its shards from it, so tp=1 and tp=2 run the same model (dummy weights are drawn per shard, so they
    would not; the throughput runs use them because 32 layers of real weights would take minutes to write)."""
    import torch
    from safetensors.torch import save_file

    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(0)

    def w(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": w(v, h), "lm_head.weight": w(v, h), "model.norm.weight": torch.ones(h)}
    for n in range(layers):
        pre = f"model.layers.{n}."
        t.update({pre + "self_attn.q_proj.weight": w(h, h), pre + "self_attn.k_proj.weight": w(kv, h),
                  pre + "self_attn.v_proj.weight": w(kv, h), pre + "self_attn.o_proj.weight": w(h, h),
                  pre + "mlp.gate_proj.weight": w(i, h), pre + "mlp.up_proj.weight": w(i, h),
                  pre + "mlp.down_proj.weight": w(h, i), pre + "input_layernorm.weight": torch.ones(h),
                  pre + "post_attention_layernorm.weight": torch.ones(h)})
    path.mkdir(parents=True)
    save_file({k: x.to(torch.bfloat16).contiguous() for k, x in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**shape, "num_hidden_layers": layers}))


def _first_mismatch(a: list[list[int]] | None, b: list[list[int]] | None) -> str:
    if not a or not b:
        return "n/a"
    same = sum(x == y for x, y in zip(a, b))
    first = [next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(a, b)]
    return f"{same}/{len(a)} identical" + ("" if same == len(a) else f" (first differing token: {first})")


def table(res: dict[str, Any]) -> str:
    lines = ["", ("| engine | all-reduce (workers' log) | greedy tokens | batch-1 ITL ms (p50) | TTFT ms | "
                  "output tok/s |"), "| --- | --- | --- | --- | --- | --- |"]
    refs = {"parity_tp2": "parity_tp1", "tp2_nccl": "tp2_one_shot"}  # tp1 vs tp2 dummy weights differ
    for name in RUNS:
        r = res.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | {r.get('all_reduce')} | ERROR {r['error']} | | | |")
            continue
        itl, tput = r.get("itl", {}), r.get("throughput", {})
        ref = refs.get(name)
        theirs = res.get(ref, {}).get("greedy_tokens") if ref else None
        vs = "-" if ref is None else f"vs {ref}: {_first_mismatch(theirs, r.get('greedy_tokens'))}"
        lines.append(f"| {name} | {'; '.join(r['all_reduce']) or '-'} | {vs} | "
                     f"{itl.get('itl_ms', '-')} ({itl.get('itl_p50_ms', '-')}) | {itl.get('ttft_ms', '-')} | "
                     f"{tput.get('output_tok_s', '-')} |")
    lines.append("\nparity_*: a real random checkpoint of the shape with 2 layers (tp=1 vs tp=2 must match); tp1 / "
                 "tp2_*: all layers, dummy weights (drawn per shard: tp1 vs tp2 tokens differ by construction, "
                 "one-shot vs NCCL must match)")
    ar = res.get("allreduce")
    if isinstance(ar, list):
        lines += ["", ("| rows x hidden | bytes | one-shot graph us | NCCL graph us | one-shot eager us | "
                       "NCCL eager us | equal |"), "| --- | --- | --- | --- | --- | --- | --- |"]
        for e in ar:
            lines.append(f"| {e['rows']} | {e['bytes']} | {e.get('one_shot_graph_us', '-')} | "
                         f"{e.get('nccl_graph_us', '-')} | {e.get('one_shot_eager_us', '-')} | "
                         f"{e.get('nccl_eager_us', '-')} | {e.get('equal_to_nccl', '-')} |")
    elif ar is not None:
        lines.append(f"\nall-reduce micro-benchmark: {ar}")
    return "\n".join(lines)


def warnings(res: dict[str, Any], smoke: bool) -> list[str]:
    """What the workers' own start-up lines contradict: the on/off comparison is only worth what they say."""
    out = []
    off = " ".join(res.get("tp2_nccl", {}).get("all_reduce", []))
    if "one-shot" in off:
        out.append("tp2_nccl ran the one-shot: parallelism.disable_custom_all_reduce did not reach the workers "
                   "(runtime/worker_proc.py must call init_distributed(..., all_reduce=AllReduceSettings."
                   "from_config(config)))")
    on = " ".join(res.get("tp2_one_shot", {}).get("all_reduce", []))
    if not smoke and on and "one-shot" not in on:
        out.append(f"tp2_one_shot did not get the one-shot all-reduce: {on}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        run_child(json.loads(args.child))
        return {}
    if args.rank:
        run_rank(json.loads(args.rank))
        return {}
    shape = TINY if args.smoke else LLAMA_8B
    skip = set(filter(None, args.skip.split(",")))
    res: dict[str, Any] = {"shape": "tiny" if args.smoke else "llama-3.1-8b", "args": {
        k: v for k, v in vars(args).items() if k not in ("child", "rank")}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text(json.dumps(shape))
        if "allreduce" not in skip:
            res["allreduce"] = allreduce(args, int(shape["hidden_size"]), tmp)
        base = {"vocab": shape["vocab_size"], "parity_lens": [7, 64, 300], "parity_tokens": 32 if not args.smoke else 8,
                "input_len": args.input_len, "itl_output_len": args.itl_output_len, "output_len": args.output_len,
                "num_prompts": args.num_prompts}
        common = {"dtype": "float32" if args.smoke else "bfloat16", "device": "cpu" if args.smoke else "cuda",
                  "max_model_len": max(args.input_len + max(args.output_len, args.itl_output_len), 512) + 64}
        if "parity" not in skip:
            t = time.perf_counter()
            write_checkpoint(shape, 2, tmp / "ckpt")
            print(f"[parity] 2-layer checkpoint written in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        for name, (overrides, part, real, itl, tput) in RUNS.items():
            if part in skip:
                continue
            dtype = {"dtype": args.parity_dtype} if real and args.parity_dtype else {}
            spec = {**base, "model": str(tmp / ("ckpt" if real else "model")),
                    "load_format": "safetensors" if real else "dummy", "overrides": {**common, **overrides, **dtype},
                    "itl": itl, "throughput": tput}
            res[name] = engine(name, spec, tmp)
    res["total_wall_s"] = round(time.perf_counter() - t0, 1)
    res["warnings"] = warnings(res, args.smoke)
    print(table(res))
    for w in res["warnings"]:
        print(f"WARNING: {w}")
    print(f"\ntotal {res['total_wall_s']} s")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
