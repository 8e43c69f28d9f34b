#!/usr/bin/env python
"""Print the KV cache events an appliance publishes (observability.kv_events), optionally replaying first.

    python tools/kv_events_subscriber.py --endpoint tcp://127.0.0.1:5557 [--topic kv-events]
        [--replay-endpoint tcp://127.0.0.1:5558 --from-seq 0] [--count N] [--json]

Each batch is three frames: topic, 8-byte big-endian sequence number, msgpack [ts, events, dp_rank]. A gap in
the sequence numbers means batches were lost (the PUB socket drops for slow or late subscribers); with a
replay endpoint the tool asks the publisher for the missing ones, the same protocol it uses for --from-seq.
For DP rank r, connect to the configured endpoint's port + r.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterator

import zmq

from appliance.observability.kv_events import END_SEQ, decode_batch


def format_event(ev: list[Any]) -> str:
    kind = ev[0]
    if kind == "BlockStored":
        _, hashes, parent, tokens, block_size = ev
        head = ",".join(str(t) for t in tokens[:8]) + (",..." if len(tokens) > 8 else "")
        return f"BlockStored hash={hashes[0]:#018x} parent={'-' if parent is None else f'{parent:#018x}'} " \
               f"block_size={block_size} tokens=[{head}]"
    if kind == "BlockRemoved":
        return f"BlockRemoved hash={ev[1][0]:#018x}"
    return kind


def replay(ctx: zmq.Context, endpoint: str, start_seq: int, timeout_ms: int = 5000) -> Iterator[tuple[int, bytes]]:
    """Ask the publisher's ROUTER for every buffered batch with seq >= start_seq."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            if not sock.poll(timeout_ms):
                raise TimeoutError(f"no replay answer from {endpoint} within {timeout_ms} ms")
            _, seq_b, payload = sock.recv_multipart()
            if seq_b == END_SEQ:
                return
            yield int.from_bytes(seq_b, "big"), payload
    finally:
        sock.close()


def show(seq: int, payload: bytes, as_json: bool, source: str = "") -> None:
    ts, events, rank = decode_batch(payload)
    if as_json:
        print(json.dumps({"seq": seq, "ts": ts, "dp_rank": rank, "events": events, "replayed": bool(source)}))
        return
    print(f"#{seq}{source} ts={ts:.3f} dp_rank={rank} events={len(events)}")
    for ev in events:
        print("   ", format_event(ev))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the publisher's PUB endpoint")
    ap.add_argument("--topic", default="", help="topic to subscribe to (prefix match, empty = all)")
    ap.add_argument("--replay-endpoint", default=None, help="the publisher's replay (ROUTER) endpoint")
    ap.add_argument("--from-seq", type=int, default=None, help="replay from this sequence number first")
    ap.add_argument("--count", type=int, default=0, help="stop after N live batches (0 = run until Ctrl-C)")
    ap.add_argument("--json", action="store_true", help="one JSON object per batch")
    args = ap.parse_args(argv)
    if args.from_seq is not None and args.replay_endpoint is None:
        ap.error("--from-seq needs --replay-endpoint")

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(args.endpoint)
    expected: int | None = None
    if args.from_seq is not None:
        for seq, payload in replay(ctx, args.replay_endpoint, args.from_seq):
            show(seq, payload, args.json, " (replayed)")
            expected = seq + 1
    seen = 0
    try:
        while args.count == 0 or seen < args.count:
            _, seq_b, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if expected is not None and seq < expected:
                continue  # already shown by a replay
            if expected is not None and seq > expected:
                print(f"# gap: batches {expected}..{seq - 1} missed", file=sys.stderr)
                if args.replay_endpoint:
                    for rseq, rpayload in replay(ctx, args.replay_endpoint, expected):
                        if rseq < seq:
                            show(rseq, rpayload, args.json, " (replayed)")
            show(seq, payload, args.json)
            expected = seq + 1
            seen += 1
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
