"""benchmarks/hybrid.py --quick on the CPU: every measurement is reported, and only the run with state snapshots
reuses the shared prefixes of the multi-turn workload."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import hybrid


def test_quick_run_reports_every_measurement() -> None:
    records = hybrid.main(["--quick"])
    by = {(r["metric"], r.get("snapshots")): r for r in records}
    assert set(by) == {("batch1_decode", None), ("throughput", None), ("multi_turn_ttft", False),
                       ("multi_turn_ttft", True)}
    assert by[("batch1_decode", None)]["tpot_ms"] > 0 and by[("throughput", None)]["output_tok_s"] > 0
    assert by[("multi_turn_ttft", False)]["prefix_hit_tokens"] == 0
    # each second turn restores the snapshot at 32 tokens (checkpoints every 16; its first turn had 41 tokens)
    assert by[("multi_turn_ttft", True)]["prefix_hit_tokens"] == 32 * by[("multi_turn_ttft", True)]["sessions"]
    assert all(r["layers"] == 4 for r in records)
    assert all(r["gated_delta"] == "torch" and r["decode_graphs"] is False for r in records)  # CPU: no fla, no graphs
    for snapshots, computed in ((False, 64), (True, 64 - 32)):  # the whole prompt, or what follows the snapshot
        turn = by[("multi_turn_ttft", snapshots)]
        assert len(turn["ttft_ms"]) == turn["sessions"] == 2 and turn["warmup_sessions"] == 1
        assert min(turn["ttft_ms"]) <= turn["median_ttft_ms"] <= max(turn["ttft_ms"]) and min(turn["ttft_ms"]) > 0
        assert turn["mean_ttft_ms"] == pytest.approx(sum(turn["ttft_ms"]) / 2, abs=1e-2)
        assert turn["computed_tokens"] == computed and turn["steps_to_first_token"] >= 1


def test_multi_turn_only_runs_the_two_ttft_phases(tmp_path: Path) -> None:
    records = hybrid.main(["--quick", "--multi-turn-only", "--sessions", "1", "--profile", str(tmp_path)])
    assert [(r["metric"], r["snapshots"]) for r in records] == [("multi_turn_ttft", False), ("multi_turn_ttft", True)]
    assert [r["prefix_hit_tokens"] for r in records] == [0, 32]  # the profiled session's hits are not counted
    for phase in ("plain", "snapshots"):  # the profiled second turn: its trace and its ops by self time
        assert json.loads((tmp_path / f"multi_turn_{phase}.trace.json").read_text())["traceEvents"]
        assert "Self CPU" in (tmp_path / f"multi_turn_{phase}.ops.txt").read_text()


def test_the_untimed_sessions_have_their_own_tokens() -> None:
    args = hybrid.parse_args(["--quick"])
    turns = hybrid.make_prompts(args, 512).turns
    for first, tail in (turns.warmup, turns.probe):
        assert len(first) == len(turns.firsts[0]) and len(tail) == len(turns.tails[0])
        assert all(first[:16] != f[:16] for f in turns.firsts)  # no prefix of a timed session is cached by it
    assert turns.warmup[0][:16] != turns.probe[0][:16]
