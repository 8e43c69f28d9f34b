"""benchmarks/deepseek_v3.py's pure parts: the model dir it writes (V3 shape, block-fp8 quantization_config, layer
count, a tokenizer of exactly vocab_size ids), the recipe overrides it passes (MTP off / on resolve and are
supported), the acceptance figures, the table and argument validation. The end-to-end run (`python -m
benchmarks.deepseek_v3 --smoke`) is too slow for CI."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from appliance.config import build_config, check_supported
from appliance.layers.fp8 import FP8_DTYPE, Fp8BlockConfig
from benchmarks import deepseek_v3 as bv


def test_model_config_is_the_v3_shape_with_fp8_blocks_and_the_asked_layers() -> None:
    cfg = bv.model_config(61)
    want = {"vocab_size": 129280, "hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
            "num_experts_per_tok": 8, "num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 3,
            "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "max_position_embeddings": 163840}
    assert {k: cfg[k] for k in want} == want
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["quantization_config"]["fmt"] == "e4m3"
    assert Fp8BlockConfig.from_hf(transformers.DeepseekV3Config(**cfg)) == Fp8BlockConfig(128, 128)
    reduced = bv.model_config(4)
    assert reduced["num_hidden_layers"] - reduced["first_k_dense_replace"] == 1  # one MoE layer
    assert {k: v for k, v in reduced.items() if k != "num_hidden_layers"} == \
        {k: v for k, v in cfg.items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match="layers must be >= 1"):
        bv.model_config(0)


def _build(cfg: Any, tp: int, meta: bool) -> torch.nn.Module:
    """The model our loader builds for cfg, as rank 0 of a tp group (a stand-in group: building never talks)."""
    import appliance.layers.parallel_state as ps
    from appliance.models.registry import model_class

    saved, previous = ps._STATE, torch.get_default_dtype()
    ps._STATE = ps.TensorParallelState(0, tp, object()) if tp > 1 else saved
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta" if meta else "cpu"):
            return model_class(cfg)(cfg, backend="torch", moe_backend="torch")
    finally:
        ps._STATE = saved
        torch.set_default_dtype(previous)


def test_smoke_dir_builds_fp8_experts_and_fits_whole_tiles_at_tp_2(tmp_path: Path) -> None:
    path = bv.write_model_dir(tmp_path / "v3", 2, smoke=True)
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    assert cfg.num_hidden_layers == 2 and cfg.first_k_dense_replace == 1 and cfg.num_nextn_predict_layers == 1
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == cfg.vocab_size and tok.eos_token_id == cfg.eos_token_id
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (cfg.bos_token_id, cfg.eos_token_id)
    model = _build(cfg, 2, meta=False)  # the fp8 layers refuse a shard that splits a 128-wide tile
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == FP8_DTYPE
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    assert len(model.mtp) == 1


@pytest.mark.parametrize("tp", [2, 8])
def test_reduced_and_full_shapes_split_into_whole_tiles(tp: int) -> None:
    model = _build(transformers.DeepseekV3Config(**bv.model_config(4)), tp, meta=True)
    assert model.model.layers[3].mlp.experts.w13_weight.dtype == FP8_DTYPE


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bv.write_model_dir(tmp_path_factory.mktemp("v3") / "model", 2, smoke=True)


@pytest.mark.parametrize("mtp", [False, True])
def test_overrides_resolve_on_the_recipe_and_are_supported(smoke_dir: Path, mtp: bool) -> None:
    sets = bv.overrides(smoke_dir, 8123, mtp, tp=2, smoke=True, extra=("cache.max_total_tokens=2048",))
    config = build_config(bv.RECIPE, dotlist=sets)
    assert check_supported(config) == []
    assert config.speculative.algorithm == ("MTP" if mtp else None)
    assert config.model.path == str(smoke_dir) and config.model.load_format == "dummy"
    assert config.parallelism.tp == 2 and config.parallelism.enable_expert_parallel  # the recipe's ep stays
    assert config.precision.quantization == "fp8" and config.api.port == 8123
    assert config.cache.max_total_tokens == 2048  # the user's --set wins over the bench's
    argv = bv.server_argv(sets)
    assert argv[3:5] == ["run", str(bv.RECIPE)] and argv.count("--set") == len(sets)


def test_full_run_keeps_the_recipes_tp_and_device(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(bv.model_config(4)))  # the config is what is checked
    sets = bv.overrides(tmp_path, 8000, True, tp=None, smoke=False)
    assert not any(s.startswith(("parallelism.", "model.device", "cache.")) for s in sets)
    assert build_config(bv.RECIPE, dotlist=sets).parallelism.tp == 8


def test_acceptance_is_computed_from_counter_deltas() -> None:
    before = {"spec_num_drafts": 10, "spec_num_draft_tokens": 10, "spec_num_accepted_tokens": 4}
    after = {"spec_num_drafts": 110, "spec_num_draft_tokens": 110, "spec_num_accepted_tokens": 64}
    got = bv.acceptance(before, after)
    assert got["spec_num_drafts"] == 100 and got["acceptance_rate"] == 0.6 and got["mean_accepted_length"] == 1.6
    none = bv.acceptance(before, before)
    assert none["acceptance_rate"] is None and none["mean_accepted_length"] is None


def _level(itl: tuple[float, float, float], tput: float, failed: int = 0) -> dict[str, Any]:
    return {"mean_itl_ms": itl[0], "median_itl_ms": itl[1], "p99_itl_ms": itl[2], "mean_tpot_ms": 9.876,
            "mean_ttft_ms": 123.45, "output_throughput": tput, "concurrency": 256, "failed": failed}


def test_table_has_one_row_per_mode_with_the_figures() -> None:
    ok = {"mode": "on", "status": "ok", "start_s": 412.5, "memory": {"kind": "GPU memory.used",
                                                                       "mib": [71900.0, 72100.0] * 4},
          "batch1": _level((12.3456, 11.0, 30.5), 0.0), "throughput": _level((1, 1, 1), 5123.44, failed=2),
          "spec": {"acceptance_rate": 0.0123, "mean_accepted_length": 1.0123}}
    bad = {"mode": "off", "status": "TimeoutError: /health not 200 within 1800 s", "memory": None}
    lines = bv.format_table([bad, ok]).splitlines()
    assert len(lines) == 4 and all(c in lines[0] for c in bv.COLUMNS)
    off, on = (list(map(str.strip, ln.split(" | "))) for ln in lines[2:])
    assert on == ["MTP on", "412.5", "70.2-70.4 GiB x8", "12.35 / 11.0 / 30.5", "9.88", "123.5",
                  "5123.4 @256 (2 FAILED)", "0.012", "1.012"]
    assert off[0] == "MTP off (FAILED)" and off[1:3] == ["-", "-"] and off[-1] == "-"
    assert bv.table_row({"mode": "on", "status": "interrupted"})[0] == "MTP on (interrupted)"
    rss = bv._fmt_memory({"kind": "worker RSS", "mib": [512.0, 512.0]})
    assert rss == "0.5 GiB x2 RSS"


def test_memory_is_read_on_the_workers_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bv.serving_gpus(2, None) == [0, 1]
    assert bv.serving_gpus(2, "4,5,6") == [4, 5]  # nvidia-smi numbers every GPU of the host
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(bv, "gpu_memory_mib", lambda: [70000.0, 71000.0, 5.0, 5.0])
    got = bv.memory(0, smoke=False, tp=2)
    assert got["mib"] == [70000.0, 71000.0] and len(got["mib_every_gpu"]) == 4
    monkeypatch.setattr(bv, "gpu_memory_mib", lambda: None)
    assert bv._fmt_memory(bv.memory(0, smoke=False, tp=8)) == "-"


def test_arguments_defaults_and_validation() -> None:
    real = bv.parse_args([])
    assert (real.layers, real.tp, real.num_prompts, real.concurrency, real.input_len, real.output_len) == \
        (61, None, 256, 256, 1024, 1024)
    assert (real.batch1_prompts, real.batch1_in, real.batch1_out, real.modes) == (4, 1024, 256, ["off", "on"])
    smoke = bv.parse_args(["--smoke", "--num-prompts", "3"])
    assert (smoke.tp, smoke.layers, smoke.num_prompts) == (2, 2, 3) and smoke.input_len < 1024
    assert bv.parse_args(["--layers", "4", "--tp", "2", "--modes", "on"]).modes == ["on"]
    for bad in (["--layers", "3"], ["--layers", "62"], ["--tp", "0"], ["--num-prompts", "0"],
                ["--modes", "on,maybe"], ["--modes", "on,on"], ["--set", "novalue"], ["--smoke", "--output-len", "-1"]):
        with pytest.raises(SystemExit):
            bv.parse_args(bad)
