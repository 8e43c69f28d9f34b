"""HF `architectures` names -> model classes.

Each model module is imported on first lookup, not here: a worker serving a Llama imports neither the MoE and MLA
layers nor their kernels (its start-up imports stay short). `ARCHITECTURES` names the module of every class; each
module's own `MODELS` holds the classes (tests/test_model_registry.py holds the two equal).
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

# architecture name -> the module (under appliance.models) whose MODELS holds its class
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen_moe",
    "Qwen3MoeForCausalLM": "qwen_moe",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe",  # GLM-4.5 / 4.6 / 4.7
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Qwen3NextForCausalLM": "qwen3_next",  # hybrid linear attention
    "Qwen3_5ForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_next",
}


class LazyModels(Mapping[str, "type[nn.Module]"]):
    """`ARCHITECTURES` as a mapping to the classes, importing a class' module when it is looked up."""

    def __getitem__(self, name: str) -> type[nn.Module]:
        module = importlib.import_module(f"appliance.models.{ARCHITECTURES[name]}")
        return module.MODELS[name]

    def __iter__(self) -> Iterator[str]:
        return iter(ARCHITECTURES)

    def __len__(self) -> int:
        return len(ARCHITECTURES)

    def __contains__(self, name: object) -> bool:
        return name in ARCHITECTURES


MODELS = LazyModels()


def model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The class for the first supported name in config.architectures; a clear error otherwise."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in MODELS:
            return MODELS[name]
    raise ValueError(f"model architectures {names or '(none in config.json)'} are not supported; "
                     f"supported: {sorted(MODELS)}")
