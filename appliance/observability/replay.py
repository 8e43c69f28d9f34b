"""Replaying a request dump (dump.py) against a server and comparing the answers (tools/replay_dump.py).

The requests are sent exactly as recorded (same endpoint, same body, streaming or not); a streamed answer is
aggregated with the same `StreamAggregator` the dump used, so recorded and new responses have one shape.
`compare_responses` looks at what a client sees: per choice the text (or message content, reasoning and tool
calls) and finish reason, plus the usage token counts. Ids and timestamps are ignored. With sampling
(temperature > 0 and no seed) differences are expected; replays of greedy requests should match exactly.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from appliance.observability.dump import DumpRecord, StreamAggregator, pair_records

__all__ = ["ReplayOutcome", "ReplayRequest", "build_replay_requests", "compare_responses", "replay", "send"]


@dataclass(frozen=True)
class ReplayRequest:
    seq: int
    endpoint: str
    body: Any
    recorded: Any | None  # the recorded response body, None when the dump has none (crash, client gone)


@dataclass(frozen=True)
class ReplayOutcome:
    request: ReplayRequest
    status: int
    response: Any
    differences: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.differences


def build_replay_requests(records: list[DumpRecord], seqs: Iterable[int] | None = None,
                          endpoints: Iterable[str] | None = None,
                          overrides: Mapping[str, Any] | None = None) -> list[ReplayRequest]:
    """The requests to resend, in seq order; `overrides` replaces top-level body fields (e.g. model)."""
    want_seqs = set(seqs) if seqs is not None else None
    want_eps = set(endpoints) if endpoints is not None else None
    out = []
    for req, resp in pair_records(records):
        if want_seqs is not None and req.seq not in want_seqs:
            continue
        if want_eps is not None and req.endpoint not in want_eps:
            continue
        body = req.body
        if overrides:
            if not isinstance(body, dict):
                raise ValueError(f"seq {req.seq}: cannot override fields of a non-object body")
            body = {**body, **overrides}
        out.append(ReplayRequest(req.seq, req.endpoint, body, resp.body if resp is not None else None))
    return out


def send(client: Any, req: ReplayRequest) -> tuple[int, Any]:
    """POST the request with an httpx.Client (base_url set); returns (status, body), a stream aggregated."""
    stream = isinstance(req.body, dict) and bool(req.body.get("stream"))
    if not stream:
        r = client.post(req.endpoint, json=req.body)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"error": r.text}
    agg = StreamAggregator()
    with client.stream("POST", req.endpoint, json=req.body) as r:
        if r.status_code != 200:
            r.read()
            try:
                return r.status_code, r.json()
            except ValueError:
                return r.status_code, {"error": r.text}
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            agg.add(json.loads(data))
    return 200, agg.result()


def _view(body: Any) -> dict[str, Any]:
    """What a client sees of a response, ids and timestamps left out."""
    if not isinstance(body, dict):
        return {"body": body}
    if "error" in body and "choices" not in body:
        return {"error": body["error"]}
    choices = {}
    for ch in body.get("choices") or ():
        msg = ch.get("message")
        if msg is not None:
            tools = [(t.get("function", {}).get("name"), t.get("function", {}).get("arguments"))
                     for t in msg.get("tool_calls") or ()]
            seen = {"content": msg.get("content"), "reasoning": msg.get("reasoning_content"), "tool_calls": tools}
        else:
            seen = {"text": ch.get("text")}
        seen["finish_reason"] = ch.get("finish_reason")
        choices[ch.get("index", 0)] = seen
    usage = body.get("usage") or {}
    return {"choices": choices, "usage": {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens")}}


def compare_responses(recorded: Any, got: Any) -> tuple[str, ...]:
    """Human-readable differences between two response bodies (empty when a client would see the same)."""
    a, b = _view(recorded), _view(got)
    diffs: list[str] = []
    for key in sorted(set(a) | set(b)):
        if key == "choices":
            ca, cb = a.get("choices", {}), b.get("choices", {})
            for idx in sorted(set(ca) | set(cb)):
                if idx not in ca or idx not in cb:
                    diffs.append(f"choice {idx}: only in {'recorded' if idx in ca else 'replay'}")
                    continue
                for field in sorted(set(ca[idx]) | set(cb[idx])):
                    if ca[idx].get(field) != cb[idx].get(field):
                        diffs.append(f"choice {idx} {field}: recorded {ca[idx].get(field)!r:.200} "
                                     f"!= replay {cb[idx].get(field)!r:.200}")
        elif a.get(key) != b.get(key):
            diffs.append(f"{key}: recorded {a.get(key)!r:.200} != replay {b.get(key)!r:.200}")
    return tuple(diffs)


def replay(requests: list[ReplayRequest], client: Any) -> list[ReplayOutcome]:
    outcomes = []
    for req in requests:
        status, body = send(client, req)
        diffs = compare_responses(req.recorded, body) if req.recorded is not None else ("no recorded response",)
        outcomes.append(ReplayOutcome(req, status, body, diffs))
    return outcomes
