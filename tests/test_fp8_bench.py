"""benchmarks/fp8.py --quick: every section runs end to end on a tiny CPU model (the GPU figures come from the
same code without --quick: `python -m benchmarks.fp8`)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.fp8 import run


def test_quick_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    res = run(["--quick", "--output-json", str(out)])
    assert set(res) == {"throughput", "batch1", "capacity", "gemv", "producers", "qwen3"}
    t = res["throughput"]
    assert t["requests"] == 8 and t["output_tokens"] == 8 * t["output_len"] and t["output_tok_s"] > 0
    assert res["batch1"]["ms_per_token"] > 0
    cap = res["capacity"]  # --quick fixes the token budget (max_total_tokens), so blocks match; bytes halve
    assert cap["bytes_per_block_16bit"] == 2 * cap["bytes_per_block_fp8"]
    assert len(res["gemv"]) == 5 and all(v > 0 for k, v in res["gemv"].items() if k.endswith("_us"))
    assert all(res["producers"][f"{k}_us"] > 0 for k in ("norm_then_quant_act", "rms_norm_quant",
                                                          "silu_then_quant_act", "silu_and_mul_quant"))
    q = res["qwen3"]
    assert q["output_tok_s_auto"] > 0 and q["output_tok_s_fp8"] > 0 and q["fp8_over_16bit"] > 0
    assert json.loads(out.read_text()) == res
