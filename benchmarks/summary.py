"""The table of benchmarks/gpu_suite.sh: ours beside the peer's for every workload whose JSON is in the folder.

    python -m benchmarks.summary OUT_DIR

Ours come from `appliance bench` JSON (--output-json / --result-filename), the peer's from the vLLM kit's
bench_vllm.py JSON and `appliance bench serve` against `vllm serve`. A missing file is a "-" cell. The model
families' rows (benchmarks/summary_families.py) follow for whatever models.jsonl / hybrid.json (ours) and
peer_models.json / peer_hybrid.json (benchmarks/peer_models.py) hold.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.summary_families import family_rows

Cell = Callable[[Path], str]


def _get(path: Path, *keys: str, digits: int = 1) -> str:
    """The number at keys in path's JSON, rounded; "-" when the file or a key is missing."""
    try:
        value: Any = json.loads(path.read_text())
        for key in keys:
            value = value[key]
    except (OSError, ValueError, KeyError, TypeError):
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, (int, float)) else str(value)


def _peer_8b(out: Path) -> str:
    """bench_vllm.py names its throughput entry after the prompt count (a_1000, a_256 ...)."""
    try:
        data = json.loads((out / "peer_8b.json").read_text())
    except (OSError, ValueError):
        return "-"
    runs = [v for k, v in data.items() if k.startswith("a_")]
    return f"{runs[-1]['out_tok_s']:,.1f} ({runs[-1]['reqs']} prompts)" if runs else "-"


def _serve(name: str, c: int) -> Cell:
    def cell(out: Path) -> str:
        f = out / f"{name}_c{c}.json"
        tput = _get(f, "output_throughput")
        return "-" if tput == "-" else (f"{tput} tok/s; TTFT {_get(f, 'median_ttft_ms')} ms, "
                                        f"TPOT {_get(f, 'median_tpot_ms', digits=2)} ms (p50); "
                                        f"ITL p99 {_get(f, 'p99_itl_ms')} ms")
    return cell


ROWS: list[tuple[str, Cell, Cell]] = [
    ("Llama-3.1-8B batch 1, 1024 in / 256 out: ms per output token",
     lambda o: _get(o / "b1.json", "mean_tpot_ms", digits=3), lambda o: _get(o / "peer_b1.json", "b_bs1", "itl_ms",
                                                                              digits=3)),
    ("Qwen3-0.6B 256 seqs, in/out U[100, 1024]: output tok/s",
     lambda o: _get(o / "qwen.json", "output_throughput"), lambda o: _get(o / "peer_qwen.json", "c_nano",
                                                                          "out_tok_s")),
    ("Llama-3.1-8B N x 1024 / 1024: output tok/s",
     lambda o: f"{_get(o / 'tput8b.json', 'output_throughput')} ({_get(o / 'tput8b.json', 'num_requests', digits=0)}"
               f" prompts); {_get(o / 'tput8b_640.json', 'output_throughput')} with chunked_prefill_size 640",
     _peer_8b),
    *[(f"serving 8B 1024 / 256, concurrency {c}", _serve("serve", c), _serve("peer_serve", c)) for c in (1, 16, 64, 256)],
    ("serving 8B cold start to /health 200 (ms)",
     lambda o: _get(o / "serve_start.json", "start_ms", digits=0),
     lambda o: _get(o / "peer_serve_start.json", "start_ms", digits=0)),
]


def table(out: Path) -> str:
    lines = ["| workload | appliance | vLLM 0.26 |", "| --- | --- | --- |"]
    lines += [f"| {name} | {ours(out)} | {peer(out)} |" for name, ours, peer in ROWS]
    lines += [f"| {name} | {ours} | {peer} |" for name, ours, peer in family_rows(out)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m benchmarks.summary OUT_DIR", file=sys.stderr)
        return 2
    print(table(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
