"""The `serving` section of tools/bench_gpu.py: `appliance serve` (the real CLI, a real subprocess) on the
Llama-3.1-8B shape with dummy weights, measured by tools/bench_serving.py (random 1024 in / 256 out, ignore_eos)
at several max concurrencies: TTFT / TPOT / ITL mean, p50, p99 and output tok/s per level.

Tokenizer: no real Llama-3 tokenizer is on the GPU box (no internet) and the embedded default model's has 6,144
ids, so the 8B's sampled ids (up to 128,255) would decode to nothing. The section writes a word-level tokenizer
with exactly the model's vocabulary ("w0" .. "w128255", bos/eos/unk special): every id decodes to one
space-separated word and random prompts re-encode to exactly their length, so prompt and output token counts are
exact. Its encode/decode cost is lower than a BPE's (the tokenizer process does less work than with Llama-3's).

The server runs in this section's process group: the driver's time-out signal (SIGTERM to the group, then
SIGKILL) reaches it, and its stage processes die with it (they get SIGKILL when the supervisor dies). The section
gets SIGTERM if the driver itself is killed, and stops the server on SIGTERM. The stop is checked: the JSON
records how many stage processes outlived it (0 expected).
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from appliance.runtime.process import alive, stage_children
from appliance.runtime.topology import free_port

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
IN_LEN, OUT_LEN = 1024, 256
LEVEL_KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "output_throughput", "request_throughput",
              "completed", "failed", "duration", "total_input_tokens", "total_output_tokens")


def write_word_tokenizer(out: Path, vocab_size: int, bos: int, eos: int) -> Path:
    """A word-level tokenizer over exactly vocab_size ids: id i is the word "w{i}" (bos, eos and one unk are
    special tokens), words split on whitespace, decode joins them with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not (0 <= bos < vocab_size and 0 <= eos < vocab_size and bos != eos and vocab_size >= 3):
        raise ValueError(f"bad tokenizer shape: vocab {vocab_size}, bos {bos}, eos {eos}")
    names = [f"w{i}" for i in range(vocab_size)]
    unk = next(i for i in range(vocab_size) if i not in (bos, eos))
    names[bos], names[eos], names[unk] = "<s>", "</s>", "<unk>"
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def term_with_parent() -> None:
    """bench_gpu's preexec_fn for its sections: SIGTERM when the driver dies (Linux PR_SET_PDEATHSIG; elsewhere a
    no-op). The serving section turns SIGTERM into a clean server stop, so a killed run leaves nothing behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float) -> float:
    import httpx

    t0 = time.monotonic()
    while proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return round(time.monotonic() - t0, 1)
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"/health not 200 within {timeout_s:.0f} s")
        time.sleep(0.5)
    raise RuntimeError(f"appliance serve exited during start-up with {proc.returncode}")


def _stop(proc: subprocess.Popen, stages: list[int]) -> dict[str, Any]:
    """SIGTERM, 30 s to drain and exit, then SIGKILL; then how many stage processes outlived it."""
    t = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    deadline = time.monotonic() + 10  # stages exit asynchronously once their supervisor is gone
    while any(alive(p) for p in stages) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in stages if alive(p)]
    for p in left:  # never leave one behind on the box
        os.kill(p, signal.SIGKILL)
    return {"exit_code": code, "stop_s": round(time.monotonic() - t, 1), "stages": len(stages),
            "stages_left_after_stop": len(left)}


@contextmanager
def running_server(model_dir: Path, port: int, log: Path, overlap: bool, start_timeout_s: float,
                   info: dict[str, Any]) -> Iterator[str]:
    """`appliance serve` on model_dir (dummy weights) until the block ends; fills info with start/stop facts."""
    cmd = [sys.executable, "-m", "appliance.cli.main", "serve", str(model_dir), "--load-format", "dummy",
           "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--served-model-name", "bench", "--enable-overlap-schedule", "true" if overlap else "false"]
    info["command"] = " ".join(cmd[1:])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT)
    stages: list[int] = []
    try:
        base = f"http://127.0.0.1:{port}"
        info["start_s"] = _wait_healthy(proc, base, start_timeout_s)
        stages = list(stage_children(proc.pid))
        yield base
    finally:
        stages = stages or list(stage_children(proc.pid))
        info["stop"] = _stop(proc, stages)


def run_level(base: str, tokenizer_dir: Path, prompts: int, concurrency: int, in_len: int, out_len: int,
              result: Path, timeout_s: float) -> dict[str, Any]:
    """tools/bench_serving.py as a subprocess (what a user runs); its figures come back through its JSON."""
    cmd = [sys.executable, str(TOOLS / "bench_serving.py"), "--base-url", base, "--model", "bench", "--tokenizer",
           str(tokenizer_dir), "--dataset-name", "random", "--random-input-len", str(in_len),
           "--random-output-len", str(out_len), "--num-prompts", str(prompts), "--max-concurrency",
           str(concurrency), "--ignore-eos", "--metric-percentiles", "50,99", "--seed", "0",
           "--result-filename", str(result)]
    proc = subprocess.run(cmd, check=False, timeout=timeout_s, capture_output=True, text=True)
    print(proc.stdout, proc.stderr[-2000:], sep="\n", flush=True)
    if not result.exists():
        return {"status": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-500:]}
    m = json.loads(result.read_text())
    out = {k: (round(m[k], 3) if isinstance(m[k], float) else m[k]) for k in LEVEL_KEYS}
    out.update(concurrency=concurrency, prompts=prompts, errors=m.get("errors", []))
    return out


def parse_levels(prompts: str, concurrency: str) -> list[tuple[int, int]]:
    """--serving-prompts and --serving-concurrency ("8,64,192", "1,16,64") -> [(prompts, concurrency), ...]."""
    try:
        n, c = [int(x) for x in prompts.split(",")], [int(x) for x in concurrency.split(",")]
    except ValueError:
        n, c = [], [0]
    if len(n) != len(c) or min(n + c) < 1:
        raise SystemExit(f"--serving-prompts {prompts!r} and --serving-concurrency {concurrency!r}: "
                         "one positive count per level, comma-separated")
    return list(zip(n, c))


def section_serving(rec: Any, args: argparse.Namespace) -> None:
    from bench_offline import PRESETS
    from gpu_measure import TINY

    cfg = TINY if args.smoke else PRESETS["llama-3.1-8b"]
    k = 16 if args.smoke else 1
    in_len, out_len = IN_LEN // k, OUT_LEN // k
    deadline = time.monotonic() + args.section_budget
    pairs = parse_levels(args.serving_prompts, args.serving_concurrency)
    prompts = [max(1, n // 4) if args.smoke else n for n, _ in pairs]
    levels = [c for _, c in pairs]
    # the driver's time-out sends SIGTERM to the group: exit through the finally blocks (the server stops)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rec["workload"] = {"in": in_len, "out": out_len, "ignore_eos": True, "temperature": 0.0,
                       "levels": [{"concurrency": c, "prompts": n} for c, n in zip(levels, prompts)],
                       "tokenizer": f"word-level, {cfg['vocab_size']} ids (see tools/gpu_sections_serving.py)"}
    log = Path(args.section_json).with_name("serving_server.log")
    info: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_word_tokenizer(Path(tmp) / "model", cfg["vocab_size"], cfg["bos_token_id"],
                                         cfg["eos_token_id"])
        (model_dir / "config.json").write_text(json.dumps(cfg))
        start_timeout = max(30.0, deadline - time.monotonic() - 60)
        try:
            with running_server(model_dir, free_port(), log, not args.no_overlap, start_timeout, info) as base:
                rec["server_start_s"] = info["start_s"]
                # a short run first: the first requests' one-off costs stay out of the concurrency-1 figures
                run_level(base, model_dir, 2, 2, min(64, in_len), 8, Path(tmp) / "warm.json", 120)
                for n, c in zip(prompts, levels):
                    left = deadline - time.monotonic() - 45  # keep time to stop the server
                    if left < 10:
                        results.append({"concurrency": c, "prompts": n, "status": "skipped (section budget)"})
                        continue
                    try:
                        results.append(run_level(base, model_dir, n, c, in_len, out_len,
                                                 Path(tmp) / f"c{c}.json", left))
                    except subprocess.TimeoutExpired:
                        results.append({"concurrency": c, "prompts": n, "status": "timed out"})
                    rec["levels"] = results
        finally:
            rec["server"] = info
            if log.exists() and (info.get("stop", {}).get("exit_code") or "start_s" not in info):
                print("server log (tail):\n" + "\n".join(log.read_text().splitlines()[-40:]), flush=True)


def _ms(level: dict[str, Any], metric: str) -> str:
    if "mean_" + metric + "_ms" not in level:
        return level.get("status", "-")
    return " / ".join(str(round(level[f"{s}_{metric}_ms"], 2)) for s in ("mean", "median", "p99"))


def table_rows(sec: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows of bench_gpu's table: per level TTFT, TPOT, ITL (mean / p50 / p99 ms) and output tok/s."""
    if not sec.get("levels"):
        return [("serving (appliance serve + bench_serving)", sec.get("status", "not run"), "", "")] if sec else []
    w = sec.get("workload", {})
    stop = sec.get("server", {}).get("stop", {})
    rows = [(f"serving Llama-3.1-8B random {w.get('in')}/{w.get('out')}: start-up / stages left after stop",
             f"{sec.get('server_start_s')} s / {stop.get('stages_left_after_stop', '?')}", "", "0 left")]
    for lv in sec["levels"]:
        head = f"  concurrency {lv['concurrency']} ({lv['prompts']} prompts)"
        if "output_throughput" not in lv:
            rows.append((head, lv.get("status", "-"), "", ""))
            continue
        fails = f", {lv['failed']} FAILED" if lv.get("failed") else ""
        rows.append((f"{head}: output tok/s{fails}", str(round(lv["output_throughput"], 1)), "", ""))
        for metric in ("ttft", "tpot", "itl"):
            rows.append((f"    {metric.upper()} ms mean / p50 / p99", _ms(lv, metric), "", ""))
    return rows
