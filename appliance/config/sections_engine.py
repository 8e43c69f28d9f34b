"""Config sections about the model and how it runs: model, precision, parallelism, scheduler, cache, backends.

Names and defaults follow the seeds (TokenSpeed server parameters; vLLM/SGLang where they agree). Field
descriptions are user documentation: docs/parameters.md is generated from them.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, StringConstraints, field_validator

from appliance.config.fields import param


class Section(BaseModel):
    """Base of every section: immutable, unknown keys are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    def __hash__(self) -> int:  # dict and list fields defeat pydantic's field hash; the JSON form is stable
        return hash(json.dumps(self.model_dump(mode="json"), sort_keys=True))


Dtype = Literal["auto", "bfloat16", "float16", "float32"]
StateDtype = Literal["auto", "float32", "bfloat16", "float16"]  # hybrid models' state cache (cache.ssm_*_dtype)
KvCacheDtype = Literal[
    "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "mxfp8", "nvfp4"
]
KvCacheQuantMethod = Literal["none", "per_token_head"]
# every method the source engines name (support.py says which this build runs); names are vLLM/SGLang's
Quantization = Literal[
    "fp8", "nvfp4", "mxfp4", "mxfp8", "w8a8_fp8", "w8a8_int8", "w4afp8", "compressed-tensors", "awq", "awq_marlin",
    "gptq", "gptq_marlin", "moe_wna16", "modelopt", "modelopt_fp4", "bitsandbytes", "gguf", "quark", "ascend",
]
LoadFormat = Literal[
    "auto", "pt", "safetensors", "npcache", "dummy", "fastsafetensors", "mistral", "gguf", "bitsandbytes",
    "runai_streamer", "sharded_state", "layered", "instanttensor",
]


def _name(value: Any) -> Any:
    """Engine spellings of one name agree: `TRITON_ATTN`, `deepseek-r1` -> `triton_attn`, `deepseek_r1`."""
    return value.strip().lower().replace("-", "_") if isinstance(value, str) else value


# A kernel backend or parser name. Any name a source engine uses is accepted, so that a translated deployment
# keeps its choice; support.py refuses at start-up the ones this build does not have.
Name = Annotated[str, BeforeValidator(_name), StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.]*$")]
All2AllBackend = Literal["auto", "naive", "allgather_reducescatter", "deepep", "pplx"]

_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}


class ModelSection(Section):
    """Which model to serve and how to load it."""

    path: str | None = param(
        None, "Model directory or Hugging Face repo id. Unset: the small model embedded in the package "
        "(appliance/assets/default_model), so `appliance run` works with no download.",
        flags=("--model", "--model-path"))
    tokenizer: str | None = param(None, "Tokenizer path or repo id when it differs from the model path.")
    tokenizer_mode: Literal["auto", "slow", "mistral", "deepseek_v4", "deepseek_v32", "inkling"] = param(
        "auto", "Tokenizer behaviour: `auto` uses the fast tokenizer when available, `slow` forces the Python one; "
        "`mistral` (mistral-common) and `deepseek_v4` are the source engines' model-specific tokenizers.")
    skip_tokenizer_init: bool = param(
        False, "Do not load a tokenizer; requests must carry token ids and responses carry token ids only.")
    load_format: LoadFormat = param(
        "auto", "Weight format: `auto` prefers safetensors, `pt` PyTorch bins, `npcache` a numpy cache, "
        "`dummy` random weights (benchmarks without a checkpoint); the others are the source engines' loaders "
        "(fastsafetensors, mistral's consolidated files, gguf, bitsandbytes, runai_streamer, sharded_state, "
        "layered, instanttensor).")
    config_format: Literal["auto", "hf", "mistral"] = param(
        "auto", "Format of the model's config: `auto` and `hf` read config.json; `mistral` reads params.json.")
    trust_remote_code: bool = param(False, "Allow model code shipped in the model repository to run.")
    revision: str | None = param(None, "Model branch, tag or commit to load.")
    download_dir: str | None = param(None, "Hugging Face download/cache directory.")
    hf_overrides: dict[str, Any] = param(
        default_factory=dict, description="Values that replace entries of the model's config.json "
        "(for example `{max_position_embeddings = 65536}`).", flags=None, json_flag="--hf-overrides")
    max_model_len: int | None = param(
        None, "Longest sequence (prompt + output) served. Unset: the model's max_position_embeddings. "
        "It may not exceed the model's limit; raise that through hf_overrides if you mean to.",
        flags=("--max-model-len", "--context-length", "--max-seq-len"), gt=0)
    seed: int = param(0, "Random seed for weight init (dummy weights) and unseeded sampling.", ge=0)
    device: Literal["auto", "cuda", "cpu"] = param(
        "auto", "Where the model runs: `auto` is CUDA when a GPU is visible, else CPU.")


class PrecisionSection(Section):
    """Number formats of weights, activations and the KV cache."""

    dtype: Dtype = param(
        "auto", "Weight and activation dtype. `auto` follows the model's torch_dtype (float32 on CPU when the "
        "model asks for half precision the CPU path lacks). Aliases: half, bf16, float.")
    kv_cache_dtype: KvCacheDtype = param(
        "auto", "KV cache storage dtype. `auto` is the activation dtype; fp8 (= fp8_e4m3) and fp8_e5m2 halve KV "
        "memory. fp8 caches use per-layer k/v scales from the checkpoint (ModelOpt, compressed-tensors) or "
        "quantization_param_path, else 1.0 with a warning (values above 448 saturate).")
    kv_cache_quant_method: KvCacheQuantMethod | None = param(
        None, "How an fp8 KV cache is scaled (TokenSpeed's names). `none` (= unset): one static scale per layer "
        "for K and one for V (per kv head where the checkpoint has them), from the checkpoint, "
        "quantization_param_path or kv_cache_calibration_tokens. `per_token_head` (a dynamic scale per token and "
        "head) is not built.")
    kv_cache_calibration_tokens: int = param(
        0, "With an fp8 KV cache: compute each layer's k/v scales online from the key / value amax of the first "
        "this many prefill tokens served (an MLA latent cache: its one scale from the latents' amax), then freeze "
        "them (0: off). Replaces the checkpoint's scales.",
        flags=("--kv-cache-calibration-tokens", "--fp8-kv-calibration-tokens"), ge=0)
    kv_cache_high_precision_layers: int = param(
        0, "With an fp8 KV cache: the first and the last this many attention layers keep their KV cache in the "
        "activation dtype (the layers whose keys and values quantize worst in many models).",
        flags=("--kv-cache-high-precision-layers", "--kv-high-precision-layers"), ge=0)
    quantization: Quantization | None = param(None, "Weight quantization of the checkpoint. Unset: none.")
    moe_weight_format: Literal["dequantized", "mxfp4"] = param(
        "dequantized", "How the experts of a model that ships them in MXFP4 (gpt-oss) are kept: `dequantized` to the "
        "model dtype at load (any device, any MoE backend); `mxfp4` as shipped, 4.25 bits a weight (about a quarter "
        "of the bf16 bytes, so gpt-oss-120b fits one 80 GB GPU and a decode step reads a quarter of the expert "
        "bytes), run by the Triton fused MoE that dequantizes weight tiles in registers: a GPU with backends.moe "
        "triton (auto picks it there). With `mxfp4` a 16-bit checkpoint's experts are rounded to MXFP4 at load.")
    quantization_param_path: str | None = param(
        None, "JSON file with KV cache scaling factors, commonly needed with an fp8 KV cache.")

    @field_validator("dtype", "kv_cache_dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        return _DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v


class ParallelismSection(Section):
    """How the model is split over GPUs and nodes. world size = tp x pp x dp."""

    tp: int = param(1, "Tensor-parallel size of attention (the familiar --tensor-parallel-size).",
                    flags=("--tensor-parallel-size", "--tp", "--attn-tp-size", "--tp-size"), ge=1)
    dense_tp: int | None = param(None, "Tensor-parallel size of dense MLP layers. Unset: same as tp.",
                                 flags="--dense-tp-size", ge=1)
    moe_tp: int | None = param(None, "Tensor-parallel size of MoE layers. Unset: same as tp (or 1 with "
                               "expert parallelism).", flags="--moe-tp-size", ge=1)
    dp: int = param(1, "Number of data-parallel replicas.", flags=("--data-parallel-size", "--dp-size", "--dp"),
                    ge=1)
    pp: int = param(1, "Pipeline-parallel size: the layers split into this many stages, each on its own tp group.",
                    flags=("--pipeline-parallel-size", "--pp-size", "--pp"), ge=1)
    dcp: int = param(1, "Decode context-parallel size: the KV cache of a sequence split over this many ranks of "
                     "the tp group during decode (must divide tp).", flags=("--decode-context-parallel-size",
                                                                           "--dcp"), ge=1)
    enable_expert_parallel: bool = param(
        False, "Shard MoE experts over the ranks instead of tensor-splitting them. ep defaults to tp x dp.",
        flags=("--enable-expert-parallel", "--enable-ep-moe"))
    ep: int | None = param(
        None, "Expert-parallel size. Unset: tp x dp when enable_expert_parallel, else 1. Must divide world size.",
        flags=("--expert-parallel-size", "--ep-size", "--ep"), ge=1)
    world_size: int | None = param(None, "Total worker processes over all nodes. Unset: tp x pp x dp; when set "
                                   "it must equal that.", ge=1)
    nprocs_per_node: int | None = param(None, "Worker processes per node. Unset: world_size / nnodes.", ge=1)
    nnodes: int = param(1, "Number of nodes.", ge=1)
    node_rank: int = param(0, "Rank of this node (0 is the head).", ge=0)
    dist_init_addr: str | None = param(None, "host:port for distributed initialisation across nodes.",
                                       flags=("--dist-init-addr", "--nccl-init-addr"))
    devices: list[int] | None = param(
        None, "GPU indices of this node's workers, one per worker in rank order (worker d x tp + t of replica d), "
        "each given to its worker as CUDA_VISIBLE_DEVICES. Unset: worker i uses visible device i.",
        flags="--devices")
    disable_custom_all_reduce: bool = param(
        False, "Sum tensor-parallel partial results with NCCL only. By default small messages (decode steps) on "
        "GPUs of one host use a one-shot all-reduce over CUDA IPC (symmetric memory) buffers, and the rest NCCL.",
        flags="--disable-custom-all-reduce")

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(d < 0 for d in v) or len(set(v)) != len(v)):
            raise ValueError("must be a non-empty list of distinct device indices >= 0")
        return v

    @property
    def effective_ep(self) -> int:
        if self.ep is not None:
            return self.ep
        return self.tp * self.dp if self.enable_expert_parallel else 1

    @property
    def effective_world_size(self) -> int:
        return self.world_size if self.world_size is not None else self.tp * self.pp * self.dp


class SchedulerSection(Section):
    """Batching and admission: how many requests run together and how much work one step issues."""

    max_num_seqs: int = param(256, "Most sequences the scheduler runs concurrently.",
                              flags=("--max-num-seqs", "--max-running-requests"), ge=1)
    chunked_prefill_size: int = param(
        8192, "Token budget the scheduler issues in one step (decodes first, long prompts split into chunks). "
        "-1 disables chunked prefill: a prompt is prefilled whole, bounded by max_prefill_tokens.", ge=-1)
    max_prefill_tokens: int = param(8192, "Prefill token budget of one step when chunked prefill is disabled.",
                                    ge=1)
    max_mixed_prefill_tokens: int | None = param(
        None, "Most prefill tokens a step takes while it also decodes (a mixed step): every running decode is in "
        "every step, and prefill chunks fill at most this much beside them, so a decode never waits behind a "
        "longer prefill (the inter-token latency under load). A step without decodes takes the whole "
        "chunked_prefill_size. Unset: 2048 in the server (`appliance serve` / `run`), no bound in the offline LLM "
        "(throughput first); -1: no bound. Needs chunked prefill.", ge=-1)
    max_queued_requests: int | None = param(
        None, "Most requests waiting for admission; further requests get HTTP 429 (Retry-After) at once, before "
        "tokenization. Unset: no limit.", ge=1)
    watchdog_timeout: float = param(
        300.0, "Seconds a step may make no progress while requests are running, as SGLang's --watchdog-timeout: "
        "past it /health answers 503, every stage's Python stacks are logged, open requests end with an error "
        "and the server exits non-zero. 0: no watchdog.", flags=("--watchdog-timeout",), ge=0)
    policy: Literal["fcfs", "lpm", "slo"] = param(
        "fcfs", "Order of waiting requests: `fcfs` first come first served; `lpm` longest cached prefix first; "
        "`slo` decode-first for sequences near their time-between-tokens deadline, shortest prompt first.",
        flags=("--scheduling-policy", "--schedule-policy"))
    slo_tbt_ms: float = param(100.0, "Time-between-tokens deadline in milliseconds for policy `slo`.",
                              flags=("--slo-tbt-ms", "--tbt-deadline-ms"), gt=0)
    preemption_mode: Literal["recompute", "swap", "auto"] = param(
        "recompute", "What a preempted request keeps (vLLM V0's --preemption-mode): `recompute` frees its KV and "
        "prefills it again on resume; `swap` copies its KV blocks to the host tier (cache.host_cache) and back on "
        "resume; `auto` swaps a request when that copy is cheaper than its prefill, priced with the copy GB/s and "
        "prefill tokens/s the workers measure at start-up (logged). swap and auto need cache.host_cache.",
        flags=("--preemption-mode",))
    enable_overlap: bool | None = param(
        None, "Overlap scheduling: plan and launch step N+1 while step N runs, so the host's work hides behind "
        "the device's compute. Outputs are identical; a request that stops wastes one step's slot. Unset: on, "
        "except with speculative decoding, where it is off unless set (models with recurrent-state layers refuse it "
        "with speculation).",
        flags=("--enable-overlap-schedule", "--async-scheduling"))
    schedule_conservativeness: float = param(
        1.0, "Room admission keeps for the running requests' outputs, as SGLang's --schedule-conservativeness: a "
        "waiting request is admitted only if the free KV blocks also cover a fraction (new_token_ratio) of every "
        "running request's remaining output (max_tokens, clipped at 4096; all of it for ignore_eos requests). The "
        "fraction starts at min(0.7 x this, 1), decays to 0.14 times that over 600 steps and is re-estimated "
        "after a preemption. When that sum refuses an ignore_eos request, SGLang's finish-time check may still "
        "admit it: the running requests' finishes, simulated in order, must never need more blocks than there are. "
        "0: no reservation (admit while the next chunk's blocks are free; running requests may then outgrow the "
        "cache and be preempted). The default 1 is SGLang's too; docs/benchmarks.md shows its effect.",
        flags=("--schedule-conservativeness",), ge=0, allow_inf_nan=False)

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be positive, or -1 to disable chunked prefill")
        return v

    @field_validator("max_mixed_prefill_tokens")
    @classmethod
    def _mixed(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be positive, or -1 for no bound")
        return v

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_alias(cls, v: Any) -> Any:
        return {"fifo": "fcfs", "slai": "slo"}.get(v, v) if isinstance(v, str) else v


class CacheSection(Section):
    """The paged KV cache."""

    block_size: int = param(16, "Tokens per KV cache block (a power of two).", ge=1, le=256)
    gpu_memory_utilization: float = param(
        0.9, "Fraction of the GPU's total memory for weights, activations and KV cache; lower it to leave "
        "headroom. Start-up stops with the numbers when that much is not free.",
        flags=("--gpu-memory-utilization", "--mem-fraction-static"), gt=0, le=1)
    max_total_tokens: int | None = param(
        None, "Size of the KV token pool. Unset: computed from gpu_memory_utilization (on CPU: enough for "
        "max_num_seqs full sequences, capped).", ge=1)
    enable_prefix_caching: bool = param(True, "Reuse KV blocks of identical prompt prefixes across requests.")
    host_cache: bool = param(
        False, "A host-memory tier under the GPU KV cache: blocks evicted from the GPU stay reusable from host memory "
        "(SGLang's hierarchical cache, TokenSpeed's KVStore).",
        flags=("--host-cache", "--enable-hierarchical-cache"))
    host_cache_ratio: float | None = param(
        None, "Host tier size as a multiple of the GPU KV pool. Unset: the engine's default (2).",
        flags=("--host-cache-ratio", "--hicache-ratio", "--kvstore-ratio"), gt=0)
    host_cache_size_gb: float | None = param(
        None, "Host tier size in GB; overrides host_cache_ratio when above 0.",
        flags=("--host-cache-size-gb", "--hicache-size", "--kvstore-size"), ge=0)
    host_cache_io_backend: Literal["direct", "kernel"] | None = param(
        None, "How blocks move between GPU and host: `kernel` (GPU copy kernels) or `direct` (cudaMemcpy).",
        flags=("--host-cache-io-backend", "--hicache-io-backend", "--kvstore-io-backend"))
    host_cache_mem_layout: Literal["layer_first", "page_first", "page_first_direct", "page_head"] | None = param(
        None, "Layout of the host pool.", flags=("--host-cache-mem-layout", "--hicache-mem-layout",
                                                 "--kvstore-mem-layout"))
    host_cache_write_policy: Literal["write_through", "write_through_selective", "write_back"] | None = param(
        None, "When GPU blocks are copied to the host tier: `write_back` when the GPU cache evicts them, "
        "`write_through` once they are cached, in steps that load nothing from the host, so a later eviction costs "
        "no copy in the admission step that evicts (its first token waits for that step's copies). Unset: "
        "write_back. write_through_selective is refused.", flags=("--host-cache-write-policy",
                                                                      "--hicache-write-policy"))
    host_cache_storage_backend: str | None = param(
        None, "A storage tier under the host tier (mooncake, hf3fs, file, nixl, ...). Unset: none. This build has "
        "`file`: the disk tier (disk_cache), in disk_cache_dir; the others are refused at start-up.",
        flags=("--host-cache-storage-backend", "--hicache-storage-backend", "--kvstore-storage-backend"))
    host_cache_storage_prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] | None = param(
        None, "How long a request waits for blocks prefetched from the storage tier. This build's disk tier "
        "completes every fetch before the step that needs it (wait_complete); the others are refused.",
        flags=("--host-cache-storage-prefetch-policy", "--hicache-storage-prefetch-policy"))
    host_cache_storage_config: dict[str, Any] = param(
        default_factory=dict, description="Extra settings of the storage backend (a JSON object).", flags=None,
        json_flag="--host-cache-storage-config")
    disk_cache: bool = param(
        False, "A disk tier behind the host tier (needs host_cache, disk_cache_dir, disk_cache_size_gb): blocks the "
        "host tier drops are spilled to a file there and fetched back on a later prefix hit (Atlas's high-speed "
        "swap; SGLang's and TokenSpeed's storage backend `file`).",
        flags=("--disk-cache", "--high-speed-swap"))
    disk_cache_dir: str | None = param(None, "Directory of the disk tier's file (one per worker "
                                       "process, unlinked once open: freed when the process ends).",
                                       flags=("--disk-cache-dir", "--high-speed-swap-dir"))
    disk_cache_size_gb: float | None = param(None, "Disk tier size in GiB (per worker process).",
                                             flags=("--disk-cache-size-gb", "--high-speed-swap-gb"), gt=0)
    ssm_cache_slots: int | None = param(
        None, "Snapshot slots of hybrid linear-attention models' recurrent states kept for prefix reuse (Atlas's "
        "--ssm-cache-slots; each running request has its own state slot besides). Unset: one per max_num_seqs.",
        flags=("--ssm-cache-slots",), ge=1)
    ssm_checkpoint_interval: int | None = param(
        None, "Tokens between snapshots of hybrid models' recurrent states taken during prefill for prefix reuse, "
        "a multiple of block_size (Atlas's --ssm-checkpoint-interval). Unset: no snapshots, and prefix caching "
        "is off for hybrid models.", flags=("--ssm-checkpoint-interval",), ge=1)
    ssm_cache_dtype: StateDtype = param(
        "auto", "Data type of hybrid linear-attention models' state cache: the short convolution's states and, "
        "unless ssm_state_dtype is set, the recurrent states (vLLM's --mamba-cache-dtype). auto: the model's dtype "
        "for the convolution states; the recurrent states follow ssm_state_dtype.",
        flags=("--ssm-cache-dtype", "--mamba-cache-dtype"))
    ssm_state_dtype: StateDtype = param(
        "auto", "Data type of hybrid models' recurrent states (vLLM's --mamba-ssm-cache-dtype, SGLang's "
        "--mamba-ssm-dtype). auto: ssm_cache_dtype when that is set, else the model config's mamba_ssm_dtype, "
        "else float32 (the state accumulates over the whole sequence; vLLM's auto is the model's dtype).",
        flags=("--ssm-state-dtype", "--mamba-ssm-cache-dtype", "--mamba-ssm-dtype"))
    compile_cache_dir: str = param(
        "~/.cache/appliance", "Directory of the persistent compile cache: Triton's compiled kernels (its "
        "`triton/` subdirectory, TRITON_CACHE_DIR of every process) and torch inductor's (`inductor/`), reused "
        "by every later start on this machine. Put it on a persistent volume to keep replicas' starts warm.",
        flags=None, min_length=1)
    compile_workers: int | None = param(
        None, "Processes per worker that compile, while the weights load, the Triton kernel variants an earlier "
        "start of the same layer shapes and kernel settings listed in compile_cache_dir (`kernels/`, or a list the "
        "build ships); the warm-up then loads those from the cache. 0: off (each start compiles as its warm-up "
        "goes, and lists nothing). Unset: half the CPU cores, at most 8.", flags=None, ge=0)

    @field_validator("block_size")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v


class BackendsSection(Section):
    """Kernel and runtime backends. `auto` picks per device; set them explicitly in production."""

    attention: Name = param("auto", "Attention kernels: `auto` (triton on GPU, torch on CPU), `torch` "
                            "(reference), `triton`, `flashinfer`; the source engines' other names (fa3, trtllm_mla, "
                            "rocm_aiter_fa, ascend, ...) are kept and refused at start-up.",
                            flags="--attention-backend")
    drafter_attention: Name | None = param(
        None, "Attention backend of the speculative drafter. Unset: same as attention.",
        flags="--drafter-attention-backend")
    moe: Name = param("auto", "Fused MoE kernels: `auto`, `torch`, `triton`; the source engines' other names "
                      "(deep_gemm, flashinfer_trtllm, cutlass, aiter, ...) are kept and refused at start-up.",
                      flags="--moe-backend")
    draft_moe: Name | None = param(None, "MoE backend of the draft model. Unset: same as moe.",
                                         flags="--draft-moe-backend")
    linear: Name = param("auto", "Dense GEMM kernels: `auto` picks per device and dtype; the source engines' "
                         "names (aiter, emulation, ...) are kept and refused at start-up.", flags="--linear-backend")
    all2all: All2AllBackend = param("auto", "All-to-all of MoE tokens under expert parallelism.",
                                    flags="--all2all-backend")
    deepep_mode: Literal["auto", "normal", "low_latency"] = param("auto", "DeepEP mode.")
    sampling: Literal["auto", "torch", "greedy", "flashinfer", "flashinfer_full"] = param(
        "auto", "Sampling kernels: `auto` (argmax for temperature-0 rows, the Triton sampler for plain random "
        "rows on a GPU, torch for the rest), `torch` (the torch sampler for every random row), `greedy` "
        "(TokenSpeed's argmax-only backend: every request decoded greedily), `flashinfer`, `flashinfer_full`.",
        flags="--sampling-backend")
    dp_sampling: bool = param(False, "Data-parallel sampling: the logits processor plans the logits layout.")
    enforce_eager: bool = param(False, "Never capture CUDA graphs (eager execution only).")
    cuda_graph_max_bs: int | None = param(
        None, "Largest batch captured as a CUDA graph. Unset: min(max_num_seqs, 256).",
        flags=("--max-cudagraph-capture-size", "--cuda-graph-max-bs"), ge=1)
    cuda_graph_sizes: list[int] | None = param(
        None, "Exact batch sizes to capture. Unset: 1, 2, 4, 8 then multiples of 8 up to cuda_graph_max_bs.",
        flags=("--cudagraph-capture-sizes", "--cuda-graph-bs"))
    piecewise_cuda_graph: bool = param(
        True, "Run mixed / prefill steps' forward as CUDA graphs captured between its attention calls (attention "
        "runs eagerly between the replays; token counts padded up to 16, 32, 48 ... 512, then buckets at most 1/8 "
        "apart). The Llama family and its MoE models (Triton fused MoE) on one GPU, with chunked prefill and decode "
        "graphs on; elsewhere those steps run eagerly.",
        flags="--enable-piecewise-cuda-graph")
    piecewise_cuda_graph_max_tokens: int | None = param(
        None, "Largest step, in tokens, run through the piecewise graphs (larger ones run eagerly); at most "
        "scheduler.chunked_prefill_size, which is the default.", flags="--piecewise-cuda-graph-max-tokens", ge=16)
    decode_chain: bool = param(
        True, "Run the Llama family's decoder layers as six fused kernels each (the norms, rotary + KV store and "
        "SiLU-and-mul in the GEMVs' epilogues) for decode batches of at most 16 rows: on a GPU with a kernel "
        "attention backend, tp 1, and layers the chain serves (dense MLP, no q/k norm, whole-head neox rotary, no "
        "bias on o / gate_up / down). Off, those batches run each layer's own kernels.")
    enable_allreduce_fusion: bool = param(False, "Fuse all-reduce with the following RMSNorm.")
    comm_fusion_max_num_tokens: int | None = param(None, "Most tokens a fused communication kernel handles.", ge=1)
    mla_chunk_multiplier: int | None = param(None, "Chunk multiplier of MLA prefill attention.", ge=1)
    enable_mla_l1_5_cache: bool = param(False, "TokenSpeed's MLA L1.5 cache.")
