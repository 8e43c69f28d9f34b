"""Cross-field checks, checks against the model's config.json, and the list of unsupported settings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from appliance.config import UNSUPPORTED, ConfigError, build_config, check_supported
from appliance.config.loader import resolve


def problems(**kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build_config(env={}, **kw)
    return [f"{p.path}: {p.message}" for p in info.value.problems]


@pytest.mark.parametrize("dotlist,path", [
    (["parallelism.tp=2", "parallelism.world_size=4"], "parallelism.world_size"),
    (["parallelism.tp=4", "parallelism.enable_expert_parallel=true", "parallelism.ep=3"], "parallelism.ep"),
    (["parallelism.ep=2"], "parallelism.ep"),  # ep without enable_expert_parallel
    (["parallelism.tp=4", "parallelism.dense_tp=3"], "parallelism.dense_tp"),
    (["parallelism.tp=2", "parallelism.nnodes=2", "parallelism.node_rank=2",
      "parallelism.dist_init_addr=h:1"], "parallelism.node_rank"),
    (["parallelism.tp=4", "parallelism.nnodes=2", "parallelism.nprocs_per_node=3",
      "parallelism.dist_init_addr=h:1"], "parallelism.nprocs_per_node"),
    (["parallelism.tp=2", "parallelism.nnodes=2"], "parallelism.dist_init_addr"),
    (["speculative.algorithm=EAGLE3"], "speculative.draft_model_path"),
    (["speculative.algorithm=MTP", "speculative.draft_model_path=x"], "speculative.draft_model_path"),
    (["speculative.num_steps=2"], "speculative.num_steps"),  # settings without an algorithm
    (["speculative.algorithm=MTP", "speculative.num_steps=1", "speculative.num_draft_tokens=5"],
     "speculative.num_draft_tokens"),
    (["scheduler.chunked_prefill_size=8"], "scheduler.chunked_prefill_size"),
    (["cache.max_total_tokens=8"], "cache.max_total_tokens"),
    (["cache.ssm_checkpoint_interval=24"], "cache.ssm_checkpoint_interval"),  # block_size 16
])
def test_inconsistent_settings_are_errors(dotlist: list[str], path: str) -> None:
    found = problems(dotlist=dotlist)
    assert any(p.startswith(path + ":") for p in found), found


def test_consistent_settings_pass() -> None:
    c = build_config(dotlist=["parallelism.tp=4", "parallelism.dp=2", "parallelism.enable_expert_parallel=true",
                              "scheduler.chunked_prefill_size=-1", "speculative.algorithm=EAGLE3",
                              "speculative.draft_model_path=d", "parallelism.nnodes=2",
                              "parallelism.dist_init_addr=10.0.0.1:5000"], env={})
    assert c.parallelism.effective_ep == 8 and c.parallelism.effective_world_size == 8


def model_dir(tmp_path: Path, **cfg) -> str:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    base = {"num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096}
    (d / "config.json").write_text(json.dumps({**base, **cfg}))
    return str(d)


def test_model_config_heads_and_length(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    assert build_config(flat={"model": path, "tp": 8, "max_model_len": 4096}, env={}).parallelism.tp == 8
    found = problems(flat={"model": path, "tp": 3})
    assert any("32 attention heads are not divisible by tp 3" in p for p in found)
    assert build_config(flat={"model": path, "tp": 16}, env={}).parallelism.tp == 16  # KV heads replicated
    found = problems(flat={"model": path, "max_model_len": 8192})
    assert any(p.startswith("model.max_model_len") and "4096" in p for p in found)
    ok = build_config(flat={"model": path, "max_model_len": 8192,
                            "hf_overrides": {"max_position_embeddings": 8192}}, env={})
    assert ok.model.max_model_len == 8192  # overridden on purpose


def test_model_config_kv_heads(tmp_path: Path) -> None:
    path = model_dir(tmp_path, num_attention_heads=24, num_key_value_heads=6)
    found = problems(flat={"model": path, "tp": 4})
    assert any(p.startswith("parallelism.tp") and "6 KV heads" in p for p in found)
    assert build_config(flat={"model": path, "tp": 3}, env={}).parallelism.tp == 3


def test_model_config_experts(tmp_path: Path) -> None:
    path = model_dir(tmp_path, num_experts=6)
    found = problems(flat={"model": path, "tp": 4, "enable_expert_parallel": True})
    assert any(p.startswith("parallelism.ep") and "6 experts" in p for p in found)
    dense = model_dir(tmp_path)  # rewrites without experts
    r = resolve(None, flat={"model": dense, "tp": 2, "enable_expert_parallel": True}, env={})
    assert any(w.path == "parallelism.enable_expert_parallel" and "no MoE" in w.message for w in r.warnings)


def test_unreadable_model_skips_model_checks() -> None:
    assert build_config(flat={"model": "org/not-local", "tp": 3}, env={}).parallelism.tp == 3


def test_unsupported_settings_are_warnings_and_start_up_errors(tmp_path: Path) -> None:
    f = tmp_path / "spec.toml"
    f.write_text('[speculative]\nalgorithm = "DFLASH"\ndraft_model_path = "d"\n')
    r = resolve(f, env={})
    assert [w.where for w in r.warnings] == [f"{f}:2"]
    assert [w.path for w in r.warnings] == ["speculative.algorithm"]
    assert check_supported(r.config) == [
        ("speculative.algorithm: DFLASH and DSPARK drafting are not supported in this build; EAGLE, EAGLE3, "
         "STANDALONE, NGRAM and MTP are (remove the setting or use its default)")]
    assert check_supported(build_config(env={})) == []
    for algorithm in ("MTP", "NGRAM"):  # the algorithms that run pass the start-up gate
        ok = build_config(flat={"speculative_algorithm": algorithm, "speculative_num_steps": 2}, env={})
        assert check_supported(ok) == []
    paths = [u.path for u in UNSUPPORTED]
    assert "precision.quantization" in paths and "parallelism.enable_expert_parallel" in paths


@pytest.mark.parametrize("backend, refused", [("auto", False), ("torch", False), ("greedy", True),
                                              ("flashinfer", True), ("flashinfer_full", True)])
def test_sampling_backends_the_executor_cannot_run_are_refused_at_start_up(backend: str, refused: bool) -> None:
    """The start-up check and the executor's own check agree on which sampling backends exist."""
    from appliance.executor.runner_setup import _check_supported

    cfg = build_config(flat={"sampling_backend": backend}, env={})
    assert cfg.backends.sampling == backend
    assert any(m.startswith("backends.sampling:") for m in check_supported(cfg)) == refused
    if refused:
        with pytest.raises(ValueError, match="backends.sampling"):
            _check_supported(cfg, torch.device("cpu"))
    else:
        _check_supported(cfg, torch.device("cpu"))

