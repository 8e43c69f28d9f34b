"""models/config_json.py: config.json read without transformers gives every attribute AutoConfig gives, and anything
it does not cover goes to transformers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, GenerationConfig

from appliance.bench.presets import SHAPES
from appliance.config import resolve_model_path
from appliance.executor.model_loader import load_hf_config
from appliance.models.config_json import (
    GENERATION_KEYS,
    ConfigJson,
    config_from_dict,
    read_config_json,
)

MISSING = object()

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96, "intermediate_size": 160,
         "num_hidden_layers": 3, "num_attention_heads": 6, "vocab_size": 300, "max_position_embeddings": 512}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200}

# configs this reader covers: each must come out as transformers builds it
COVERED: dict[str, dict[str, Any]] = {
    "default model": json.loads((Path(resolve_model_path(None)) / "config.json").read_text()),
    "llama-3.1-8b": SHAPES["llama-3.1-8b"],
    "qwen3-0.6b": SHAPES["qwen3-0.6b"],
    "llama bare (head_dim, KV heads, dtype derived)": LLAMA,
    "llama with generation keys and extras": {**LLAMA, "max_length": 20, "temperature": 0.7, "use_cache": False,
                                              "my_key": [1, 2], "rope_theta": 25000, "torch_dtype": "float16",
                                              "_commit_hash": "abc", "eos_token_id": [2, 7], "pad_token_id": None},
    "llama linear rope by its old name": {**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama yarn": {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "dtype": "bfloat16"},
    "llama dynamic rope, old name": {**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "llama partial rotary": {**LLAMA, "partial_rotary_factor": 0.5, "rope_theta": 1e6},
    "llama fp8 checkpoint": {**LLAMA, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                               "weight_block_size": [128, 128]}},
    "eagle-3 head": {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                     "draft_vocab_size": 100, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}},
    "mistral sliding": {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                        "num_key_value_heads": 2},
    "mistral no window": {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                          "sliding_window": None, "head_dim": 32},
    "qwen2 bare": QWEN2,
    "qwen2 sliding upper layers": {**QWEN2, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
    "qwen2 window off": {**QWEN2, "sliding_window": 64, "attention_dropout": 0},
    "qwen2 layer types given": {**QWEN2, "use_sliding_window": True, "sliding_window": 64,
                                "layer_types": ["full_attention", "sliding_attention"] * 2},
    "llama layer types": {**LLAMA, "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                          "sliding_window": 128},
    "qwen3 int theta, null scaling": {**SHAPES["qwen3-0.6b"], "rope_theta": 1000000, "rope_scaling": None,
                                      "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28},
}

# configs it leaves to transformers
UNCOVERED: dict[str, dict[str, Any]] = {
    "unlisted type": SHAPES["deepseek-v2-lite"],
    "remote code": {**LLAMA, "auto_map": {"AutoConfig": "x.Config"}},
    "float for an int field": {**LLAMA, "hidden_size": 96.0},
    "int for a float field": {**LLAMA, "rms_norm_eps": 1},
    "bool for an int field": {**LLAMA, "num_key_value_heads": True},
    "heads do not divide": {**LLAMA, "num_attention_heads": 5},
    "rope type not checked": {**LLAMA, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}},
    "rope lacks a required key": {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    "per-layer rope": {**LLAMA, "rope_parameters": {"full_attention": {"rope_type": "default"}}},
    "labels": {**LLAMA, "id2label": {"0": "a"}},
    "unknown dtype": {**LLAMA, "torch_dtype": "auto"},
    "bad layer types": {**QWEN2, "layer_types": ["attention"] * 4},
    "llama legacy layer types": {**LLAMA, "layer_types": ["attention"] * 3},
    "llama layer types of another length": {**LLAMA, "layer_types": ["full_attention"] * 2},
    "special float": {**LLAMA, "rms_norm_eps": {"__float__": "NaN"}},
    "no model type": {k: v for k, v in LLAMA.items() if k != "model_type"},
}


def attributes(cfg: Any) -> dict[str, Any]:
    """Every public attribute a config holds or serializes (to_dict adds properties such as output_attentions)."""
    keys = {k for k in [*vars(cfg), *cfg.to_dict()] if not k.startswith("_")}
    return {k: getattr(cfg, k, MISSING) for k in sorted(keys)}


def assert_same(ours: ConfigJson, theirs: Any) -> None:
    """The same attribute names, each with an equal value of the same type."""
    want, got = attributes(theirs), attributes(ours)
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for key, value in want.items():
        assert got[key] == value and type(got[key]) is type(value), (key, got[key], value)


def write(tmp_path: Path, raw: dict[str, Any]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("name", list(COVERED))
def test_covered_configs_equal_transformers(name: str, tmp_path: Path) -> None:
    model_dir = write(tmp_path, COVERED[name])
    ours = read_config_json(model_dir)
    assert isinstance(ours, ConfigJson), name
    assert_same(ours, AutoConfig.from_pretrained(str(model_dir), local_files_only=True))


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_configs_transformers_saved_equal_transformers(arch: str, make_tiny_model: Any) -> None:
    """config.json as transformers 5 writes it (save_pretrained of the test models: rope_parameters, dtype,
    layer_types already in their new shape)."""
    model_dir = make_tiny_model(arch)
    ours = read_config_json(model_dir)
    assert isinstance(ours, ConfigJson)
    assert_same(ours, AutoConfig.from_pretrained(str(model_dir), local_files_only=True))


@pytest.mark.parametrize("name", list(UNCOVERED))
def test_uncovered_configs_go_to_transformers(name: str) -> None:
    assert config_from_dict(json.loads(json.dumps(UNCOVERED[name]))) is None


@pytest.mark.parametrize("name", ["float for an int field", "heads do not divide", "rope lacks a required key"])
def test_what_transformers_refuses_is_still_refused(name: str, tmp_path: Path) -> None:
    model_dir = write(tmp_path, UNCOVERED[name])
    with pytest.raises(Exception):  # noqa: B017 - transformers' own error types (strict dataclass, KeyError)
        load_hf_config(model_dir)


def test_generation_keys_match_transformers() -> None:
    assert GENERATION_KEYS == frozenset(GenerationConfig._get_default_generation_params())


def test_load_hf_config_takes_the_json_path_and_applies_overrides(tmp_path: Path) -> None:
    model_dir = write(tmp_path, SHAPES["llama-3.1-8b"])
    cfg = load_hf_config(model_dir, {"max_position_embeddings": 4096, "rope_parameters": {"factor": 4.0}})
    assert isinstance(cfg, ConfigJson)
    assert cfg.max_position_embeddings == 4096
    assert cfg.rope_parameters["factor"] == 4.0 and cfg.rope_parameters["rope_type"] == "llama3"  # merged
    theirs = load_hf_config(model_dir, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert not isinstance(theirs, ConfigJson)  # a property setter's key: transformers applies it
    assert theirs.rope_parameters["rope_type"] == "linear"


def test_remote_code_and_unlisted_types_go_through_transformers(tmp_path: Path) -> None:
    model_dir = write(tmp_path, {**QWEN2, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]})
    assert not isinstance(load_hf_config(model_dir), ConfigJson)
    assert isinstance(load_hf_config(write(tmp_path / "b", QWEN2)), ConfigJson)
    # remote code is only run for a config that names it (auto_map, which this reader leaves to transformers)
    assert isinstance(load_hf_config(write(tmp_path / "c", QWEN2), trust_remote_code=True), ConfigJson)

