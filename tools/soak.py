#!/usr/bin/env python
"""Soak a local server: a bounded load run that looks for leaks, hangs and errors.

    python tools/soak.py --base-url http://127.0.0.1:8000 --num-requests 10000 --abort-fraction 0.3 \\
        [--concurrency 32] [--max-tokens 16] [--stream-fraction 0.7] [--chat-fraction 0.5] [--api-key KEY] \\
        [--supervisor-pid PID] [--server-log FILE] [--max-duration S] [--hang-timeout 60] [--seed 0] [--quiet]

Each request: a random prompt (random words, 2-120 of them), completions or chat, streaming or not. A share
(--abort-fraction) are streamed and abandoned by the client after a random number of chunks (a disconnect the
server must clean up). Reported: requests completed / aborted as planned, hangs (no answer within
--hang-timeout), errors by kind (HTTP status, error event, transport), KV blocks still owned after the drain and
the KV accounting check (/v1/internal/stats), the server-side 5xx counted on /metrics during the run
(appliance:request_errors_total), the ERROR lines the server logged during the run (--server-log: the file its
stderr goes to), and the RSS, open file descriptors and threads of every pipeline process (the supervisor given
by --supervisor-pid, or the process listening on the port, and their children) at the start, after warm-up and
at the end. --max-duration stops sending new requests after that many seconds
(those in flight finish): the report then counts the requests actually run. The report is JSON on stdout. Exit status 0 when there was no hang, no error, no server-side 5xx,
no ERROR line and no block left owned; 1 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = ["the", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "by", "this", "from", "it", "be", "are", "or", "at", "an", "was", "which", "def", "return", "class", "import", "self", "if", "else", "while", "for", "try", "except", "with", "yield", "lambda", "none", "true", "false", "data", "value", "list", "dict", "set", "tuple", "string", "number", "model", "server", "token", "cache", "block", "request", "stream", "chunk", "error", "retry", "timeout"]


@dataclass
class Tally:
    completed: int = 0
    aborted: int = 0  # abandoned mid-stream by the client, as planned
    hangs: int = 0
    errors: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    completion_tokens: int = 0


# ---- pipeline processes and their memory -------------------------------------------------------------------

def listening_pid(port: int) -> int | None:
    """The pid holding a LISTEN socket on `port` (127.0.0.1 / any), from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    p = line.split()
                    if p[3] == "0A" and int(p[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(p[9])
        except OSError:
            continue
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def pipeline_pids(supervisor: int) -> dict[int, str]:
    """The supervisor and its children, named by the stage in their command line."""
    out = {supervisor: "supervisor"}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if parent_of(int(pid)) != supervisor:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        name = cmd[cmd.index(b"appliance.runtime.stage") + 1].decode() if b"appliance.runtime.stage" in cmd \
            else os.path.basename(cmd[0].decode() or pid)
        out[int(pid)] = name
    return out


def process_sample(pid: int) -> dict[str, float | None]:
    """RSS (MiB), open file descriptors and threads of a process, from /proc (None where it is gone)."""
    out: dict[str, float | None] = {"rss_mib": None, "fds": None, "threads": None}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_mib"] = round(int(line.split()[1]) / 1024, 1)
                elif line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


def server_5xx(base_url: str, headers: dict[str, str]) -> float | None:
    """The 5xx answers /metrics has counted so far (None without observability.enable_metrics)."""
    r = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    if r.status_code != 200:
        return None
    found = re.findall(r'^appliance:request_errors_total\{[^}]*status="5\d\d"[^}]*\} (\S+)', r.text, re.MULTILINE)
    return sum(float(v) for v in found)


def log_size(path: str | None) -> int:
    return os.path.getsize(path) if path else 0


def error_lines(path: str | None, since: int) -> list[str]:
    """The ERROR lines written to the server's log after byte offset `since`."""
    if not path:
        return []
    with open(path, "rb") as f:
        f.seek(since)
        return [ln for ln in f.read().decode("utf-8", "replace").splitlines() if " ERROR " in ln]


# ---- load --------------------------------------------------------------------------------------------------

def make_request(rng: random.Random, args: argparse.Namespace, model: str) -> tuple[str, dict[str, Any], int]:
    """(path, body, chunks to read before abandoning; -1: read to the end)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 120)))
    abort = rng.random() < args.abort_fraction
    stream = abort or rng.random() < args.stream_fraction
    body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "stream": stream,
                            "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < args.chat_fraction:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
    else:
        path = "/v1/completions"
        body["prompt"] = text
    if stream:
        body["stream_options"] = {"include_usage": True}
    return path, body, (rng.randint(1, max(1, args.max_tokens // 2)) if abort else -1)


async def one(client: httpx.AsyncClient, path: str, body: dict[str, Any], abort_after: int, tally: Tally) -> None:
    if not body["stream"]:
        r = await client.post(path, json=body)
        if r.status_code != 200:
            tally.errors[f"http {r.status_code}"] += 1
            return
        data = r.json()
        tally.completed += 1
        tally.finish_reasons[data["choices"][0]["finish_reason"]] += 1
        tally.completion_tokens += data["usage"]["completion_tokens"]
        return
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            tally.errors[f"http {r.status_code}"] += 1
            return
        chunks = 0
        done = False
        finish: str | None = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                tally.errors[f"error event {event['error'].get('code')}"] += 1
                return
            chunks += 1
            for choice in event.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                tally.completion_tokens += event["usage"]["completion_tokens"]
            if 0 <= abort_after <= chunks:
                tally.aborted += 1  # leaving the `async with` closes the connection mid-stream
                return
        if done:
            tally.completed += 1
            tally.finish_reasons[str(finish)] += 1
        elif abort_after >= 0:
            tally.aborted += 1  # the answer was shorter than the planned abort point
        else:
            tally.errors["stream ended without [DONE]"] += 1


async def run_load(args: argparse.Namespace, model: str, tally: Tally, on_progress: Any) -> tuple[float, int]:
    """(seconds, requests run)."""
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(args.num_requests):
        queue.put_nowait(make_request(rng, args, model))
    started = time.monotonic()
    done = 0

    async def worker() -> None:
        nonlocal done
        while args.max_duration is None or time.monotonic() - started < args.max_duration:
            try:
                path, body, abort_after = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                await asyncio.wait_for(one(client, path, body, abort_after, tally), args.hang_timeout)
            except TimeoutError:
                tally.hangs += 1
            except httpx.HTTPError as exc:
                tally.errors[f"transport {type(exc).__name__}"] += 1
            done += 1
            on_progress(done)

    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.hang_timeout + 5,
                                 limits=limits) as client:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return time.monotonic() - started, done


def drained_stats(base_url: str, headers: dict[str, str], timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = httpx.get(f"{base_url}/v1/internal/stats", headers=headers, timeout=10).json()
        if (s["num_running"], s["num_waiting"], s["kv_blocks_owned"]) == (0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--abort-fraction", type=float, default=0.3)
    ap.add_argument("--stream-fraction", type=float, default=0.7, help="share of the other requests streamed")
    ap.add_argument("--chat-fraction", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--api-key", default=os.environ.get("APPLIANCE_API_KEY"))
    ap.add_argument("--supervisor-pid", type=int, default=None)
    ap.add_argument("--server-log", default=None, help="the file the server's stderr goes to: ERROR lines counted")
    ap.add_argument("--max-duration", type=float, default=None, help="seconds after which no new request starts")
    ap.add_argument("--hang-timeout", type=float, default=60.0, help="seconds after which a request is a hang")
    ap.add_argument("--warmup-fraction", type=float, default=0.05, help="RSS baseline after this share")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    if not 0 <= args.abort_fraction <= 1 or args.num_requests < 1 or args.concurrency < 1:
        ap.error("need 0 <= --abort-fraction <= 1, --num-requests >= 1, --concurrency >= 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        print(f"soak: no server at {args.base_url}: {exc}", file=sys.stderr)
        return 2
    port = httpx.URL(args.base_url).port or 80
    sup = args.supervisor_pid
    if sup is None:
        http_pid = listening_pid(port)
        sup = parent_of(http_pid) if http_pid is not None else None
    pids = pipeline_pids(sup) if sup is not None else {}
    procs: dict[int, dict[str, Any]] = {p: {"start": process_sample(p)} for p in pids}
    errors_5xx_before = server_5xx(args.base_url, headers)
    log_start = log_size(args.server_log)
    warm = max(1, int(args.num_requests * args.warmup_fraction))
    tally = Tally()

    def on_progress(done: int) -> None:
        if done == warm:
            for p in pids:
                procs[p]["warm"] = process_sample(p)
        if not args.quiet and done % max(1, args.num_requests // 20) == 0:
            print(f"  {done}/{args.num_requests} done, errors {sum(tally.errors.values())}, hangs {tally.hangs}",
                  file=sys.stderr, flush=True)

    duration, num_run = asyncio.run(run_load(args, model, tally, on_progress))
    stats = drained_stats(args.base_url, headers)
    for p in pids:
        procs[p]["end"] = process_sample(p)
    errors_5xx_after = server_5xx(args.base_url, headers)
    server_5xx_count = None if errors_5xx_before is None or errors_5xx_after is None \
        else errors_5xx_after - errors_5xx_before
    logged_errors = error_lines(args.server_log, log_start)
    report = {
        "requests": num_run, "requests_planned": args.num_requests, "duration_s": round(duration, 1),
        "requests_per_s": round(num_run / duration, 1), "completed": tally.completed,
        "aborted_by_client": tally.aborted, "hangs": tally.hangs, "errors": dict(tally.errors),
        "finish_reasons": dict(tally.finish_reasons), "completion_tokens": tally.completion_tokens,
        "after_drain": {k: stats.get(k) for k in ("num_running", "num_waiting", "kv_blocks_owned",
                                                   "kv_blocks_free", "kv_blocks_cached", "kv_blocks_total",
                                                   "accounting_ok")},
        "server_5xx": server_5xx_count,
        "error_log_lines": len(logged_errors) if args.server_log else None,
        "first_error_lines": logged_errors[:5],
        "processes": {f"{pids[p]} ({p})": r for p, r in procs.items()},
    }
    for r in report["processes"].values():
        warm, end = r.get("warm", {}).get("rss_mib"), r["end"]["rss_mib"]
        if warm is not None and end is not None:
            r["rss_growth_after_warmup_mib"] = round(end - warm, 1)
    print(json.dumps(report, indent=2))
    clean = (tally.hangs == 0 and not tally.errors and stats.get("kv_blocks_owned") == 0
             and stats.get("accounting_ok", True) and not server_5xx_count and not logged_errors)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
