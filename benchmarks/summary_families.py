"""The model families' rows of benchmarks/summary.py: ours (benchmarks/models.py's JSON lines in models.jsonl,
benchmarks/hybrid.py's list in hybrid.json) beside the peer's (benchmarks/peer_models.py: peer_models.json,
peer_mxfp4.json, peer_hybrid.json) for every model either side measured. A record with "error" (a model the peer
could not load or run, or one its time limit left out) fills its cells with "not run: " and the cause.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = tuple[str, str, str]
Record = dict[str, Any]
CAUSE_CHARS = 120
PEER_MODEL_FILES = ("peer_models.json", "peer_mxfp4.json")  # gpu_suite.sh parts peer-models, peer-mxfp4
# the hybrid metrics each of benchmarks/peer_measure.py's phases reports: a failed phase fails these cells
PHASE_METRICS = {"plain": (("batch1_decode", None), ("throughput", None), ("multi_turn_ttft", False)),
                 "snapshots": (("multi_turn_ttft", True),)}


def records(path: Path) -> list[Record]:
    """The records of a JSON list or of JSON lines (other lines skipped); none for a missing file."""
    try:
        text = path.read_text()
    except OSError:
        return []
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    except ValueError:
        items = []
        for line in text.splitlines():
            try:
                items.append(json.loads(line))
            except ValueError:
                continue
    return [r for r in items if isinstance(r, dict)]


def _clip(text: object) -> str:
    """A cause in a table cell: no column bars, at most CAUSE_CHARS characters."""
    cause = str(text).replace("|", "/")
    return cause if len(cause) <= CAUSE_CHARS else cause[:CAUSE_CHARS] + "..."


def _tput(tp: Record, rate: float) -> str:
    return f"{rate:,.1f} ({tp['num_prompts']} x {tp['input_len']} / {tp['output_len']})"


def _kv(kv: Record) -> str:
    if "error" in kv:
        return "not measured: " + _clip(kv["error"])
    return f"{kv['allocated_gib']:.2f} GiB at {kv['context']:,} ({kv['allocated_ratio']:.3f})"


MODEL_CELLS: list[tuple[str, Callable[[Record], str]]] = [
    ("batch 1: ms per output token", lambda r: f"{r['batch1_decode_ms_per_token']:.3f}"),
    ("throughput: output tok/s", lambda r: _tput(r["throughput"], r["throughput"]["output_tok_s"])),
    ("KV per sequence (ratio to every layer keeping the context)", lambda r: _kv(r["kv_per_sequence"])),
]
HYBRID_CELLS: list[tuple[tuple[str, bool | None], str, Callable[[Record], str]]] = [
    (("batch1_decode", None), "batch 1: ms per output token",
     lambda r: f"{r['tpot_ms']:.3f} ({r['input_len']} in / {r['output_len']} out)"),
    (("throughput", None), "throughput: output tok/s", lambda r: _tput(r, r["output_tok_s"])),
    (("multi_turn_ttft", False), "second turn sharing 90%: TTFT ms, no prefix caching",
     lambda r: f"{r['mean_ttft_ms']:,.1f} ({r['turn_len']:,} tokens)"),
    (("multi_turn_ttft", True), "the same with prefix caching (state snapshots)",
     lambda r: f"{r['mean_ttft_ms']:,.1f} ({r['prefix_hit_tokens']:,} tokens reused)"),
]


def cell(record: Record | None, show: Callable[[Record], str]) -> str:
    if record is None:
        return "-"
    if "error" in record:
        return "not run: " + _clip(record.get("cause") or record["error"])
    try:
        return show(record)
    except (KeyError, TypeError, ValueError):
        return "-"


def model_rows(out: Path) -> list[Row]:
    ours = {r["model"]: r for r in records(out / "models.jsonl") if "model" in r}
    peer = {r["model"]: r for f in PEER_MODEL_FILES for r in records(out / f) if "model" in r}
    names = list(ours) + [n for n in peer if n not in ours]
    return [(f"{name}, {label}", cell(ours.get(name), show), cell(peer.get(name), show))
            for name in names for label, show in MODEL_CELLS]


def by_metric(items: list[Record]) -> dict[tuple[str, bool | None], Record]:
    """Records by (metric, snapshots); a failed phase's record stands for each metric the phase reports."""
    out: dict[tuple[str, bool | None], Record] = {}
    for r in items:
        keys = PHASE_METRICS.get(r.get("phase", ""), ()) if "error" in r else ((r.get("metric"), r.get("snapshots")),)
        out.update({key: r for key in keys})
    return out


def hybrid_rows(out: Path) -> list[Row]:
    ours_list, peer_list = records(out / "hybrid.json"), records(out / "peer_hybrid.json")
    if not ours_list and not peer_list:
        return []
    layers = next((r["layers"] for r in ours_list + peer_list if "layers" in r), "?")
    ours, peer = by_metric(ours_list), by_metric(peer_list)
    return [(f"Qwen3-Next shape, {layers} layers, {label}", cell(ours.get(key), show), cell(peer.get(key), show))
            for key, label, show in HYBRID_CELLS]


def family_rows(out: Path) -> list[Row]:
    return model_rows(out) + hybrid_rows(out)
