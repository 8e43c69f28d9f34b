"""recipes/deepseek-v3.toml served by `appliance run` on the DeepSeek-V3 shape with dummy
block-fp8 weights, MTP off and on: start-up time, memory per GPU, batch-1 ITL / TPOT / TTFT, output tok/s at
1024 in / 1024 out with 256 concurrent requests, and MTP's acceptance counters. Prints one table, writes JSON.

    python -m benchmarks.deepseek_v3                      # the real thing: 8 GPUs, the recipe as shipped (tp 8, ep)
    python -m benchmarks.deepseek_v3 --layers 4 --tp 2    # reduced: 4 layers (3 dense + 1 MoE) on 2 GPUs
    python -m benchmarks.deepseek_v3 --smoke              # CPU: tiny dims, tp 2 over gloo, short lengths

Per mode the bench writes a model dir (config.json of the V3 shape: transformers' DeepseekV3Config defaults with
num_nextn_predict_layers=1, the checkpoint's YaRN rope and fp8 quantization_config (e4m3, 128x128 weight blocks),
num_hidden_layers from --layers; a generation_config; a word-level tokenizer with exactly vocab_size ids, written
by appliance/bench/presets.py), starts `appliance run recipes/deepseek-v3.toml --set model.path=DIR --set
model.load_format=dummy ...` in its own session, times launch -> /health 200, reads memory per GPU (nvidia-smi;
on the CPU the RSS of the worker processes), runs `appliance bench serve` (a short warm-up, batch-1, then the
throughput level; ignore_eos, greedy), reads the spec counters of GET /v1/internal/stats (deltas over the measured
levels) and stops the server (SIGTERM, then SIGKILL of anything left in its session; also on a time-out, SIGTERM
or Ctrl-C). MTP off = `--set speculative.algorithm=null` plus the other speculative keys back at their defaults
(config/checks.py refuses speculative settings without an algorithm).

Settings changed from the recipe, all visible in the JSON's `command`: model.path / load_format (dummy weights),
api.host / port, api.served_model_name = "bench" (what benchmarks/server.run_level asks for), and with
--tp the tp; --smoke also sets model.device=cpu, a short max_model_len and a small KV pool; --set adds more.

Dummy weights make the MTP layer's drafts random, so acceptance is ~0: "MTP on" measures the overhead of drafting
and verifying, not the speed-up a real checkpoint would show.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from appliance.bench.presets import write_word_tokenizer
from appliance.runtime.process import session_members, stage_children
from appliance.runtime.topology import free_port
from benchmarks.server import run_level, stop, term_with_parent, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "deepseek-v3.toml"
V3_LAYERS = 61
FP8_V3 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
YARN_V3 = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 4096}
# tiny V3 for the CPU: V3's per-head dims (nope 128, rope 64, v 128) with 4 heads, so every tensor-parallel shard at
# tp 2 holds whole 128-wide fp8 tiles; 2 layers, the second MoE (8 experts, top 2 of 2 groups)
SMOKE_DIMS: dict[str, Any] = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 256,
                              "moe_intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
                              "q_lora_rank": 128, "kv_lora_rank": 128, "n_routed_experts": 8,
                              "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1}
# speculative decoding off: algorithm null and every speculative key the recipe sets back at its default
MTP_OFF = ("speculative.algorithm=null", "speculative.num_draft_tokens=null", "speculative.num_steps=3",
           "speculative.eagle_topk=1")
SPEC_KEYS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


@dataclass(frozen=True)
class Workload:
    batch1_prompts: int
    batch1_in: int
    batch1_out: int
    prompts: int
    concurrency: int
    input_len: int
    output_len: int


def model_config(layers: int, smoke: bool = False) -> dict[str, Any]:
    """config.json of DeepSeek-V3 (the defaults are its shape) with `layers` decoder layers, one MTP layer, the
    shipped YaRN rope and block-fp8 quantization_config; --smoke shrinks the dims (see SMOKE_DIMS)."""
    import transformers

    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    dims = SMOKE_DIMS if smoke else {}
    cfg = transformers.DeepseekV3Config(**dims, num_hidden_layers=layers, num_nextn_predict_layers=1,
                                        max_position_embeddings=163840, rope_scaling=dict(YARN_V3))
    data = cfg.to_dict()
    data.update(architectures=["DeepseekV3ForCausalLM"], quantization_config=dict(FP8_V3))
    return data


def write_model_dir(out: Path, layers: int, smoke: bool = False) -> Path:
    """A model dir `appliance run` loads with load_format=dummy: config, generation config, tokenizer."""
    cfg = model_config(layers, smoke)
    write_word_tokenizer(out, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": True,
           "temperature": 0.6, "top_p": 0.95}  # what the V3 checkpoint ships
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    return out


def overrides(model_dir: Path, port: int, mtp: bool, tp: int | None, smoke: bool,
              extra: tuple[str, ...] = ()) -> list[str]:
    """The --set list for one mode; later entries win, so `extra` (the user's --set) overrides ours."""
    sets = [f"model.path={model_dir}", "model.load_format=dummy", "api.host=127.0.0.1", f"api.port={port}",
            "api.served_model_name=bench"]
    if tp is not None:
        sets.append(f"parallelism.tp={tp}")
    if smoke:
        sets += ["model.device=cpu", "model.max_model_len=512", "cache.max_total_tokens=4096",
                 "scheduler.chunked_prefill_size=512", "observability.log_level=warning"]
    if not mtp:
        sets += list(MTP_OFF)
    return sets + list(extra)


def server_argv(sets: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "appliance.cli.main", "run", str(RECIPE)]
    for s in sets:
        argv += ["--set", s]
    return argv


# ---- measurements ----------------------------------------------------------------------------------------------

def gpu_memory_mib() -> list[float] | None:
    """memory.used of every GPU nvidia-smi lists, MiB; None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [float(x) for x in out.split()]


def worker_rss_mib(supervisor_pid: int) -> list[float]:
    """RSS of the worker stage processes (stage names `worker0`, `dp0.worker1`, ...), MiB."""
    out = []
    for pid, name in stage_children(supervisor_pid).items():
        if "worker" not in name:
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                rss_kib = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        except (OSError, StopIteration, IndexError, ValueError):
            continue
        out.append(round(rss_kib / 1024, 1))
    return out


def spec_counters(base: str) -> dict[str, int]:
    import httpx

    stats = httpx.get(f"{base}/v1/internal/stats", timeout=30.0).json()
    return {k: int(stats.get(k, 0)) for k in SPEC_KEYS}


def acceptance(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """Deltas of the spec counters; rate = accepted / drafted tokens, mean accepted length = tokens emitted per
    verification = 1 + accepted / drafts (vLLM's definition)."""
    d = {k: after[k] - before[k] for k in SPEC_KEYS}
    drafts, tokens, acc = d["spec_num_drafts"], d["spec_num_draft_tokens"], d["spec_num_accepted_tokens"]
    d["acceptance_rate"] = round(acc / tokens, 4) if tokens else None
    d["mean_accepted_length"] = round(1 + acc / drafts, 3) if drafts else None
    return d


def stop_server(proc: subprocess.Popen, stages: list[int]) -> dict[str, Any]:
    """The serving section's stop (SIGTERM, 30 s, SIGKILL, stages checked), then anything else in the session."""
    info = stop(proc, stages)
    left = session_members(proc.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    info["session_left_after_stop"] = len(left)
    return info


def serving_gpus(tp: int, visible: str | None) -> list[int]:
    """nvidia-smi indices of the workers' GPUs: the first tp visible ones (nvidia-smi ignores
    CUDA_VISIBLE_DEVICES, so it is applied here)."""
    ids = [int(x) for x in visible.split(",") if x.strip().isdigit()] if visible else list(range(tp))
    return ids[:tp]


def memory(supervisor_pid: int, smoke: bool, tp: int) -> dict[str, Any]:
    if smoke:
        return {"kind": "worker RSS", "mib": worker_rss_mib(supervisor_pid)}
    every = gpu_memory_mib()
    if every is None:
        return {"kind": "GPU memory.used", "mib": None}
    used = [every[i] for i in serving_gpus(tp, os.environ.get("CUDA_VISIBLE_DEVICES")) if i < len(every)]
    return {"kind": "GPU memory.used", "mib": used, "mib_every_gpu": every}


# ---- one mode ----------------------------------------------------------------------------------------------------

def run_mode(rec: dict[str, Any], args: argparse.Namespace, model_dir: Path, work: Path, wl: Workload) -> None:
    """One server (MTP rec["mode"] = "off" / "on") from launch to a checked stop, filling rec as it goes (so an
    interrupted run keeps what it measured); failures land in rec["status"]."""
    import httpx

    mode = rec["mode"]
    rec["status"] = "ok"
    port = free_port()
    argv = server_argv(overrides(model_dir, port, mode == "on", args.tp, args.smoke, tuple(args.set)))
    rec["command"] = " ".join(argv[1:])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.smoke:
        env["OMP_NUM_THREADS"] = "1"  # two workers, two cores
    log = work / f"server_mtp_{mode}.log"
    print(f"== MTP {mode}: {rec['command']}", flush=True)
    with open(log, "w") as logf:
        # its own session: Ctrl-C reaches us, not it, and we stop it in order; SIGTERM to it if we are killed
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=term_with_parent)  # noqa: PLW1509 (no threads yet)
    stages: list[int] = []
    try:
        base = f"http://127.0.0.1:{port}"
        rec["start_s"] = wait_healthy(proc, base, args.start_timeout)
        stages = list(stage_children(proc.pid))
        rec["memory"] = memory(proc.pid, args.smoke, args.tp or 8)  # 8: the recipe's tp
        # the first requests' one-off costs stay out of the batch-1 figures
        rec["warmup"] = run_level(base, model_dir, 2, 2, min(64, wl.batch1_in), 8, work / f"{mode}_warm.json",
                                  args.bench_timeout)
        before = spec_counters(base)
        rec["batch1"] = run_level(base, model_dir, wl.batch1_prompts, 1, wl.batch1_in, wl.batch1_out,
                                  work / f"{mode}_batch1.json", args.bench_timeout)
        rec["throughput"] = run_level(base, model_dir, wl.prompts, wl.concurrency, wl.input_len, wl.output_len,
                                      work / f"{mode}_c{wl.concurrency}.json", args.bench_timeout)
        rec["spec"] = acceptance(before, spec_counters(base))
    except (TimeoutError, RuntimeError, OSError, subprocess.TimeoutExpired, httpx.HTTPError) as exc:
        rec["status"] = f"{type(exc).__name__}: {exc}"
    except (KeyboardInterrupt, SystemExit):
        rec["status"] = "interrupted"
        raise
    finally:
        rec["stop"] = stop_server(proc, stages or list(stage_children(proc.pid)))
        rec["server_log"] = str(log)
        if rec["status"] != "ok" or rec["stop"]["exit_code"]:
            print(f"server log ({log}, tail):\n" + "\n".join(log.read_text().splitlines()[-40:]), flush=True)


# ---- the table ---------------------------------------------------------------------------------------------------

COLUMNS = ("mode", "start-up s", "memory/GPU", "b1 ITL ms mean/p50/p99", "b1 TPOT ms", "b1 TTFT ms",
           "out tok/s @c", "accept rate", "mean acc len")


def _fmt_memory(mem: dict[str, Any] | None) -> str:
    mib = (mem or {}).get("mib")
    if not mib:
        return "-"
    lo, hi = min(mib) / 1024, max(mib) / 1024
    span = f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}-{hi:.1f}"
    return f"{span} GiB x{len(mib)}" + (" RSS" if "RSS" in mem["kind"] else "")  # type: ignore[index]


def _level(lv: dict[str, Any] | None, key: str, digits: int = 2) -> str:
    if not lv or key not in lv:
        return (lv or {}).get("status", "-")
    return str(round(lv[key], digits))


def table_row(rec: dict[str, Any]) -> tuple[str, ...]:
    b1, tp, spec = rec.get("batch1"), rec.get("throughput"), rec.get("spec") or {}
    itl = " / ".join(_level(b1, f"{s}_itl_ms") for s in ("mean", "median", "p99"))
    out = _level(tp, "output_throughput", 1)
    if tp and "output_throughput" in tp:
        out += f" @{tp['concurrency']}" + (f" ({tp['failed']} FAILED)" if tp.get("failed") else "")
    rate, length = spec.get("acceptance_rate"), spec.get("mean_accepted_length")
    status = rec.get("status", "ok")
    flag = "" if status == "ok" else " (interrupted)" if status == "interrupted" else " (FAILED)"
    return (f"MTP {rec['mode']}{flag}",
            str(rec.get("start_s", "-")), _fmt_memory(rec.get("memory")), itl, _level(b1, "mean_tpot_ms"),
            _level(b1, "mean_ttft_ms", 1), out, "-" if rate is None else f"{rate:.3f}",
            "-" if length is None else f"{length:.3f}")


def format_table(records: list[dict[str, Any]]) -> str:
    rows = [COLUMNS, *(table_row(r) for r in records)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- arguments -----------------------------------------------------------------------------------------------------

# (real, smoke) defaults of the workload flags
DEFAULTS: dict[str, tuple[int, int]] = {"layers": (V3_LAYERS, 2), "batch1_prompts": (4, 2), "batch1_in": (1024, 32),
                                        "batch1_out": (256, 16), "num_prompts": (256, 8), "concurrency": (256, 8),
                                        "input_len": (1024, 32), "output_len": (1024, 32)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny dims, tp 2 over gloo, short lengths")
    p.add_argument("--layers", type=int, help=f"decoder layers (default {V3_LAYERS}; smoke 2)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the recipe's 8; smoke 2)")
    p.add_argument("--modes", default="off,on", help="MTP modes to run, in order (default off,on)")
    for key, (real, smoke) in DEFAULTS.items():
        if key != "layers":
            p.add_argument("--" + key.replace("_", "-"), type=int, help=f"default {real} (smoke {smoke})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra recipe override for both modes (repeatable; wins over the bench's own)")
    p.add_argument("--start-timeout", type=float, default=None, help="s to /health 200 (default 1800; smoke 240)")
    p.add_argument("--bench-timeout", type=float, default=3600.0, help="s per `appliance bench serve` level")
    p.add_argument("--output-json", default="deepseek_v3.json")
    args = p.parse_args(argv)
    for key, (real, smoke) in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else real)
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.tp is None and args.smoke:
        args.tp = 2
    if args.tp is not None and args.tp < 1:
        p.error(f"--tp must be >= 1, got {args.tp}")
    if not args.smoke and not 4 <= args.layers <= V3_LAYERS:
        p.error(f"--layers must be in 4..{V3_LAYERS}: the first 3 layers of V3 are dense, fewer leave no MoE layer")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in ("off", "on") for m in args.modes) or len(set(args.modes)) < len(args.modes):
        p.error(f"--modes takes off and/or on, comma-separated, each once; got {args.modes}")
    if any("=" not in s for s in args.set):
        p.error("--set takes KEY=VALUE")
    if args.start_timeout is None:
        args.start_timeout = 240.0 if args.smoke else 1800.0
    return args


def workload(args: argparse.Namespace) -> Workload:
    return Workload(args.batch1_prompts, args.batch1_in, args.batch1_out, args.num_prompts, args.concurrency,
                    args.input_len, args.output_len)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the finally blocks: servers stop
    wl = workload(args)
    t0 = time.monotonic()
    out = Path(args.output_json)
    result: dict[str, Any] = {"recipe": str(RECIPE), "smoke": args.smoke, "layers": args.layers,
                              "tp": args.tp or "recipe", "workload": asdict(wl), "modes": []}
    with tempfile.TemporaryDirectory(prefix="deepseek_v3_") as tmp:
        work = out.resolve().parent / (out.stem + "_logs")
        work.mkdir(parents=True, exist_ok=True)
        model_dir = write_model_dir(Path(tmp) / "DeepSeek-V3", args.layers, args.smoke)
        try:
            for mode in args.modes:
                result["modes"].append({"mode": mode})
                run_mode(result["modes"][-1], args, model_dir, work, wl)
                out.write_text(json.dumps(result, indent=1))
        except KeyboardInterrupt:
            print("interrupted: the server was stopped", file=sys.stderr)
        finally:
            result["wall_s"] = round(time.monotonic() - t0, 1)
            result["table"] = format_table(result["modes"])
            out.write_text(json.dumps(result, indent=1))
    note = "" if not args.smoke else " (CPU smoke: tiny dims, figures check the harness only)"
    print(f"\nDeepSeek-V3 recipe, {args.layers} layers, tp {args.tp or 'from recipe (8)'}, dummy fp8 weights{note}; "
          f"batch-1: {wl.batch1_prompts} x {wl.batch1_in}/{wl.batch1_out}; throughput: {wl.prompts} x "
          f"{wl.input_len}/{wl.output_len} at concurrency {wl.concurrency}; MTP drafts are random with dummy weights")
    print(result["table"])
    print(f"wall {result['wall_s']} s; JSON: {out}", flush=True)
    failed = [r["mode"] for r in result["modes"]
              if r.get("status") != "ok" or r.get("stop", {}).get("session_left_after_stop")]
    if any(r.get("status") == "interrupted" for r in result["modes"]):
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
