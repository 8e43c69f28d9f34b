#!/usr/bin/env bash
# Offline throughput of MoE shapes with dummy weights, through tools/bench_offline.py --config-json.
#
#   tools/bench_moe.sh deepseek-v2-lite [bench_offline args...]   # MLA + 64 experts (top-6) + 2 shared, ~16B
#   tools/bench_moe.sh qwen3-30b-a3b   [bench_offline args...]    # GQA + 128 experts (top-8), ~30B
#   tools/bench_moe.sh deepseek-v2-lite --num-prompts 200 --input-len 512 --output-len 128 --set max_num_seqs=64
#
# The configs are the published config.json shapes (bf16). Both fit one 80 GB GPU with dummy weights.
set -euo pipefail
cd "$(dirname "$0")/.."
shape="${1:?usage: tools/bench_moe.sh deepseek-v2-lite|qwen3-30b-a3b [bench_offline args...]}"
shift
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
case "$shape" in
  deepseek-v2-lite)
    cat > "$tmp/config.json" <<'JSON'
{"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
 "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
 "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
 "num_experts_per_tok": 6, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
 "norm_topk_prob": false, "scoring_func": "softmax", "first_k_dense_replace": 1, "moe_layer_freq": 1,
 "kv_lora_rank": 512, "q_lora_rank": null, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
 "max_position_embeddings": 163840, "rope_theta": 10000,
 "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
 "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": false, "tie_word_embeddings": false,
 "torch_dtype": "bfloat16", "bos_token_id": 100000, "eos_token_id": 100001}
JSON
    ;;
  qwen3-30b-a3b)
    cat > "$tmp/config.json" <<'JSON'
{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
 "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0,
 "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": false, "tie_word_embeddings": false,
 "use_sliding_window": false, "sliding_window": null, "max_window_layers": 48, "torch_dtype": "bfloat16",
 "bos_token_id": 151643, "eos_token_id": 151645}
JSON
    ;;
  *) echo "unknown shape $shape (deepseek-v2-lite, qwen3-30b-a3b)" >&2; exit 2 ;;
esac
exec python tools/bench_offline.py --config-json "$tmp/config.json" "$@"
