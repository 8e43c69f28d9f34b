#!/usr/bin/env python
"""Replay a request dump (observability.dump_path / --dump) against a running server and compare.

    python tools/replay_dump.py DUMP.jsonl --base-url http://127.0.0.1:8000 [--seq N ...]
        [--endpoint /v1/chat/completions] [--model NAME] [--api-key KEY] [--timeout 300] [--json]

Every recorded request is sent again as recorded (same endpoint, body and streaming); the answer is compared
with the recorded response as a client sees it (text / message, tool calls, finish reason, token usage).
Exit status: 0 when every replay matched, 1 when any differed or failed, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

from appliance.observability.dump import read_dump
from appliance.observability.replay import build_replay_requests, replay


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", help="the JSONL dump file")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--seq", type=int, action="append", help="replay only this seq (repeatable)")
    ap.add_argument("--endpoint", action="append", help="replay only this endpoint (repeatable)")
    ap.add_argument("--model", default=None, help="override the body's model field")
    ap.add_argument("--api-key", default=os.environ.get("APPLIANCE_API_KEY"))
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", action="store_true", help="one JSON object per replayed request")
    args = ap.parse_args(argv)
    try:
        records = read_dump(args.dump)
        overrides = {"model": args.model} if args.model else None
        requests = build_replay_requests(records, args.seq, args.endpoint, overrides)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=args.timeout) as client:
        outcomes = replay(requests, client)
    failed = 0
    for o in outcomes:
        failed += not o.ok
        if args.json:
            print(json.dumps({"seq": o.request.seq, "endpoint": o.request.endpoint, "status": o.status,
                              "ok": o.ok, "differences": list(o.differences)}))
            continue
        print(f"seq {o.request.seq} {o.request.endpoint}: {'OK' if o.ok else f'DIFF (HTTP {o.status})'}")
        for d in o.differences:
            print(f"    {d}")
    print(f"{len(outcomes) - failed}/{len(outcomes)} matched", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
