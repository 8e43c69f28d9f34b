"""A model's config.json read without transformers, for the dense model types whose transformers config class only
adds defaults and a few derived fields (llama, mistral, qwen2, qwen3).

Importing transformers' configuration machinery costs a worker seconds at start-up (configuration_utils imports
type_validators -> activations -> ... -> torch.distributed.tensor -> sympy; docs/benchmarks.md, "The worker's
imports and model config"), all to fill in defaults. `read_config_json` gives the same attributes and values as
`AutoConfig.from_pretrained` for these types: the class's field defaults, its __post_init__ (head_dim, KV heads,
sliding layers), the base class's (dtype, labels, rotary parameters in transformers 5's `rope_parameters` shape,
generation keys dropped). Anything it cannot vouch for returns None and goes through transformers, so every
config transformers would refuse is still refused with its own message: a model type not listed, remote code
(auto_map), a field of the wrong type (transformers' strict dataclasses reject them), rotary settings outside the
checked types, layer types other than full / sliding, encoded special floats, label or task fields.
tests/test_config_json.py holds every attribute equal to transformers' on a range of configs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

NONE = type(None)
INT, FLOAT, BOOL, STR = (int,), (float,), (bool,), (str,)
OPT_INT = (int, NONE)
TOKEN_ID = (int, list, NONE)  # eos_token_id: an id or a list of ids

# PreTrainedConfig's own fields (its label / task fields are not here: a config with them goes to transformers)
BASE_FIELDS: dict[str, tuple[Any, tuple[type, ...]]] = {
    "transformers_version": (None, (str, NONE)),
    "architectures": (None, (list, NONE)),
    "output_hidden_states": (False, (bool, NONE)),
    "return_dict": (True, (bool, NONE)),
    "dtype": (None, (str, NONE)),
    "chunk_size_feed_forward": (0, INT),
    "is_encoder_decoder": (False, BOOL),
}

# fields every listed class declares, with the same default
_DECODER = {
    "hidden_size": (4096, INT), "num_hidden_layers": (32, INT), "num_attention_heads": (32, INT),
    "hidden_act": ("silu", STR), "initializer_range": (0.02, FLOAT), "rms_norm_eps": (1e-6, FLOAT),
    "use_cache": (True, BOOL), "pad_token_id": (None, OPT_INT), "tie_word_embeddings": (False, BOOL),
    "rope_parameters": (None, (dict, NONE)),
}
_QWEN = {
    **_DECODER, "vocab_size": (151936, INT), "intermediate_size": (22016, INT), "num_key_value_heads": (32, OPT_INT),
    "max_position_embeddings": (32768, INT), "use_sliding_window": (False, BOOL), "sliding_window": (4096, OPT_INT),
    "max_window_layers": (28, INT), "layer_types": (None, (list, NONE)), "attention_dropout": (0.0, (float, int)),
    "bos_token_id": (None, OPT_INT), "eos_token_id": (None, TOKEN_ID),
}


@dataclass(frozen=True)
class ConfigClass:
    """What one transformers config class adds to config.json."""
    fields: dict[str, tuple[Any, tuple[type, ...]]]  # name -> (default, the types its strict dataclass accepts)
    derive_head_dim: bool  # head_dim None -> hidden_size // num_attention_heads
    sliding_layers: bool  # qwen2 / qwen3: sliding_window only with use_sliding_window; layer_types from it


CLASSES: dict[str, ConfigClass] = {
    "llama": ConfigClass({
        **_DECODER, "vocab_size": (32000, INT), "intermediate_size": (11008, INT),
        "num_key_value_heads": (None, OPT_INT), "max_position_embeddings": (2048, INT),
        "bos_token_id": (1, OPT_INT), "eos_token_id": (2, TOKEN_ID), "pretraining_tp": (1, OPT_INT),
        "attention_bias": (False, BOOL), "attention_dropout": (0.0, (int, float, NONE)), "mlp_bias": (False, BOOL),
        "head_dim": (None, OPT_INT)}, derive_head_dim=True, sliding_layers=False),
    "mistral": ConfigClass({
        **_DECODER, "vocab_size": (32000, INT), "intermediate_size": (14336, INT), "num_key_value_heads": (8, INT),
        "head_dim": (None, OPT_INT), "max_position_embeddings": (4096 * 32, INT), "bos_token_id": (1, OPT_INT),
        "eos_token_id": (2, TOKEN_ID), "sliding_window": (4096, OPT_INT), "attention_dropout": (0.0, (float, int))},
        derive_head_dim=True, sliding_layers=False),
    "qwen2": ConfigClass(_QWEN, derive_head_dim=False, sliding_layers=True),  # no head_dim field
    "qwen3": ConfigClass({**_QWEN, "head_dim": (128, INT), "attention_bias": (False, BOOL)},
                         derive_head_dim=False, sliding_layers=True),
}

# keys of GenerationConfig's defaults: transformers drops them from a model config (tests hold the list equal)
GENERATION_KEYS = frozenset((
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids", "begin_suppress_tokens",
    "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size", "encoder_repetition_penalty",
    "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id",
    "length_penalty", "max_length", "min_length", "no_repeat_ngram_size", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "num_beam_groups", "num_beams", "num_return_sequences", "output_scores",
    "remove_invalid_values", "repetition_penalty", "return_dict_in_generate", "suppress_tokens", "target_lookbehind",
    "temperature", "top_k", "top_p", "typical_p", "use_cache"))
# keys transformers takes out of the config rather than keeping them as attributes
DROPPED_KEYS = frozenset(("name_or_path", "_commit_hash", "output_attentions", "attn_implementation",
                          "experts_implementation", "_attn_implementation_internal",
                          "_experts_implementation_internal"))
# keys whose handling this reader does not copy: a config with any of them goes to transformers
UNCOVERED_KEYS = frozenset(("auto_map", "id2label", "label2id", "problem_type", "num_labels", "per_layer_config",
                            "mtp_layer_types", "sub_configs", "num_heads", "embed_dim"))
# rotary types whose required keys transformers checks, and those keys (original_max_position_embeddings is
# filled in from max_position_embeddings for llama3 and yarn)
ROPE_REQUIRED: dict[str, frozenset[str]] = {
    "default": frozenset(), "linear": frozenset({"factor"}), "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor"}), "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
}
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_THETA = 10000.0
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")


class ConfigJson(SimpleNamespace):
    """A model config read from config.json: attribute access like a transformers config."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def read_config_json(model_dir: Path) -> ConfigJson | None:
    """The config transformers would build from model_dir/config.json, or None where this reader does not cover
    it (then AutoConfig reads it)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config_from_dict(raw) if isinstance(raw, dict) else None


def config_from_dict(raw: dict[str, Any]) -> ConfigJson | None:
    cls = CLASSES.get(raw.get("model_type"))  # type: ignore[arg-type]
    if cls is None or UNCOVERED_KEYS & raw.keys() or "__float__" in json.dumps(raw):
        return None
    fields = {**BASE_FIELDS, **cls.fields}
    values = {name: raw.get(name, default) for name, (default, _) in fields.items()}
    if not all(_typed(values[name], types) for name, (_, types) in fields.items()):
        return None  # transformers' strict dataclass rejects it, with its own message
    extra = {k: v for k, v in raw.items() if k not in fields}
    if not _post_init(values, cls):
        return None
    if not _base_post_init(values, extra) or not _layer_types_valid(values):
        return None
    return ConfigJson(**values)


def _typed(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, list) and list in types:  # token ids (eos_token_id) or names (architectures, layer_types)
        kind = int if int in types else str
        return all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
    return isinstance(value, types)


def _post_init(values: dict[str, Any], cls: ConfigClass) -> bool:
    """The class's own __post_init__ and checks; False where transformers would refuse the config."""
    heads, hidden = values["num_attention_heads"], values["hidden_size"]
    if heads <= 0 or hidden % heads or not 0.0 <= values["initializer_range"] <= 1.0:
        return False
    if cls.sliding_layers and not values["use_sliding_window"]:
        values["sliding_window"] = None
    if cls.derive_head_dim and values["head_dim"] is None:
        values["head_dim"] = hidden // heads
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    if cls.sliding_layers and values["layer_types"] is None:
        window = values["sliding_window"]
        values["layer_types"] = ["sliding_attention" if window is not None and i >= values["max_window_layers"]
                                 else "full_attention" for i in range(values["num_hidden_layers"])]
    return True


def _layer_types_valid(values: dict[str, Any]) -> bool:
    """transformers checks layer_types (a field or a key of config.json) against the layer count and renames
    legacy names; only full / sliding lists of the right length are taken here."""
    layers = values.get("layer_types")
    return layers is None or (isinstance(layers, list) and len(layers) == values["num_hidden_layers"]
                              and all(t in LAYER_TYPES for t in layers))


def _base_post_init(values: dict[str, Any], extra: dict[str, Any]) -> bool:
    """PreTrainedConfig.__post_init__: dtype, labels, rotary parameters, dropped keys, then the other keys as
    attributes. False where it is not covered here."""
    torch_dtype = extra.pop("torch_dtype", None)
    if values["dtype"] is None:
        values["dtype"] = torch_dtype
    if values["dtype"] is not None:
        if values["dtype"] not in DTYPE_NAMES:
            return False
        import torch  # only here: the supervisor's checks read configs without it

        values["dtype"] = getattr(torch, values["dtype"])
    values["id2label"], values["label2id"] = {0: "LABEL_0", 1: "LABEL_1"}, {"LABEL_0": 0, "LABEL_1": 1}
    values["problem_type"], values["output_attentions"] = None, False
    rope = _rope_parameters(values, extra)
    if rope is None:
        return False
    values["rope_parameters"] = rope
    for key, value in extra.items():
        if key not in GENERATION_KEYS and key not in DROPPED_KEYS:
            values[key] = value
    return True


def _rope_parameters(values: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5's one `rope_parameters` dict from rope_parameters / rope_scaling / rope_theta /
    partial_rotary_factor (which leave the attributes); None where the dict is not of a checked type."""
    scaling = extra.pop("rope_scaling", None)
    params = scaling or values["rope_parameters"] or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        return None  # per-layer-type parameters
    params = dict(params)
    theta = extra.pop("rope_theta", DEFAULT_THETA)
    partial = extra.pop("partial_rotary_factor", None)
    params.setdefault("rope_theta", theta)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
        values["ignore_keys_at_rope_validation"] = {"partial_rotary_factor"}
    params.setdefault("rope_type", params.get("type", "default"))
    rope_type = params["rope_type"]
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    required = ROPE_REQUIRED.get(rope_type)
    if required is None or not required <= params.keys():
        return None
    head_dim = values.get("head_dim", extra.get("head_dim"))
    rotary = params.get("partial_rotary_factor", 1.0)
    if isinstance(head_dim, int) and head_dim > 4 and head_dim % 2 and int(head_dim * rotary) == head_dim:
        return None  # an odd rotary dimension: transformers refuses it
    return params
