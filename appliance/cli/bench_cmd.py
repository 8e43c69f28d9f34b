"""`appliance bench throughput | latency | serve`: vLLM's benchmark commands, flag names and metric names.

    appliance bench throughput --model DIR --num-prompts 8 --input-len 32 --output-len 16
    appliance bench throughput --preset qwen3-0.6b            # the published workload on the shape, dummy weights
    appliance bench latency --preset llama-3.1-8b --save-result --result-filename b1.json
    appliance bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 16 --ignore-eos
    appliance bench sessions --base-url http://127.0.0.1:8000 --num-sessions=16 --turns 10 --max-concurrency 4,8,16

throughput and latency build an `appliance.LLM` in this process from --model / --preset, an optional --config
file and --set overrides (as `appliance run`); serve and sessions (multi-turn, bench/sessions.py) measure a
running server, ours or another.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

LATENCY_KEYS = ("ttft", "tpot", "itl", "e2el")


def _percentiles(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _common(p: argparse.ArgumentParser, *, percentile_metrics: str | None, ranged: str = "lengths") -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-range-ratio", type=float, default=None,
                   help=f"{ranged} uniform in [len * (1 - r), len * (1 + r)] (default 0: fixed)")
    if percentile_metrics is not None:  # throughput times the run as a whole: no per-request latencies
        p.add_argument("--percentile-metrics", default=percentile_metrics,
                       help=f"comma-separated, of {','.join(LATENCY_KEYS)}")
        p.add_argument("--metric-percentiles", type=_percentiles, default=[99], help="e.g. 50,90,99")
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument("--result-filename", default=None, help="its file (default bench-<command>-<time>.json)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _engine_args(p: argparse.ArgumentParser) -> None:
    from appliance.bench.presets import SHAPES

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory (config.json and weights, or config.json alone with "
                                     "--load-format dummy)")
    src.add_argument("--preset", choices=sorted(SHAPES),
                     help="a published model shape with dummy weights; its published workload unless set")
    p.add_argument("--config", default=None, metavar="FILE", help="a config file (TOML/YAML) for the engine")
    p.add_argument("--set", dest="dotlist", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set scheduler.chunked_prefill_size=640 (repeatable)")
    p.add_argument("--load-format", default=None, help="default: auto for --model, dummy for --preset")
    p.add_argument("--dtype", default=None, help="default: the config's (auto)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (top_p 1, EOS ignored)")
    p.add_argument("--output-json", default=None, help="vLLM's name for --save-result --result-filename PATH")


def add_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmark the engine offline or a running server",
                                  description="Benchmarks with vLLM's flag and metric names.")
    sub = bench.add_subparsers(dest="bench_command", metavar="{throughput,latency,serve,sessions}", required=True)

    tput = sub.add_parser("throughput", help="every request at once through the offline engine: tok/s")
    _engine_args(tput)
    tput.add_argument("--num-prompts", type=int, default=None, help="default 1000")
    tput.add_argument("--input-len", type=int, default=None, help="default 1024")
    tput.add_argument("--output-len", type=int, default=None, help="default 128")
    _common(tput, percentile_metrics=None)

    lat = sub.add_parser("latency", help="batches run alone on the offline engine: latency, TTFT, TPOT, ITL")
    _engine_args(lat)
    lat.add_argument("--input-len", type=int, default=None, help="default 32")
    lat.add_argument("--output-len", type=int, default=None, help="default 128")
    lat.add_argument("--batch-size", type=int, default=None, help="default 8")
    lat.add_argument("--num-iters", type=int, default=None, help="timed batches (default 30)")
    lat.add_argument("--num-iters-warmup", type=int, default=None, help="untimed batches first (default 10)")
    lat.add_argument("--weight-floor", action="store_true",
                     help="also the weight-read floor: weight bytes a batch-1 step reads / device copy bandwidth")
    _common(lat, percentile_metrics="ttft,tpot,itl", ranged="prompt lengths (one output length)")

    serve = sub.add_parser("serve", help="streamed requests to an OpenAI-compatible server")
    serve.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--endpoint", default=None, help="/v1/completions (default) or /v1/chat/completions")
    serve.add_argument("--backend", choices=["openai", "openai-chat", "vllm"], default="openai",
                       help="openai-chat: /v1/chat/completions")
    serve.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    serve.add_argument("--tokenizer", default=None, help="tokenizer dir for random prompts (default: random words)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--dataset-name", choices=["random"], default="random")
    serve.add_argument("--num-prompts", type=int, default=1000)
    serve.add_argument("--random-input-len", type=int, default=1024)
    serve.add_argument("--random-output-len", type=int, default=128)
    serve.add_argument("--random-prefix-len", type=int, default=0)
    serve.add_argument("--request-rate", type=float, default=float("inf"))
    serve.add_argument("--burstiness", type=float, default=1.0)
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--ignore-eos", action="store_true")
    serve.add_argument("--timeout", type=float, default=6 * 3600, help="per request, seconds")
    _common(serve, percentile_metrics="ttft,tpot,itl")
    _sessions_parser(sub)


def _sessions_parser(sub: Any) -> None:
    p = sub.add_parser("sessions", help="closed-loop multi-turn sessions of token ids against a server: TTFT by "
                                        "turn, ITL, tok/s per user, reported against ideal cache hit")
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None,
                   help="encodes the answers' text for servers that send no token ids (return_token_ids)")
    p.add_argument("--num-sessions", type=int, default=None, help="default: the concurrency (per level)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-len", type=int, default=2048, help="the system prompt all sessions share (tokens)")
    p.add_argument("--user-len", type=int, default=256, help="each session's first user message (tokens)")
    p.add_argument("--tool-len", type=int, default=256, help="the tool result appended after each answer")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per turn (EOS ignored)")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between a turn's answer and the next")
    p.add_argument("--max-concurrency", type=_ints, default=[1],
                   help="sessions at once; a comma-separated list sweeps them (e.g. 1,2,4,8)")
    p.add_argument("--min-tok-s-per-user", type=float, default=70.0,
                   help="the sweep reports the largest concurrency whose p90 tok/s per user reaches this")
    p.add_argument("--id-range", type=_ints, default=[10, 1000], metavar="LOW,HIGH",
                   help="prompt token ids drawn uniformly from [LOW, HIGH) (within every model's vocabulary)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=6 * 3600, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument("--result-filename", default=None, help="its file (default bench-sessions-<time>.json)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


class BenchError(Exception):
    """A bad flag combination or an engine that cannot start: reported in one line, exit code 2."""


def main(args: argparse.Namespace) -> int:
    try:
        return {"throughput": _throughput, "latency": _latency, "serve": _serve,
                "sessions": _sessions}[args.bench_command](args)
    except BenchError as exc:
        print(f"appliance bench {args.bench_command}: {exc}", file=sys.stderr)
        return 2


def _workload_flags(args: argparse.Namespace, defaults: dict[str, int],
                    ranged: tuple[str, ...] = ("input_len", "output_len")) -> dict[str, Any]:
    """The workload's flags: those given, else the preset's published workload, else vLLM's defaults; the range
    ratio widens the `ranged` lengths into [lo, hi] ranges (the others stay fixed)."""
    from appliance.bench.presets import PUBLISHED
    from appliance.bench.workloads import length_range

    published = PUBLISHED.get((args.bench_command, args.preset)) if args.preset else None
    ratio = args.random_range_ratio or 0.0
    out: dict[str, Any] = {}
    for name, default in defaults.items():
        given = getattr(args, name)
        if given is not None:
            least = 0 if name == "num_iters_warmup" else 1
            if given < least:
                raise BenchError(f"--{name.replace('_', '-')} must be >= {least}, got {given}")
            value = given
        elif published is not None:
            out[name] = getattr(published, name)
            continue
        else:
            value = default
        if name.endswith("_len"):
            value = length_range(value, ratio if name in ranged else 0.0)
        out[name] = value
    return out


def _llm(args: argparse.Namespace, tmp: Path) -> Any:
    """The offline engine the flags describe; config errors and unsupported settings become BenchError."""
    from appliance import LLM
    from appliance.bench.presets import write_model_dir
    from appliance.config import ConfigError, build_config

    if args.random_range_ratio is not None and not 0 <= args.random_range_ratio < 1:
        raise BenchError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    model = args.model or str(write_model_dir(args.preset, tmp / args.preset))
    load_format = args.load_format or ("dummy" if args.preset else "auto")
    if args.preset and load_format != "dummy":
        raise BenchError(f"--preset has no weights: --load-format must be dummy, got {load_format}")
    flat = {"model": model, "load_format": load_format, "seed": args.seed, "skip_tokenizer_init": True}
    if args.dtype:
        flat["dtype"] = args.dtype
    try:
        config = build_config(args.config, flat=flat, dotlist=args.dotlist)
        return LLM(config=config)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        raise BenchError(str(exc)) from exc


def _finish(args: argparse.Namespace, result: dict[str, Any], text: str) -> int:
    from appliance.bench.report import save_result

    print(text)
    if result.get("errors"):
        print("errors:", *result["errors"], sep="\n  ", file=sys.stderr)
    path = getattr(args, "output_json", None) or args.result_filename
    if args.save_result or path:
        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        print(f"saved {save_result({**result, 'config': config}, path, args.bench_command)}")
    return 0 if result.get("completed") else 1


def _throughput(args: argparse.Namespace) -> int:
    from appliance.bench import offline
    from appliance.bench.report import format_report, throughput_rows
    from appliance.bench.workloads import random_workload

    w = _workload_flags(args, {"num_prompts": 1000, "input_len": 1024, "output_len": 128})
    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(args, Path(tmp))
        vocab = int(llm.executor.hf_config.vocab_size)
        workload = random_workload(vocab, w["num_prompts"], w["input_len"], w["output_len"], args.seed)
        graphs = offline.capture_graphs(llm, max(map(len, workload.prompts)) + max(workload.output_lens))
        warmup_s = offline.warm_up(llm, workload, args.temperature)
        result = offline.throughput(llm, workload, args.temperature, progress=not args.disable_tqdm)
    result.update(warmup_s=warmup_s, graphs_captured=graphs, preset=args.preset, model=args.model)
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_throughput']:.2f} output tokens/s")
    rows = throughput_rows(result) + [("Steps:", result["steps"]), ("Preemptions:", result["preemptions"])]
    return _finish(args, result, format_report("Throughput Benchmark Result", rows))


def _latency(args: argparse.Namespace) -> int:
    from appliance.bench import offline
    from appliance.bench.report import format_report
    from appliance.bench.workloads import random_workload

    w = _workload_flags(args, {"input_len": 32, "output_len": 128, "batch_size": 8, "num_iters": 30,
                               "num_iters_warmup": 10}, ranged=("input_len",))
    keys = _latency_keys(args)
    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(args, Path(tmp))
        vocab = int(llm.executor.hf_config.vocab_size)
        n = (w["num_iters"] + w["num_iters_warmup"]) * w["batch_size"]
        workload = random_workload(vocab, n, w["input_len"], w["output_len"], args.seed)
        graphs = offline.capture_graphs(llm, max(map(len, workload.prompts)) + max(workload.output_lens))
        result = offline.latency(llm, workload, w["batch_size"], w["num_iters"], w["num_iters_warmup"],
                                 args.temperature, args.metric_percentiles, progress=not args.disable_tqdm)
        if args.weight_floor:
            from appliance.bench.floor import weight_read_floor

            try:
                result.update(weight_read_floor(llm, result["mean_tpot_ms"]))
            except ValueError as exc:
                raise BenchError(str(exc)) from exc
    result.update(graphs_captured=graphs, preset=args.preset, model=args.model)
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, v in result["percentiles"].items():
        print(f"{p}% percentile latency: {v} seconds")
    rows = [("Batch size:", w["batch_size"]), ("Input length:", _span(w["input_len"])),
            ("Output length:", w["output_len"][0]), ("Timed batches:", w["num_iters"]),
            ("Avg latency (s):", result["avg_latency"]), ("Output token throughput (tok/s):",
                                                          result["output_throughput"])]
    if "floor_ms" in result:
        rows += [("Active weights read per step (GB):", result["active_weight_GB"]),
                 ("Copy bandwidth (GB/s):", result["copy_GBps"]), ("Weight-read floor (ms):", result["floor_ms"]),
                 ("Mean TPOT / floor:", result["tpot_over_floor"])]
    return _finish(args, result, format_report("Latency Benchmark Result", rows, result, keys,
                                               args.metric_percentiles))


def _span(bounds: tuple[int, int]) -> str:
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}-{bounds[1]}"


def _latency_keys(args: argparse.Namespace) -> list[str]:
    keys = [k for k in args.percentile_metrics.split(",") if k]
    bad = [k for k in keys if k not in LATENCY_KEYS]
    if bad:
        raise BenchError(f"--percentile-metrics: unknown {', '.join(bad)}; choose from {', '.join(LATENCY_KEYS)}")
    return keys


def _serve(args: argparse.Namespace) -> int:
    try:
        from appliance.bench import client
    except ModuleNotFoundError as exc:
        raise BenchError(f"{exc.name} is missing: pip install 'appliance[bench]'") from exc
    from appliance.bench.report import format_report, throughput_rows, timing_metrics
    from appliance.bench.workloads import length_range, random_text_requests

    keys = _latency_keys(args)
    base = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    if args.num_prompts < 1 or args.request_rate <= 0 or args.burstiness <= 0:
        raise BenchError("--num-prompts must be >= 1 and --request-rate, --burstiness > 0")
    ratio = args.random_range_ratio or 0.0
    try:
        bounds = (length_range(args.random_input_len, ratio), length_range(args.random_output_len, ratio))
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    model = args.model or _served_model(base, args.api_key)
    tokenizer = None
    if args.tokenizer:
        from appliance.tokenization import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    requests = random_text_requests(args.num_prompts, *bounds, args.random_prefix_len, tokenizer, args.seed)
    target = client.ServeTarget(base, endpoint, model, args.api_key, args.temperature, args.ignore_eos, args.timeout)
    timings, duration = asyncio.run(client.run(target, requests, args.request_rate, args.burstiness,
                                               args.max_concurrency, args.seed, progress=not args.disable_tqdm))
    result = timing_metrics(timings, duration, args.metric_percentiles)
    result.update(base_url=base, endpoint=endpoint, model=model, max_concurrency=args.max_concurrency,
                  request_rate=args.request_rate)
    rows = [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
            ("Maximum request concurrency:", args.max_concurrency or "unlimited"),
            ("Request rate configured (RPS):", args.request_rate)] + throughput_rows(result)[1:]
    return _finish(args, result, format_report("Serving Benchmark Result", rows, result, keys,
                                               args.metric_percentiles))


def _served_model(base: str, api_key: str | None) -> str:
    """The first model id of GET /v1/models (vLLM's default for --model)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"no --model given and {base}/v1/models did not name one ({exc})") from exc


def _sessions(args: argparse.Namespace) -> int:
    from appliance.bench import sessions
    from appliance.bench.client import ServeTarget
    from appliance.bench.report import format_report

    if len(args.id_range) != 2 or any(c < 1 for c in args.max_concurrency):
        raise BenchError("--id-range takes LOW,HIGH and --max-concurrency values must be >= 1")
    base = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model or _served_model(base, args.api_key)
    tokenizer = None
    if args.tokenizer:
        from appliance.tokenization import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    target = ServeTarget(base, "/v1/completions", model, args.api_key, args.temperature, True, args.timeout)
    levels: dict[int, dict[str, Any]] = {}
    for i, c in enumerate(args.max_concurrency):
        try:  # each level its own histories (and system prompt), so no level starts on another's cache
            w = sessions.SessionWorkload(args.num_sessions or c, args.turns, args.system_len, args.user_len,
                                         args.tool_len, args.output_len, args.think_time, *args.id_range,
                                         seed=args.seed + i)
        except ValueError as exc:
            raise BenchError(str(exc)) from exc
        results, duration = asyncio.run(sessions.run_sessions(target, w, c, tokenizer))
        levels[c] = sessions.session_metrics(results, duration)
        print(format_report("Sessions Benchmark Result", sessions.report_rows(c, w, levels[c])))
    best = sessions.largest_concurrency(levels, args.min_tok_s_per_user)
    result: dict[str, Any] = {"base_url": base, "model": model, "levels": levels,
                              "largest_concurrency": best, "min_tok_s_per_user": args.min_tok_s_per_user,
                              "completed": sum(m["completed"] for m in levels.values()),
                              "errors": sorted({e for m in levels.values() for e in m["errors"]})[:10]}
    summary = f"Largest concurrency with p90 tok/s per user >= {args.min_tok_s_per_user:g}: {best or 'none'}"
    failed = any(m["failed"] for m in levels.values())
    return _finish(args, result, summary) or (1 if failed else 0)
