"""The schema itself: contract names, defaults from the seeds, precise types and ranges, immutability."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from appliance.config import ApplianceConfig
from appliance.config.flags import flag_specs, flag_table

# docs/architecture.md "Config: sections and keys": the names every other layer reads.
CONTRACT = {
    "model": "path tokenizer tokenizer_mode skip_tokenizer_init load_format trust_remote_code revision "
             "download_dir hf_overrides max_model_len seed device",
    "precision": "dtype kv_cache_dtype kv_cache_quant_method kv_cache_calibration_tokens quantization "
                 "quantization_param_path",
    "parallelism": "tp dense_tp moe_tp dp pp dcp enable_expert_parallel ep world_size nprocs_per_node nnodes "
                   "node_rank dist_init_addr",
    "scheduler": "max_num_seqs chunked_prefill_size max_prefill_tokens max_queued_requests policy slo_tbt_ms",
    "cache": "block_size gpu_memory_utilization max_total_tokens enable_prefix_caching host_cache host_cache_ratio "
             "host_cache_size_gb disk_cache ssm_cache_slots ssm_checkpoint_interval",
    "backends": "attention drafter_attention moe draft_moe linear all2all deepep_mode sampling enforce_eager "
                "cuda_graph_max_bs cuda_graph_sizes",
    "speculative": "algorithm draft_model_path draft_model_quantization num_steps num_draft_tokens eagle_topk "
                   "prompt_lookup_min prompt_lookup_max eagle3_layers_to_capture",
    "api": "host port served_model_name api_key api_key_file chat_template stream_interval stream_output "
           "request_timeout reasoning_parser tool_call_parser enable_custom_logit_processor disable_thinking "
           "thinking_budget allowed_hosts caps",
    "multimodal": "encoder_tp_mode encoder_attention processor_cache_gb processor_cache_type limit_per_prompt "
                  "processor_kwargs media_io_kwargs allowed_local_media_path",
    "sampling": "temperature top_p top_k min_p top_n_sigma repetition_penalty",
    "observability": "log_level log_level_http enable_log_requests log_requests_level enable_metrics "
                     "metrics_reporters decode_log_interval enable_cache_report kv_events dump_path",
}


def test_contract_sections_and_keys_exist() -> None:
    cfg = ApplianceConfig()
    assert set(ApplianceConfig.model_fields) == set(CONTRACT)
    for section, keys in CONTRACT.items():
        sub = getattr(cfg, section)
        missing = [k for k in keys.split() if k not in type(sub).model_fields]
        assert not missing, f"{section} lacks {missing}"
    assert set(type(cfg.api.caps).model_fields) == {"max_n", "max_logprobs", "max_tokens", "max_stop",
                                                     "max_body_bytes"}
    kv = type(cfg.observability.kv_events).model_fields
    for key in ("enable_kv_cache_events", "publisher", "endpoint", "topic", "replay_endpoint", "buffer_steps"):
        assert key in kv


def test_defaults_follow_the_seeds() -> None:
    cfg = ApplianceConfig()
    assert cfg.model.path is None  # the embedded default model
    assert cfg.scheduler.chunked_prefill_size == 8192
    assert cfg.scheduler.max_prefill_tokens == 8192
    assert cfg.scheduler.max_num_seqs == 256
    assert cfg.cache.block_size == 16
    assert cfg.api.host == "127.0.0.1" and cfg.api.port == 8000
    assert cfg.backends.attention == "auto"
    assert cfg.speculative.algorithm is None and cfg.speculative.num_steps == 3
    assert cfg.speculative.effective_num_draft_tokens == 4  # num_steps + 1
    assert cfg.speculative.eagle_topk == 1 and cfg.speculative.draft_model_quantization == "unquant"
    assert cfg.scheduler.policy == "fcfs"
    assert cfg.parallelism.effective_world_size == 1 and cfg.parallelism.effective_ep == 1


@pytest.mark.parametrize("section,data", [
    ("precision", {"dtype": "fp7"}),
    ("cache", {"gpu_memory_utilization": 0.0}),
    ("cache", {"gpu_memory_utilization": 1.01}),
    ("cache", {"block_size": 24}),
    ("scheduler", {"chunked_prefill_size": 0}),
    ("scheduler", {"chunked_prefill_size": -2}),
    ("scheduler", {"policy": "random"}),
    ("api", {"port": 70000}),
    ("api", {"tool_call_parser": "no pe"}),  # any engine's parser name is accepted, not any text
    ("backends", {"attention": "cu/dnn"}),
    ("observability", {"kv_events": {"publisher": "kafka"}}),
    ("model", {"pathh": "x"}),
    ("parallelism", {"tp": 0}),
    ("parallelism", {"tp": "two"}),
])
def test_bad_values_are_rejected_with_their_key(section: str, data: dict) -> None:
    with pytest.raises(ValidationError) as info:
        ApplianceConfig.model_validate({section: data})
    locs = [e["loc"] for e in info.value.errors()]
    assert any(loc[0] == section for loc in locs)


def test_aliases_normalise() -> None:
    cfg = ApplianceConfig.model_validate({
        "precision": {"dtype": "half"}, "speculative": {"algorithm": "mtp"},
        "scheduler": {"policy": "fifo"}, "observability": {"log_level": "DEBUG"}})
    assert cfg.precision.dtype == "float16"
    assert cfg.speculative.algorithm == "MTP"
    assert cfg.scheduler.policy == "fcfs"
    assert cfg.observability.log_level == "debug"


def test_sections_are_frozen_and_hashable() -> None:
    cfg = ApplianceConfig()
    with pytest.raises(ValidationError):
        cfg.parallelism.tp = 4  # type: ignore[misc]
    other = ApplianceConfig.model_validate({"model": {"hf_overrides": {"a": 1}}})
    assert len({cfg, ApplianceConfig(), other}) == 2
    assert hash(other.model) == hash(ApplianceConfig.model_validate({"model": {"hf_overrides": {"a": 1}}}).model)


def test_direct_construction_runs_cross_checks() -> None:
    with pytest.raises(ValidationError, match="parallelism.world_size"):
        ApplianceConfig.model_validate({"parallelism": {"tp": 2, "world_size": 3}})
    assert ApplianceConfig.model_validate({"parallelism": {"tp": 2, "world_size": 2}}).parallelism.tp == 2


def test_flag_table_is_unique_and_points_at_real_fields() -> None:
    specs = flag_specs()  # raises on a duplicate flag
    table = flag_table()
    assert table["--tp"].path == table["--tensor-parallel-size"].path == table["--attn-tp-size"].path \
        == ("parallelism", "tp")
    assert table["--gpu-memory-utilization"].path == ("cache", "gpu_memory_utilization")
    assert table["--kv-events-config"].kind == "json" and table["--kv-events-config"].path == \
        ("observability", "kv_events")
    assert table["--speculative-config"].path == ("speculative",)
    assert table["--hf-overrides"].path == ("model", "hf_overrides")
    assert table["--max-cudagraph-capture-size"].path == ("backends", "cuda_graph_max_bs")
    for spec in specs:
        node: object = ApplianceConfig()
        for key in spec.path:
            node = getattr(node, key)  # every flag lands in an existing field


def test_dump_and_validate_round_trip() -> None:
    cfg = ApplianceConfig.model_validate({
        "model": {"path": "/m", "hf_overrides": {"rope_theta": 5.0}},
        "parallelism": {"tp": 2, "dp": 2, "enable_expert_parallel": True},
        "speculative": {"algorithm": "EAGLE3", "draft_model_path": "/d", "eagle3_layers_to_capture": [1, 2]},
        "observability": {"kv_events": {"enable_kv_cache_events": True, "publisher": "zmq"}},
    })
    again = ApplianceConfig.model_validate(cfg.model_dump(mode="json"))
    assert again == cfg and again.parallelism.effective_ep == 4


def test_engine_names_are_kept_and_refused_at_start_up() -> None:
    """Parser and backend names: every source engine's spelling is accepted (`-` read as `_`, any case), so a
    translated deployment keeps it; check_supported (start-up) refuses the ones this build lacks."""
    from appliance.config import check_supported

    cfg = ApplianceConfig.model_validate({"api": {"tool_call_parser": "Seed-OSS"},
                                          "backends": {"attention": "ROCM_AITER_FA", "moe": "deep_gemm"}})
    assert (cfg.api.tool_call_parser, cfg.backends.attention) == ("seed_oss", "rocm_aiter_fa")
    refused = {m.split(":")[0] for m in check_supported(cfg)}
    assert refused == {"api.tool_call_parser", "backends.attention", "backends.moe"}
    ok = ApplianceConfig.model_validate({"api": {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
                                         "backends": {"attention": "triton"}})
    assert check_supported(ok) == []
