"""benchmarks/models.py --quick: the gpt-oss and Gemma 3 measurements run end to end on tiny CPU shapes."""
from __future__ import annotations

import pytest


def test_quick_run_measures_every_model() -> None:
    from benchmarks import models

    results = models.main(["--quick"])
    assert [r["model"] for r in results] == list(models.QUICK_MODELS)
    for r in results:
        kv = r["kv_per_sequence"]
        # two tiny layers, one of each kind: 64 tokens are 4 blocks of 16; the window of 8 keys spans at most 2
        assert kv["layers"] == 2 and kv["sliding_layers"] == 1
        assert kv["block_size"] == 16 and kv["kv_groups"]  # the CPU runs eagerly: the sliding layer has its pool
        assert kv["blocks_per_sequence"] == {"full": 4, "window_8": 2}
        assert kv["group_blocks"] == {"full": {"layers": 1, "blocks": 4}, "window_8": {"layers": 1, "blocks": 2}}
        assert kv["allocated_gib"] == kv["window_share_gib"]
        assert kv["ratio"] == kv["allocated_ratio"] == pytest.approx((4 + 2) / (2 * 4))
        # 24 + 8 tokens: 2 blocks in either group (the window's 8 keys span at most 2), from the one pool both
        # groups share (one layer each), less its null block
        pools = r["kv_pools"]
        assert pools["tokens"] == 32 and set(pools["pools"]) == {"shared"}
        shared = pools["pools"]["shared"]
        assert shared["groups"] == 2 and pools["sequences"] == shared["sequences"] == (shared["blocks"] - 1) // 4
        assert pools["sequences"] >= 8  # the CPU pool fits the batch
        assert r["batch1_decode_ms_per_token"] > 0
        tp = r["throughput"]
        assert tp["output_tok_s"] == pytest.approx(tp["num_prompts"] * tp["output_len"] / tp["seconds"])


def test_each_child_process_measures_one_model() -> None:
    """Several --only choices run one process each, given that model alone (not the parent's list again)."""
    from benchmarks import models

    argv = ["--only", "gpt-oss-20b", "--num-prompts", "32", "--only=gpt-oss-20b-mxfp4", "--output-len", "128"]
    assert models.without_only(argv) == ["--num-prompts", "32", "--output-len", "128"]
