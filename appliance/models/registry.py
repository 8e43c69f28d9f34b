"""HF `architectures` names -> model classes."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from appliance.models.deepseek import MODELS as DEEPSEEK_MODELS
from appliance.models.gemma3 import MODELS as GEMMA3_MODELS
from appliance.models.glm4_moe import MODELS as GLM4_MOE_MODELS
from appliance.models.gpt_oss import MODELS as GPT_OSS_MODELS
from appliance.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from appliance.models.minimax_m2 import MODELS as MINIMAX_M2_MODELS
from appliance.models.mixtral import MODELS as MIXTRAL_MODELS
from appliance.models.qwen3_next import MODELS as QWEN3_NEXT_MODELS
from appliance.models.qwen_moe import MODELS as QWEN_MOE_MODELS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    **MIXTRAL_MODELS,  # MixtralForCausalLM
    **QWEN_MOE_MODELS,  # Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
    **DEEPSEEK_MODELS,  # DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    **GEMMA3_MODELS,  # Gemma3ForCausalLM
    **GPT_OSS_MODELS,  # GptOssForCausalLM
    **GLM4_MOE_MODELS,  # Glm4MoeForCausalLM (GLM-4.5 / 4.6 / 4.7)
    **MINIMAX_M2_MODELS,  # MiniMaxM2ForCausalLM
    **QWEN3_NEXT_MODELS,  # Qwen3NextForCausalLM (hybrid linear attention)
}


def model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The class for the first supported name in config.architectures; a clear error otherwise."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in MODELS:
            return MODELS[name]
    raise ValueError(f"model architectures {names or '(none in config.json)'} are not supported; "
                     f"supported: {sorted(MODELS)}")
