"""tools/bench_offline.py runs end to end on a tiny config and its presets are valid model shapes."""
from __future__ import annotations

import json

import pytest
from conftest import TOOLS, load_tool

_PATH = TOOLS / "bench_offline.py"


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_offline")


def test_bench_on_tiny_config(bench, make_tiny_model, tmp_path):
    cfg = make_tiny_model("qwen3") / "config.json"
    out_json = tmp_path / "r.json"
    res = bench.run(["--config-json", str(cfg), "--num-prompts", "5", "--input-len", "12", "--output-len", "4",
                     "--dtype", "float32", "--set", "max_total_tokens=1024", "--set", "max_num_seqs=3",
                     "--output-json", str(out_json)])
    assert res["num_requests"] == 5 and res["output_tokens"] == 20 and res["input_tokens"] == 60
    assert res["total_tokens_per_s"] > res["output_tokens_per_s"] > 0
    assert json.loads(out_json.read_text())["output_tokens"] == 20
    # 3 seats: two waves of 4 outputs at least; at most one step per token of each request alone
    assert 8 <= res["steps"] <= 5 * (12 + 4)


def test_bench_ranged_lengths(bench, make_tiny_model):
    res = bench.run(["--model", str(make_tiny_model("llama")), "--num-prompts", "6", "--input-len", "10",
                     "--output-len", "4", "--range-ratio", "0.5", "--set", "max_total_tokens=1024"])
    assert 6 * 5 <= res["input_tokens"] <= 6 * 15 and 6 * 2 <= res["output_tokens"] <= 6 * 6


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b"])
def test_presets_are_supported_shapes(bench, name, tmp_path):
    from transformers import AutoConfig

    from appliance.models.registry import model_class

    (tmp_path / "config.json").write_text(json.dumps(bench.PRESETS[name]))
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    assert model_class(cfg).__name__ == bench.PRESETS[name]["architectures"][0]
