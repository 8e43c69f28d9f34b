"""The request dump (observability.dump_path, `--dump`): every generation request and its response as JSONL.

Each line is one JSON object:

    {"ts": "<iso8601 UTC>", "endpoint": "/v1/chat/completions", "kind": "request" | "response", "seq": N,
     "body": {...}}                          (+ "stream": true on a response aggregated from a stream)

A request and its response share `seq`; seq increases by one per request, and a server that appends to an
existing dump continues after the largest seq in it, so pairs stay unambiguous across restarts. Streamed
responses are aggregated into the non-streaming shape (`StreamAggregator`), so a dump reads the same whichever
way the client asked. The file is opened in append mode and never truncated.

Durability: every line is written with one write() and flushed to the OS at once, so a crash of the server
process loses nothing already recorded; os.fsync runs after each response record (and on close), so a machine
crash loses at most the requests in flight since the last response. `fsync="always"` syncs every line,
`"never"` leaves it to the OS.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping

__all__ = ["DumpRecord", "RequestDump", "StreamAggregator", "open_dump", "pair_records", "read_dump"]

log = logging.getLogger(__name__)

FsyncPolicy = Literal["never", "response", "always"]


@dataclass(frozen=True)
class DumpRecord:
    ts: str
    endpoint: str
    kind: str  # "request" or "response"
    seq: int
    body: Any
    stream: bool = False

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DumpRecord:
        try:
            kind, seq = obj["kind"], obj["seq"]
            if kind not in ("request", "response") or not isinstance(seq, int) or seq < 0:
                raise ValueError(f"bad kind {kind!r} or seq {seq!r}")
            return cls(str(obj["ts"]), str(obj["endpoint"]), kind, seq, obj["body"], bool(obj.get("stream")))
        except KeyError as exc:
            raise ValueError(f"dump record lacks {exc}") from None


class RequestDump:
    """Append-only JSONL writer; thread safe (one lock, one write per line)."""

    def __init__(self, path: str, fsync: FsyncPolicy = "response") -> None:
        if fsync not in ("never", "response", "always"):
            raise ValueError(f"fsync must be never / response / always, got {fsync!r}")
        self.path = path
        self.fsync = fsync
        self._lock = threading.Lock()
        self._next_seq = _next_seq_after(path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the server

    def record_request(self, endpoint: str, body: Any) -> int:
        """Write the request; returns its seq, to pass to record_response."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._write({"ts": _now(), "endpoint": endpoint, "kind": "request", "seq": seq, "body": body},
                         sync=self.fsync == "always")
        return seq

    def record_response(self, seq: int, endpoint: str, body: Any, stream: bool = False) -> None:
        rec: dict[str, Any] = {"ts": _now(), "endpoint": endpoint, "kind": "response", "seq": seq, "body": body}
        if stream:
            rec["stream"] = True
        with self._lock:
            self._write(rec, sync=self.fsync != "never")

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                if self.fsync != "never":
                    os.fsync(self._file.fileno())
                self._file.close()

    def _write(self, rec: dict[str, Any], sync: bool) -> None:
        if self._file.closed:
            raise RuntimeError(f"request dump {self.path} is closed")
        self._file.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":"), default=str) + "\n")
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())


def open_dump(path: str | None, fsync: FsyncPolicy = "response") -> RequestDump | None:
    """The dump `observability.dump_path` asks for: None = no dump, "" = a new temp file under $TMPDIR (its
    path is logged at INFO, as for a bare `--dump`), otherwise that file, appended to."""
    if path is None:
        return None
    if path == "":
        fd, path = tempfile.mkstemp(prefix="appliance-dump-", suffix=".jsonl")
        os.close(fd)
    dump = RequestDump(path, fsync)
    log.info("request dump: appending to %s (next seq %d)", path, dump._next_seq)
    return dump


def read_dump(path: str) -> list[DumpRecord]:
    """All records of a dump; a torn last line (the writer crashed mid-write) is skipped with a warning,
    a malformed line elsewhere is an error."""
    return list(_iter_records(path))


def pair_records(records: list[DumpRecord]) -> list[tuple[DumpRecord, DumpRecord | None]]:
    """(request, response or None) by seq, in seq order."""
    requests: dict[int, DumpRecord] = {}
    responses: dict[int, DumpRecord] = {}
    for r in records:
        target = requests if r.kind == "request" else responses
        if r.seq in target:
            raise ValueError(f"dump has two {r.kind} records with seq {r.seq}")
        target[r.seq] = r
    return [(requests[s], responses.get(s)) for s in sorted(requests)]


def _iter_records(path: str) -> Iterator[DumpRecord]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield DumpRecord.from_json(json.loads(line))
        except (json.JSONDecodeError, ValueError, TypeError) as exc:
            if i == last:  # no trailing newline: a torn write
                log.warning("request dump %s: skipping a torn last line", path)
                return
            raise ValueError(f"{path}:{i + 1}: malformed dump record: {exc}") from None


def _next_seq_after(path: str) -> int:
    if not os.path.exists(path):
        return 0
    return max((r.seq for r in _iter_records(path)), default=-1) + 1


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


class StreamAggregator:
    """Folds the JSON chunks of an OpenAI stream (chat.completion.chunk or text_completion) into the body a
    non-streaming call returns: text and reasoning concatenated, tool-call arguments joined per index, the last
    finish_reason and usage. An error event makes the result that error."""

    def __init__(self) -> None:
        self._head: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._usage: Any = None
        self._error: Any = None
        self._chat = True

    def add(self, chunk: Mapping[str, Any]) -> None:
        if "error" in chunk and "choices" not in chunk:
            self._error = chunk["error"]
            return
        if not self._head:
            self._head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
            self._chat = chunk.get("object", "chat.completion.chunk") == "chat.completion.chunk"
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        for ch in chunk.get("choices") or ():
            self._add_choice(ch)

    def _add_choice(self, ch: Mapping[str, Any]) -> None:
        idx = int(ch.get("index", 0))
        acc = self._choices.setdefault(idx, {"index": idx, "text": "", "reasoning": "", "tools": {},
                                             "role": "assistant", "finish_reason": None, "logprobs": []})
        if ch.get("finish_reason") is not None:
            acc["finish_reason"] = ch["finish_reason"]
        lp = ch.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            acc["logprobs"].extend(lp["content"])
        if not self._chat:
            acc["text"] += ch.get("text") or ""
            return
        delta = ch.get("delta") or {}
        acc["role"] = delta.get("role") or acc["role"]
        acc["text"] += delta.get("content") or ""
        acc["reasoning"] += delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls") or ():
            slot = acc["tools"].setdefault(int(tc.get("index", 0)), {"id": None, "type": "function",
                                                                     "function": {"name": "", "arguments": ""}})
            slot["id"] = tc.get("id") or slot["id"]
            fn = tc.get("function") or {}
            slot["function"]["name"] += fn.get("name") or ""
            slot["function"]["arguments"] += fn.get("arguments") or ""

    def result(self) -> dict[str, Any]:
        if self._error is not None:
            return {"error": self._error}
        choices = []
        for idx in sorted(self._choices):
            acc = self._choices[idx]
            if self._chat:
                msg: dict[str, Any] = {"role": acc["role"], "content": acc["text"] or None}
                if acc["reasoning"]:
                    msg["reasoning_content"] = acc["reasoning"]
                if acc["tools"]:
                    msg["tool_calls"] = [acc["tools"][i] for i in sorted(acc["tools"])]
                choice: dict[str, Any] = {"index": idx, "message": msg, "finish_reason": acc["finish_reason"]}
                if acc["logprobs"]:
                    choice["logprobs"] = {"content": acc["logprobs"]}
            else:
                choice = {"index": idx, "text": acc["text"], "finish_reason": acc["finish_reason"]}
            choices.append(choice)
        body = {**self._head, "object": "chat.completion" if self._chat else "text_completion", "choices": choices}
        if self._usage is not None:
            body["usage"] = self._usage
        return body
