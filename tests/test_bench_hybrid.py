"""benchmarks/hybrid.py --quick on the CPU: every measurement is reported, and only the run with state snapshots
reuses the shared prefixes of the multi-turn workload."""
from __future__ import annotations

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
