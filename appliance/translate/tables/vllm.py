"""vLLM (`vllm serve MODEL`, `python -m vllm.entrypoints.openai.api_server --model M`): flag table.

Read from vLLM's vllm/engine/arg_utils.py (EngineArgs / AsyncEngineArgs), the frontend arguments of
vllm/entrypoints/openai/cli_args.py and the `vllm serve` docs. vLLM's FlexibleArgumentParser also accepts
`--flag_with_underscores`, `--json-flag.key value` and `--config file.yaml`; its boolean config fields are
BooleanOptionalAction (`--no-X`). Flags that vLLM itself dropped are kept as `removed` so old recipes still get
a clear message.
"""
from __future__ import annotations

from dataclasses import replace

from appliance.config.flags import VLLM_SPEC_METHODS
from appliance.translate.spec import EngineTable, implied, nones, removed, same, similar, switches
from appliance.translate.spec import none as no

M, LD, P, C, S, SO = "Model", "Load", "Parallelism", "Cache", "Scheduler", "Structured outputs and parsers"
CO, SD, F, OB, LO, MM = "Compilation", "Speculative decoding", "Frontend (HTTP)", "Observability", "LoRA", \
    "Multimodal"
SPEC_METHODS = VLLM_SPEC_METHODS  # vLLM's speculative method names (config/flags.py)

# vLLM's attention backend names (AttentionBackendEnum) -> the appliance's (support.py says which run here)
VLLM_ATTENTION = (
    ("FLASH_ATTN", "fa3"), ("TRITON_ATTN", "triton"), ("TORCH_SDPA", "torch"), ("FLASHINFER", "flashinfer"),
    ("FLASHINFER_MLA", "flashinfer_mla"), ("FLASHMLA", "flashmla"), ("FLASHMLA_SPARSE", "flashmla_sparse"),
    ("CUTLASS_MLA", "cutlass_mla"), ("TRITON_MLA", "triton_mla"), ("FLASH_ATTN_MLA", "fa3"),
    ("FLEX_ATTENTION", "flex_attention"), ("XFORMERS", "xformers"), ("TREE_ATTN", "tree_attn"),
    ("ROCM_ATTN", "rocm_attn"), ("ROCM_AITER_FA", "rocm_aiter_fa"), ("ROCM_AITER_MHA", "rocm_aiter_mha"),
    ("ROCM_AITER_MLA", "rocm_aiter_mla"), ("ROCM_AITER_TRITON_MLA", "rocm_aiter_triton_mla"),
    ("ROCM_AITER_UNIFIED_ATTN", "rocm_aiter_unified_attn"), ("CPU_ATTN", "cpu_attn"), ("PALLAS", "pallas"),
    ("ASCEND", "ascend"), ("IPEX", "intel_xpu"),
)

_FLAGS = (
    same("--model", "model.path", M),
    same("--tokenizer", "model.tokenizer", M),
    same("--tokenizer-mode", "model.tokenizer_mode", M),
    same("--trust-remote-code", "model.trust_remote_code", M, arity="flag"),
    same("--dtype", "precision.dtype", M),
    same("--seed", "model.seed", M),
    same("--revision", "model.revision", M),
    same("--max-model-len", "model.max_model_len", M, neutral=("auto", "-1")),
    same(("--quantization", "-q"), "precision.quantization", M),
    same("--enforce-eager", "backends.enforce_eager", M, arity="flag"),
    same("--max-logprobs", "api.caps.max_logprobs", M),
    same("--skip-tokenizer-init", "model.skip_tokenizer_init", M, arity="flag"),
    same("--served-model-name", "api.served_model_name", M, arity="list"),
    same("--hf-overrides", "model.hf_overrides", M, arity="json"),
    similar("--rope-scaling", "model.hf_overrides.rope_scaling", "vLLM folded this into --hf-overrides; kept "
            "as hf_overrides.rope_scaling", M, arity="json"),
    similar("--rope-theta", "model.hf_overrides.rope_theta", "kept as hf_overrides.rope_theta", M),
    similar("--override-generation-config", "sampling", "vLLM overrides the model's generation_config.json "
            "defaults; here they are the server-wide [sampling] defaults", M, arity="json",
            subkeys=(("temperature", "sampling.temperature"), ("top_p", "sampling.top_p"),
                     ("top_k", "sampling.top_k"), ("min_p", "sampling.min_p"),
                     ("repetition_penalty", "sampling.repetition_penalty"))),
    no("--generation-config", "the model's generation_config.json is not read; set [sampling] defaults", M,
       neutral=("vllm",)),
    no("--runner", "only generative models are served", M, neutral=("auto", "generate")),
    no("--convert", "no model conversion (pooling / classification)", M, neutral=("auto", "none")),
    no("--task", "only text generation is served (vLLM deprecated --task)", M, neutral=("auto", "generate")),
    *nones(M, "not configurable", "--hf-config-path", "--code-revision", "--tokenizer-revision",
           "--logprobs-mode", "--hf-token", "--pooler-config",
           "--override-pooler-config", "--logits-processor-pattern", "--override-attention-dtype",
           "--io-processor-plugin"),
    no("--model-impl", "models are the appliance's own implementations", M, neutral=("auto", "vllm")),
    *nones(M, "not configurable", "--allowed-media-domains", "--logits-processors", arity="list"),
    implied("--disable-cascade-attn", "there is no cascade attention here", M, arity="flag"),
    implied("--language-model-only", "only the language model is served here (no multimodal encoders)", M,
            arity="flag"),
    *switches(M, "not available", "--disable-sliding-window", "--enable-prompt-embeds",
              "--enable-sleep-mode"),
    same("--load-format", "model.load_format", LD),
    same("--config-format", "model.config_format", LD),
    same("--download-dir", "model.download_dir", LD),
    *nones(LD, "weights are read with safetensors' defaults", "--safetensors-load-strategy",
           "--model-loader-extra-config", "--pt-load-map-location"),
    no("--ignore-patterns", "weights are read with safetensors' defaults", LD, arity="list"),
    switches(LD, "progress bars are not configurable", "--use-tqdm-on-load")[0],
    same(("--tensor-parallel-size", "-tp"), "parallelism.tp", P),
    similar("--tp", "parallelism.tp", "not a vLLM option (vLLM spells it -tp); read as --tensor-parallel-size, "
            "as other engines mean it", P),
    same(("--data-parallel-size", "-dp"), "parallelism.dp", P),
    same(("--enable-expert-parallel", "-ep"), "parallelism.enable_expert_parallel", P, arity="flag"),
    similar(("--data-parallel-size-local", "-dpl"), "@dp_local",
            "DP replicas on this node: parallelism.nprocs_per_node = dp_local x tp and nnodes = dp / dp_local", P),
    similar(("--data-parallel-start-rank", "-dpr"), "@dp_start_rank",
            "first DP rank of this node: parallelism.node_rank = start_rank / dp_local", P),
    similar(("--data-parallel-address", "-dpa"), "@dist_host", "becomes parallelism.dist_init_addr host:port", P),
    similar(("--data-parallel-rpc-port", "-dpp"), "@dist_port", "becomes parallelism.dist_init_addr host:port", P),
    similar("--master-addr", "@dist_host", "becomes parallelism.dist_init_addr host:port", P),
    similar("--master-port", "@dist_port", "becomes parallelism.dist_init_addr host:port", P),
    same("--nnodes", "parallelism.nnodes", P),
    same("--node-rank", "parallelism.node_rank", P),
    similar("--all2all-backend", "backends.all2all", "vLLM's deepep_* names carry the DeepEP mode; here that is "
            "backends.deepep_mode", P,
            values=(("naive", "naive"), ("pplx", "pplx"), ("allgather_reducescatter", "allgather_reducescatter"),
                    ("deepep_high_throughput", "deepep"), ("deepep_low_latency", "deepep")), closed=True),
    implied("--headless", "a node with node_rank > 0 runs workers only", P, arity="flag"),
    same(("--pipeline-parallel-size", "-pp"), "parallelism.pp", P),
    same(("--decode-context-parallel-size", "-dcp"), "parallelism.dcp", P),
    no(("--data-parallel-rank", "-dpn"), "external DP load balancing is not available", P),
    no(("--data-parallel-backend", "-dpb"), "DP replicas are started by the supervisor", P, neutral=("mp",)),
    no(("--api-server-count", "-asc"), "one HTTP process serves the API", P, neutral=("1",)),
    no("--distributed-executor-backend", "workers are processes started by the supervisor (like vLLM's mp)", P,
       neutral=("mp", "uni")),
    *nones(P, "not configurable", "--dbo-decode-token-threshold", "--dbo-prefill-token-threshold",
           "--eplb-config", "--expert-placement-strategy", "--max-parallel-loading-workers", "--worker-cls",
           "--worker-extension-cls"),
    *switches(P, "not available", "--data-parallel-hybrid-lb", "--data-parallel-external-lb", "--enable-dbo",
              "--disable-nccl-for-dp-synchronization", "--enable-eplb", "--ray-workers-use-nsight"),
    same("--disable-custom-all-reduce", "parallelism.disable_custom_all_reduce", P, arity="flag"),
    same("--block-size", "cache.block_size", C),
    same("--gpu-memory-utilization", "cache.gpu_memory_utilization", C),
    same("--kv-cache-dtype", "precision.kv_cache_dtype", C),
    same("--enable-prefix-caching", "cache.enable_prefix_caching", C, arity="flag"),
    similar("--quantization-param-path", "precision.quantization_param_path", "dropped from vLLM (fp8 KV scales "
            "now come with the checkpoint); here the JSON file of KV cache scales", C),
    similar("--calculate-kv-scales", "precision.kv_cache_calibration_tokens", "vLLM computes the fp8 KV scales "
            "once, from its first forward pass; here from the first 2048 prefill tokens (set the count with "
            "precision.kv_cache_calibration_tokens)", C, arity="flag", const=2048),
    no("--kv-cache-memory-bytes", "size the KV pool with cache.max_total_tokens or cache.gpu_memory_utilization",
       C),
    no("--swap-space", "preempted requests swap into the host KV tier (scheduler.preemption_mode, sized by "
       "cache.host_cache_size_gb), not a separate swap space", C),
    no("--cpu-offload-gb", "weights are not offloaded to the CPU", C, neutral=("0",)),
    no("--num-gpu-blocks-override", "size the KV pool with cache.max_total_tokens", C),
    no("--prefix-caching-hash-algo", "prefix blocks are hashed with the appliance's own chain hash", C),
    same("--mamba-cache-dtype", "cache.ssm_cache_dtype", C),
    similar("--mamba-ssm-cache-dtype", "cache.ssm_state_dtype", "vLLM's auto follows --mamba-cache-dtype (the "
            "model's dtype); the appliance's auto keeps the recurrent state in float32 (or the config's "
            "mamba_ssm_dtype)", C),
    similar("--mamba-block-size", "cache.ssm_checkpoint_interval", "vLLM caches the recurrent state every "
            "mamba_block_size tokens; here state snapshots are taken during prefill every ssm_checkpoint_interval "
            "tokens (a multiple of block_size), in cache.ssm_cache_slots LRU slots", C),
    no("--mamba-cache-mode", "the recurrent state is cached for prefix reuse at checkpoints taken during prefill "
       "(cache.ssm_checkpoint_interval set) or not at all (unset)", C),
    *nones(C, "not available", "--kv-offloading-size", "--kv-offloading-backend"),
    switches(C, "not available", "--kv-sharing-fast-prefill")[0],
    similar("--max-num-batched-tokens", "scheduler.chunked_prefill_size",
            "vLLM's per-step token budget; the appliance calls its per-step issue budget chunked_prefill_size "
            "(the global token pool is cache.max_total_tokens)", S),
    same("--max-num-seqs", "scheduler.max_num_seqs", S),
    similar("--enable-chunked-prefill", "@chunked_prefill", "off: scheduler.chunked_prefill_size = -1 and the "
            "step budget becomes scheduler.max_prefill_tokens", S, arity="flag"),
    similar("--scheduling-policy", "scheduler.policy", "vLLM's `priority` policy has no equivalent", S,
            values=(("fcfs", "fcfs"),), closed=True),
    same("--async-scheduling", "scheduler.enable_overlap", S, arity="flag"),
    same("--stream-interval", "api.stream_interval", S),
    similar("--cuda-graph-sizes", "backends.cuda_graph_sizes", "deprecated in vLLM for "
            "--cudagraph-capture-sizes", S, arity="list"),
    *nones(S, "not configurable", "--max-num-partial-prefills", "--max-long-partial-prefills",
           "--long-prefill-token-threshold", "--scheduler-cls"),
    *switches(S, "not available", "--disable-chunked-mm-input", "--disable-hybrid-kv-cache-manager"),
    same("--cudagraph-capture-sizes", "backends.cuda_graph_sizes", CO, arity="list"),
    same("--max-cudagraph-capture-size", "backends.cuda_graph_max_bs", CO),
    similar(("--compilation-config", "-O", "-cc"), "backends", "only the CUDA graph sizes carry over: there is "
            "no torch.compile (levels / modes); cudagraph_mode FULL_DECODE_ONLY is decode graphs without piecewise prefill "
            "graphs", CO, arity="json",
            subkeys=(("cudagraph_capture_sizes", "backends.cuda_graph_sizes"),
                     ("max_cudagraph_capture_size", "backends.cuda_graph_max_bs"),
                     ("cudagraph_mode", "backends.piecewise_cuda_graph"), ("level", "-"), ("mode", "-")),
            values=(("full_decode_only", False), ("full_and_piecewise", True), ("piecewise", True))),
    no("--optimization-level", "no torch.compile optimization levels; CUDA graphs are backends.enforce_eager", CO),
    similar("--attention-backend", "backends.attention", "vLLM's backend names in the appliance's spelling: "
            "FLASH_ATTN -> fa3 (vLLM picks FlashAttention 2 or 3 by GPU), TRITON_ATTN -> triton, TORCH_SDPA -> "
            "torch, the rest lower-cased", CO, values=VLLM_ATTENTION),
    same("--moe-backend", "backends.moe", CO),
    same("--linear-backend", "backends.linear", CO),
    similar("--speculative-config", "speculative", "vLLM's method / model / num_speculative_tokens become "
            "algorithm / draft_model_path / num_steps (a chain: eagle_topk 1, num_steps + 1 tokens verified)", SD,
            arity="json", values=SPEC_METHODS,
            subkeys=(("method", "speculative.algorithm"), ("model", "speculative.draft_model_path"),
                     ("num_speculative_tokens", "speculative.num_steps"),
                     ("quantization", "speculative.draft_model_quantization"),
                     ("prompt_lookup_min", "speculative.prompt_lookup_min"),
                     ("prompt_lookup_max", "speculative.prompt_lookup_max"),
                     ("disable_by_batch_size", "speculative.disable_by_batch_size"),
                     ("draft_tensor_parallel_size", "-"))),
    same("--kv-events-config", "observability.kv_events", OB, arity="json"),
    no("--kv-transfer-config", "KV transfer (disaggregated prefill) is not available", SD),
    no("--ec-transfer-config", "encoder cache transfer is not available", SD),
    no("--additional-config", "no platform plugins", SD),
    same("--host", "api.host", F),
    same("--port", "api.port", F),
    same("--api-key", "api.api_key", F),
    same("--chat-template", "api.chat_template", F),
    same("--enable-force-include-usage", "api.enable_force_include_usage", F, arity="flag"),
    same("--enable-prompt-tokens-details", "observability.enable_cache_report", F, arity="flag"),
    implied("--enable-server-load-tracking", "GET /load always answers the number of open engine requests", F,
            arity="flag"),
    no("--chat-template-content-format", "message content reaches the chat template as one string (text parts "
       "joined)", F, neutral=("string",)),
    same("--tool-call-parser", "api.tool_call_parser", F, values=(("hermes", "hermes"), ("llama3_json", "llama3_json"),
         ("deepseek_v3", "deepseek_v3"), ("deepseek_v31", "deepseek_v31"), ("kimi_k2", "kimik2"),
         ("qwen3_coder", "qwen3_coder"), ("pythonic", "pythonic"), ("mistral", "mistral"))),
    implied("--enable-auto-tool-choice", "tool calls are parsed whenever api.tool_call_parser is set", F,
            arity="flag"),
    same("--reasoning-parser", "api.reasoning_parser", SO),
    similar("--uvicorn-log-level", "observability.log_level_http", "`trace` becomes debug", F,
            values=(("trace", "debug"),)),
    same("--enable-log-requests", "observability.enable_log_requests", OB, arity="flag"),
    similar("--disable-log-requests", "observability.enable_log_requests", "deprecated in vLLM (request logs are "
            "off by default)", OB, arity="flag", const=False),
    no("--disable-log-stats", "periodic stats logging follows observability.decode_log_interval", OB,
       arity="flag"),
    no("--max-log-len", "request logs are not truncated by length", OB),
    *nones(OB, "not available", "--show-hidden-metrics-for-version", "--otlp-traces-endpoint",
           "--collect-detailed-traces", "--log-config-file"),
    switches(OB, "not available", "--kv-cache-metrics")[0],
    *nones(F, "not available", "--uds", "--response-role", "--ssl-keyfile",
           "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--root-path", "--tool-parser-plugin",
           "--tool-server", "--h11-max-incomplete-event-size", "--h11-max-header-count",
           "--reasoning-parser-plugin", "--structured-outputs-config"),
    *nones(F, "CORS and middleware are not configurable", "--allowed-origins", "--allowed-methods",
           "--allowed-headers", "--middleware", arity="list"),
    *switches(F, "not available", "--disable-uvicorn-access-log", "--allow-credentials",
              "--trust-request-chat-template", "--enable-ssl-refresh", "--return-tokens-as-token-ids",
              "--disable-frontend-multiprocessing", "--enable-request-id-headers",
              "--exclude-tools-when-tool-choice-none", "--disable-fastapi-docs", "--enable-tokenizer-info-endpoint",
              "--enable-log-outputs", "--log-error-stack"),
    implied("--config", "the translator reads the YAML file; its settings are translated like flags (the "
            "command line wins)", F),
    *switches(LO, "LoRA adapters are not supported", "--enable-lora", "--fully-sharded-loras"),
    *nones(LO, "LoRA adapters are not supported", "--max-loras", "--max-lora-rank", "--lora-dtype",
           "--max-cpu-loras"),
    no("--lora-modules", "LoRA adapters are not supported", LO, arity="list"),
    same("--mm-encoder-tp-mode", "multimodal.encoder_tp_mode", MM),
    same("--mm-encoder-attn-backend", "multimodal.encoder_attention", MM, values=VLLM_ATTENTION),
    same("--mm-processor-cache-gb", "multimodal.processor_cache_gb", MM),
    same("--mm-processor-cache-type", "multimodal.processor_cache_type", MM),
    same("--limit-mm-per-prompt", "multimodal.limit_per_prompt", MM, arity="json"),
    same("--mm-processor-kwargs", "multimodal.processor_kwargs", MM, arity="json"),
    same("--media-io-kwargs", "multimodal.media_io_kwargs", MM, arity="json"),
    same("--allowed-local-media-path", "multimodal.allowed_local_media_path", MM),
    *switches(MM, "multimodal inputs are not served", "--interleave-mm-strings", "--skip-mm-profiling"),
    removed("--device", "removed from vLLM (the platform is detected); here model.device", M),
    removed("--use-v2-block-manager", "removed from vLLM (v0.6.x): the v2 block manager is the only one", C,
            arity="flag"),
    removed("--num-scheduler-steps", "removed from vLLM V1 (multi-step scheduling)", S),
    removed("--multi-step-stream-outputs", "removed from vLLM V1 (multi-step scheduling)", S),
    removed("--max-seq-len-to-capture", "removed from vLLM; use --max-cudagraph-capture-size", CO),
    removed("--speculative-model", "removed from vLLM; use --speculative-config '{\"model\": ...}'", SD),
    removed("--num-speculative-tokens", "removed from vLLM; use --speculative-config", SD),
    removed("--speculative-draft-tensor-parallel-size", "removed from vLLM; use --speculative-config", SD),
    removed("--ngram-prompt-lookup-max", "removed from vLLM; use --speculative-config", SD),
    removed("--ngram-prompt-lookup-min", "removed from vLLM; use --speculative-config", SD),
    removed("--spec-decoding-acceptance-method", "removed from vLLM V1", SD),
    removed("--guided-decoding-backend", "renamed in vLLM to --structured-outputs-config backend; structured "
            "outputs here are xgrammar's", SO, neutral=("xgrammar", "auto")),
    similar("--preemption-mode", "scheduler.preemption_mode", "removed from vLLM V1 (always recompute); vLLM V0's "
            "recompute / swap, where swap needs the host KV tier (cache.host_cache)", S),
    removed("--scheduler-delay-factor", "removed from vLLM V1", S),
    removed("--tokenizer-pool-size", "removed from vLLM", M),
    removed("--tokenizer-pool-type", "removed from vLLM", M),
    removed("--disable-async-output-proc", "removed from vLLM V1", S, arity="flag"),
    removed("--enable-prompt-adapter", "removed from vLLM", LO, arity="flag"),
    removed("--worker-use-ray", "removed from vLLM; was --distributed-executor-backend ray", P, arity="flag"),
    removed("--disable-mm-preprocessor-cache", "removed from vLLM", MM, arity="flag"),
    removed("--num-lookahead-slots", "removed from vLLM V1", S),
    removed("--tokenizer-pool-extra-config", "removed from vLLM", M),
    removed("--enable-lora-bias", "removed from vLLM", LO, arity="flag"),
    removed("--lora-extra-vocab-size", "removed from vLLM", LO),
    removed("--long-lora-scaling-factors", "removed from vLLM", LO),
)

TABLE = EngineTable(
    name="vllm",
    title="vLLM",
    # vLLM's boolean config fields are BooleanOptionalAction: `--no-X` is accepted for each.
    flags=tuple(replace(f, negatable=True) if f.arity == "flag" else f for f in _FLAGS),
    env_flags=(("VLLM_ATTENTION_BACKEND", "--attention-backend"),),
    source="vllm/engine/arg_utils.py, vllm/entrypoints/openai/cli_args.py, `vllm serve --help=all`",
)
