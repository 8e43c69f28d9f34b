"""Atlas Spark (`spark serve [MODEL]`, image avarok/atlas-*): flag table.

Read from `spark serve --help` (seed 003_a3610789dfec711d.txt). Atlas is a Rust server (clap), so there are no
argparse abbreviations; its boolean options with `[<BOOL>]` take an optional true/false.
"""
from __future__ import annotations

from appliance.translate.spec import EngineTable, implied, nones, same, similar
from appliance.translate.spec import none as no

M, S, K, SD, P, A, SA, X = ("Model", "Scheduler and memory", "KV cache", "Speculative decoding", "Parallelism",
                            "API and auth", "Sampling defaults", "Runtime")

FLAGS = (
    similar("--model-from-path", "model.path", "Atlas skips Hugging Face cache resolution for it; a local path "
            "here is read as-is too", M),
    same("--model-name", "api.served_model_name", M),
    similar("--cache-dir", "model.download_dir", "Atlas's Hugging Face cache directory", M),
    same("--max-seq-len", "model.max_model_len", M),
    no("--gpu-ordinal", "choose the GPU with CUDA_VISIBLE_DEVICES", M, neutral=("0",)),
    implied("--no-fast-load", "weights are memory-mapped safetensors", M, arity="flag"),
    no("--oom-guard-mb", "memory headroom is cache.gpu_memory_utilization", M),
    same("--port", "api.port", A),
    same("--bind", "api.host", A),
    same("--auth-token", "api.api_key", A),
    same("--auth-tokens-file", "api.api_key_file", A),
    implied("--require-auth", "authentication is required whenever api.api_key or api.api_key_file is set", A,
            arity="flag"),
    same("--tool-call-parser", "api.tool_call_parser", A),
    no("--tool-max-tokens", "no separate cap for tool-calling requests; api.caps.max_tokens caps all", A),
    same("--request-timeout", "api.request_timeout", A),
    same("--disable-thinking", "api.disable_thinking", A, arity="flag"),
    same("--stupify", "api.disable_thinking", A, arity="flag"),
    same("--max-thinking-budget", "api.thinking_budget", A),
    no("--auto-compact", "context compaction is not available (over-long prompts get HTTP 400)", A,
       arity="optional"),
    same("--block-size", "cache.block_size", K),
    same("--kv-cache-dtype", "precision.kv_cache_dtype", K, values=(("bf16", "bfloat16"),)),
    same("--gpu-memory-utilization", "cache.gpu_memory_utilization", S),
    same("--max-num-seqs", "scheduler.max_num_seqs", S),
    no("--max-batch-size", "decode batches are bounded by scheduler.max_num_seqs", S),
    same("--enable-prefix-caching", "cache.enable_prefix_caching", K, arity="optional", const=True),
    same("--scheduling-policy", "scheduler.policy", S, values=(("fifo", "fcfs"), ("slai", "slo")), closed=True),
    same("--tbt-deadline-ms", "scheduler.slo_tbt_ms", S),
    similar("--max-prefill-tokens", "scheduler.chunked_prefill_size",
            "Atlas's per-iteration prefill chunk is the appliance's per-step budget; Atlas's 0 (no chunking) is -1",
            S, values=(("0", -1),)),
    # Atlas: the first N and last N attention layers keep a BF16 KV cache; auto = 2, max / all = every layer
    same("--kv-high-precision-layers", "precision.kv_cache_high_precision_layers", K,
         values=(("auto", 2), ("max", 1 << 16), ("all", 1 << 16))),
    same("--fp8-kv-calibration-tokens", "precision.kv_cache_calibration_tokens", K),
    similar("--swap-space-gb", "cache.host_cache_size_gb", "Atlas swaps KV blocks to host memory; here that is "
            "the host KV tier of this size", K),
    same("--high-speed-swap", "cache.disk_cache", K, arity="flag"),
    same("--high-speed-swap-dir", "cache.disk_cache_dir", K),
    same("--high-speed-swap-gb", "cache.disk_cache_size_gb", K),
    *nones(K, "the disk tier's I/O is not tunable", "--high-speed-swap-resident-blocks", "--high-speed-swap-rank",
           "--high-speed-swap-qd", "--high-speed-swap-cache-blocks-per-seq"),
    no("--high-speed-swap-graph", "the disk tier's I/O is not tunable", K, arity="optional", const=True),
    same("--ssm-cache-slots", "cache.ssm_cache_slots", K),
    same("--ssm-checkpoint-interval", "cache.ssm_checkpoint_interval", K),
    similar("--speculative", "speculative.algorithm", "Atlas's MTP speculative decoding", SD, arity="flag",
            const="MTP"),
    similar("--dflash", "speculative.algorithm", "DFlash block-diffusion drafting", SD, arity="flag",
            const="DFLASH"),
    similar("--ngram-speculative", "speculative.algorithm", "n-gram prompt-lookup drafting", SD, arity="flag",
            const="NGRAM"),
    no("--self-speculative", "layer-skipping self-speculation is not available", SD, arity="flag"),
    same("--draft-model", "speculative.draft_model_path", SD),
    similar("--dflash-gamma", "speculative.num_draft_tokens", "the DFlash block size: draft tokens per step", SD),
    similar("--num-drafts", "speculative.num_steps", "draft tokens per step (K = num_drafts + 1 verified)", SD),
    similar("--mtp-quantization", "speculative.draft_model_quantization", "precision of the MTP head", SD,
            values=(("bf16", "unquant"),)),
    no("--dflash-window-size", "the drafter's attention window is not configurable", SD),
    no("--mtp-vocab", "the draft LM head uses the full vocabulary", SD),
    same("--rank", "parallelism.node_rank", P),
    same("--world-size", "parallelism.world_size", P),
    same("--tp-size", "parallelism.tp", P),
    similar("--ep-size", "parallelism.ep", "an EP size above 1 turns expert parallelism on "
            "(enable_expert_parallel)", P),
    similar("--master-addr", "@dist_host", "becomes parallelism.dist_init_addr host:port", P),
    similar("--master-port", "@dist_port", "becomes parallelism.dist_init_addr host:port", P),
    same("--default-top-n-sigma", "sampling.top_n_sigma", SA),
    same("--default-min-p", "sampling.min_p", SA),
    no("--adaptive-sampling", "entropy-gated sampling is not available", SA, arity="flag"),
    same("--dump", "observability.dump_path", X, arity="optional"),
    no("--warmup-prompt", "no start-up prefix warm-up", X),
    no("--profile", "per-kernel profiling is not available", X, arity="flag"),
)

TABLE = EngineTable(
    name="atlas",
    title="Atlas Spark",
    flags=FLAGS,
    defaults=(("api.port", 8888, "Atlas's default port"),
              ("model.max_model_len", 32768, "Atlas's default --max-seq-len"),
              ("scheduler.max_num_seqs", 128, "Atlas's default --max-num-seqs"),
              ("sampling.top_n_sigma", 1.0, "Atlas's default --default-top-n-sigma"),
              ("cache.enable_prefix_caching", False, "Atlas's prefix caching is off by default")),
    source="`spark serve --help` (seed 003)",
)
