"""The model shapes we publish figures for (transformers config.json contents, run with dummy weights) and the
workloads each bench command runs on them by default.

    python -m appliance.bench.presets OUT_DIR [--tokenizer]   # OUT_DIR/<preset>/config.json for every preset

With --tokenizer each directory also gets a word-level tokenizer over exactly the model's vocabulary ("w0" ..
"wN", bos/eos/unk special): a server needs one to take text, and random prompts re-encode to exactly their
length, so prompt and output token counts are exact on any server (ours or another) reading the directory.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "rope_theta": 1000000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # both fit one 80 GB GPU in bf16 with dummy weights (Qwen3-30B-A3B: 57 GiB)
    "deepseek-v2-lite": {  # MLA + 64 routed experts (top-6) + 2 shared, one leading dense layer, ~16B
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": False, "scoring_func": "softmax", "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 100000, "eos_token_id": 100001,
    },
    "qwen3-30b-a3b": {  # GQA + 128 routed experts (top-8), ~30B (3B active)
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 48, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # sliding-window families (benchmarks/models.py): layer_types marks the windowed layers
    "gpt-oss-20b": {  # 32 experts (top-4), attention sinks, 128-token windows on every other layer, ~21B (3.6B active)
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "attention_bias": True, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 199998, "eos_token_id": 200002, "pad_token_id": 199999,
    },
    "gemma-3-12b": {  # five 1024-token window layers to each global one, head_dim 256, ~12B
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208,
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 8, "max_position_embeddings": 131072,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    },
}
# gpt-oss-20b's layers, 36 deep with 128 experts, ~117B (5.1B active): one 80 GB GPU with its experts in MXFP4
# (precision.moe_weight_format = mxfp4; ~62 GiB of weights), eight in bf16
SHAPES["gpt-oss-120b"] = {**SHAPES["gpt-oss-20b"], "num_hidden_layers": 36, "num_local_experts": 128,
                          "layer_types": ["sliding_attention", "full_attention"] * 18}


@dataclass(frozen=True)
class Published:
    """A bench command's default workload on a preset: the flags the docs' figures were measured with. Lengths
    are ranges: each request's length is drawn uniformly from [lo, hi] (lo == hi: fixed)."""

    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    batch_size: int = 1
    num_iters: int = 3
    num_iters_warmup: int = 1


# (command, preset) -> workload. qwen3-0.6b throughput is nano-vllm's bench.py workload: 256 sequences, prompt
# and output lengths uniform in [100, 1024], seed 0; the 8B's is vLLM's 1000 x 1024 in / 1024 out; latency is one
# request of 1024 in / 256 out, three times after one warm-up.
PUBLISHED: dict[tuple[str, str], Published] = {
    ("throughput", "qwen3-0.6b"): Published(256, (100, 1024), (100, 1024)),
    ("throughput", "llama-3.1-8b"): Published(1000, (1024, 1024), (1024, 1024)),
    ("latency", "llama-3.1-8b"): Published(1, (1024, 1024), (256, 256), batch_size=1),
    ("latency", "qwen3-0.6b"): Published(1, (1024, 1024), (256, 256), batch_size=1),
}


def write_model_dir(name: str, out: Path, tokenizer: bool = False) -> Path:
    """out/config.json of preset `name` (and a word-level tokenizer with `tokenizer`); returns out."""
    if name not in SHAPES:
        raise KeyError(f"unknown preset {name!r}; choose from {', '.join(SHAPES)}")
    shape = SHAPES[name]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(shape, indent=1))
    if tokenizer:
        write_word_tokenizer(out, shape["vocab_size"], shape["bos_token_id"], shape["eos_token_id"])
    return out


def write_word_tokenizer(out: Path, vocab_size: int, bos: int, eos: int) -> Path:
    """A word-level tokenizer over exactly vocab_size ids: id i is the word "w{i}" (bos, eos and one unk are
    special tokens), words split on whitespace, decode joins them with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not (0 <= bos < vocab_size and 0 <= eos < vocab_size and bos != eos and vocab_size >= 3):
        raise ValueError(f"bad tokenizer shape: vocab {vocab_size}, bos {bos}, eos {eos}")
    names = [f"w{i}" for i in range(vocab_size)]
    unk = next(i for i in range(vocab_size) if i not in (bos, eos))
    names[bos], names[eos], names[unk] = "<s>", "</s>", "<unk>"
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write a model directory (config.json) for every preset shape.")
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", action="store_true", help="also a word-level tokenizer of the model's vocabulary")
    p.add_argument("--only", default=",".join(SHAPES), help="comma-separated presets (default: all)")
    args = p.parse_args(argv)
    for name in args.only.split(","):
        print(write_model_dir(name, args.out / name, args.tokenizer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
