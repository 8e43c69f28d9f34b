"""Config sections about serving: speculative decoding, the HTTP API, default sampling, observability."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from appliance.config.fields import param
from appliance.config.sections_engine import Name, Section

SpecAlgorithm = Literal["EAGLE", "EAGLE3", "MTP", "DFLASH", "DSPARK", "NGRAM", "STANDALONE"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class SpeculativeSection(Section):
    """Speculative decoding. Unset algorithm: off. `--speculative-config` takes the whole section as JSON and also
    understands vLLM's keys (method, with vLLM's method names such as draft_model, ngram_gpu or <arch>_mtp; model,
    num_speculative_tokens, quantization)."""

    algorithm: SpecAlgorithm | None = param(
        None, "Speculative algorithm: EAGLE, EAGLE3, STANDALONE (a smaller LLM drafts tokens; these three need "
        "draft_model_path), MTP (the model's own multi-token-prediction layers), DFLASH (block-diffusion drafter), "
        "DSPARK (TokenSpeed's and vLLM's DSpark drafter), NGRAM (prompt lookup).",
        flags="--speculative-algorithm")
    draft_model_path: str | None = param(None, "Draft model path or repo id.",
                                         flags=("--speculative-draft-model-path", "--speculative-draft-model"))
    draft_model_quantization: str = param("unquant", "Draft model quantization; `unquant` keeps its weights as "
                                          "stored.", flags="--speculative-draft-model-quantization")
    num_steps: int = param(3, "Draft model steps per verification.", flags="--speculative-num-steps", ge=1)
    num_draft_tokens: int | None = param(None, "Tokens a verification runs: the last confirmed token and the "
                                         "drafts (with eagle_topk > 1 the tree's best num_draft_tokens - 1 nodes). "
                                         "Unset: num_steps + 1.",
                                         flags="--speculative-num-draft-tokens", ge=1)
    eagle_topk: int = param(1, "Draft tree branching: each draft step expands the top-k children of the k best "
                            "nodes so far. 1: one chain. Trees (> 1) are drafted by EAGLE, EAGLE3, STANDALONE and MTP "
                            "(not on MLA or linear-attention models) and run without overlap and CUDA graphs.",
                            flags="--speculative-eagle-topk", ge=1)
    prompt_lookup_min: int | None = param(
        None, "NGRAM: shortest n-gram matched against the prompt and output so far. Unset: the algorithm's "
        "default.", flags=("--prompt-lookup-min", "--speculative-ngram-min-match-window-size"), ge=1)
    prompt_lookup_max: int | None = param(
        None, "NGRAM: longest n-gram matched. Unset: the algorithm's default.",
        flags=("--prompt-lookup-max", "--speculative-ngram-max-match-window-size"), ge=1)
    ngram_proposer: Literal["host", "device"] = param(
        "host", "NGRAM: where the lookup runs: `host` (numpy, one request at a time) or `device` (torch ops batched "
        "over the requests, each request's tokens kept on the device; vLLM's `ngram_gpu`). Both propose the same "
        "drafts.", flags="--speculative-ngram-proposer")
    eagle3_layers_to_capture: list[int] | None = param(
        None, "Target layers whose hidden states feed an EAGLE3 drafter. Unset: the drafter's default.",
        flags="--eagle3-layers-to-capture")
    disable_by_batch_size: int | None = param(
        None, "Verify no drafts while more than this many requests decode (drafting stops paying at large "
        "batches). Unset: always speculate.", flags="--speculative-disable-by-batch-size", ge=1)
    synthetic_acceptance_length: float | None = param(
        None, "Benchmarks only: force the accept decision so that a verification keeps this many tokens on "
        "average (accepted drafts + 1; between 1 and num_steps + 1). The drafter and the verify forward still run; "
        "outputs are not the model's. Needs enable_synthetic_acceptance.",
        flags="--speculative-synthetic-acceptance-length", ge=1.0)
    synthetic_acceptance_rates: list[float] | None = param(
        None, "Benchmarks only: force draft j to be accepted with probability rates[j] (given the drafts before it "
        "were). The drafter and the verify forward still run; outputs are not the model's. Needs "
        "enable_synthetic_acceptance.", flags="--speculative-synthetic-acceptance-rates")
    enable_synthetic_acceptance: bool = param(
        False, "Allow synthetic_acceptance_length / synthetic_acceptance_rates, which make outputs differ from the "
        "model's: for benchmarks with dummy weights only.", flags="--speculative-enable-synthetic-acceptance")

    @field_validator("algorithm", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @property
    def effective_num_draft_tokens(self) -> int:
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1


class MultimodalSection(Section):
    """Image / video inputs. This build serves text only: the keys are here so that a deployment translated from
    a vision-language recipe keeps its settings, and start-up refuses them (support.py)."""

    encoder_tp_mode: Literal["weights", "data"] | None = param(
        None, "How the vision encoder uses the tp group: `weights` splits its weights, `data` runs whole items "
        "data-parallel.", flags=("--mm-encoder-tp-mode",))
    encoder_attention: Name | None = param(None, "Attention backend of the vision encoder.",
                                           flags=("--mm-encoder-attn-backend", "--mm-attention-backend"))
    processor_cache_gb: float | None = param(
        None, "Cache of preprocessed media in GB; 0 turns it off.", flags=("--mm-processor-cache-gb",), ge=0)
    processor_cache_type: Literal["lru", "shm"] | None = param(None, "Where preprocessed media are cached.",
                                                               flags=("--mm-processor-cache-type",))
    limit_per_prompt: dict[str, Any] = param(
        default_factory=dict, description="Most items of each modality per prompt (`{image = 4, video = 0}`); all "
        "0 means text only.", flags=None, json_flag="--limit-mm-per-prompt")
    processor_kwargs: dict[str, Any] = param(default_factory=dict, description="Arguments of the media processor.",
                                             flags=None, json_flag="--mm-processor-kwargs")
    media_io_kwargs: dict[str, Any] = param(default_factory=dict, description="Arguments of media loading.",
                                            flags=None, json_flag="--media-io-kwargs")
    allowed_local_media_path: str | None = param(None, "Directory whose files requests may name as media.",
                                                 flags=("--allowed-local-media-path",))

    def text_only(self) -> bool:
        """Whether these settings leave the server text-only (what this build serves)."""
        defaults = type(self)()
        changed = {k for k in type(self).model_fields if getattr(self, k) != getattr(defaults, k)}
        changed -= {"processor_cache_gb"} if self.processor_cache_gb == 0 else set()
        changed -= {"limit_per_prompt"} if not any(self.limit_per_prompt.values()) else set()
        return not changed


class ApiCaps(Section):
    """Upper bounds on what one request may ask for; a request over a cap gets HTTP 400."""

    max_n: int = param(16, "Most choices (n, best_of) per request.", flags=None, ge=1)
    max_logprobs: int = param(20, "Most top logprobs per token.", flags="--max-logprobs", ge=0)
    max_tokens: int | None = param(None, "Most generated tokens per request. Unset: bounded by max_model_len.",
                                   flags=None, ge=1)
    max_stop: int = param(16, "Most stop strings per request.", flags=None, ge=0)
    max_body_bytes: int = param(8 * 1024 * 1024, "Largest accepted request body in bytes.", flags=None, ge=1024)


class ApiSection(Section):
    """The OpenAI-compatible HTTP API: binding, authentication, templates, parsers, limits."""

    host: str = param("127.0.0.1", "Address the HTTP server binds. Local-only by default; `0.0.0.0` exposes "
                      "it to the network (set api_key or api_key_file then).", flags=("--host", "--bind"))
    port: int = param(8000, "HTTP port.", ge=1, le=65535)
    served_model_name: str | None = param(None, "Model name shown by /v1/models and in responses. Unset: the "
                                          "model path.", flags=("--served-model-name", "--model-name"))
    api_key: str | None = param(None, "Bearer token every inference route requires. Prefer api_key_file: a "
                                "token on the command line is visible in `ps`.", flags=("--api-key", "--auth-token"))
    api_key_file: str | None = param(
        None, "File of accepted bearer tokens, one per line (blank lines and `#` comments ignored); read once "
        "at start-up. Combined with api_key when both are set.", flags=("--api-key-file", "--auth-tokens-file"))
    chat_template: str | None = param(None, "Chat template: a file path or an inline Jinja template. Unset: "
                                      "the tokenizer's own.")
    stream_interval: int = param(1, "Generated tokens buffered per streamed chunk.", ge=1)
    stream_output: bool = param(False, "Stream disjoint text segments rather than cumulative text (offline API).")
    request_timeout: float = param(300.0, "Seconds a request may run before it is aborted with an error; 0: "
                                   "no timeout.", ge=0)
    shutdown_grace_period: float = param(5.0, "Seconds open requests get to finish after SIGTERM (new ones are "
                                         "refused meanwhile); then the pipeline is stopped.", ge=0)
    reasoning_parser: Name | None = param(
        None, "Splits reasoning (thinking) text into `reasoning_content`. Unset: no split. Any name vLLM, SGLang or "
        "TokenSpeed use is accepted (`-` read as `_`); start-up refuses one appliance.server.parsers lacks.")
    tool_call_parser: Name | None = param(
        None, "Parses tool calls out of model text into OpenAI `tool_calls`. Unset: tool calls are not parsed. Any "
        "name vLLM, SGLang or TokenSpeed use is accepted; start-up refuses one appliance.server.parsers lacks.")
    enable_custom_logit_processor: bool = param(False, "Allow requests to carry custom logit processors.")
    disable_thinking: bool = param(False, "Force thinking off whatever the request asks (chat template "
                                   "`enable_thinking=False`, reasoning budget 0).", flags=("--disable-thinking",))
    thinking_budget: int | None = param(None, "Ceiling on reasoning tokens per request; a request's own budget "
                                        "applies below it. Unset: no ceiling.",
                                        flags=("--thinking-budget", "--max-thinking-budget"), ge=0)
    allowed_hosts: list[str] | None = param(
        None, "Accepted HTTP Host header values (other Hosts get 421). Unset: when `host` is a loopback address, "
        "only localhost, 127.0.0.1, [::1] and `host` itself (against DNS rebinding); any Host otherwise.",
        flags=("--allowed-hosts",))
    body_read_timeout: float = param(
        30.0, "Seconds a client may take to send a request body; over it the request gets 408 and its "
        "connection is closed. 0: no timeout.", flags=("--body-read-timeout",), ge=0)
    grammar_compile_timeout: float = param(
        10.0, "Seconds the HTTP process may spend checking one structured-output constraint (a JSON schema, "
        "regex or grammar, compiled on a thread off the event loop); over it the request gets 400.",
        flags=("--grammar-compile-timeout",), gt=0)
    grammar_cache_size: int = param(
        256, "Structured-output constraints whose check result the HTTP process keeps (least recently used "
        "first out).", flags=("--grammar-cache-size",), ge=0)
    responses_store_size: int = param(1024, "Responses kept in memory for /v1/responses' previous_response_id "
                                      "(the oldest dropped first); 0 turns the store off.", ge=0)
    enable_force_include_usage: bool = param(False, "Send the usage chunk at the end of every stream, as if "
                                             "each request set stream_options.include_usage.",
                                             flags="--enable-force-include-usage")
    caps: ApiCaps = param(default_factory=ApiCaps, description="Per-request resource caps.", flags=None)


class SamplingSection(Section):
    """Server-wide sampling defaults, used when a request leaves a parameter out."""

    temperature: float = param(1.0, "Default temperature; 0 is greedy.", flags="--default-temperature", ge=0)
    top_p: float = param(1.0, "Default nucleus probability mass.", flags="--default-top-p", gt=0, le=1)
    top_k: int = param(0, "Default top-k; 0 or -1 disables.", flags="--default-top-k", ge=-1)
    min_p: float = param(0.0, "Default min-p: keep tokens with probability >= min_p x the top one; 0 disables.",
                         flags="--default-min-p", ge=0, le=1)
    top_n_sigma: float = param(0.0, "Default top-n-sigma: keep logits >= max - n x std; 0 disables. Robust to "
                               "temperature drift in agent loops (1.0 is a common choice).",
                               flags="--default-top-n-sigma", ge=0)
    repetition_penalty: float = param(1.0, "Default repetition penalty; 1 disables.",
                                      flags="--default-repetition-penalty", gt=0)


class KvEventsConfig(Section):
    """Publishing of KV cache block stores and removals (a ZMQ multipart message per batch: topic, 8-byte
    big-endian sequence number, msgpack KVEventBatch)."""

    enable_kv_cache_events: bool = param(False, "Publish KV cache events.", flags=None)
    publisher: Literal["null", "zmq"] = param("null", "Publisher: `zmq` publishes, `null` drops.", flags=None)
    endpoint: str = param("tcp://127.0.0.1:5557", "ZMQ PUB endpoint (bound). Use tcp://*:5557 to publish to "
                          "other hosts; each attention-DP rank adds its rank to the port.", flags=None)
    topic: str = param("", "Topic frame sent before each batch.", flags=None)
    replay_endpoint: str | None = param(None, "ZMQ ROUTER endpoint that replays buffered batches from a "
                                        "sequence number. Unset: no replay.", flags=None)
    buffer_steps: int = param(10000, "Batches kept for replay.", flags=None, ge=1)
    hwm: int = param(100000, "ZMQ send high-water mark.", flags=None, ge=0)
    max_queue_size: int = param(100000, "Batches queued for the publisher thread before new ones are dropped.",
                                flags=None, ge=1)


class ObservabilitySection(Section):
    """Logging, metrics, KV events and request dumps."""

    log_level: LogLevel = param("info", "Runtime log level.")
    log_level_http: LogLevel | None = param(None, "HTTP server log level. Unset: log_level.")
    enable_log_requests: bool = param(False, "Log request metadata (and payloads at higher levels).")
    log_requests_level: int = param(0, "Request log verbosity: 0 metadata, 1 + sampling params, 2 + partial "
                                    "text, 3 + full text.", ge=0, le=3)
    enable_metrics: bool = param(False, "Serve Prometheus metrics on /metrics.")
    metrics_reporters: list[Literal["prometheus"]] = param(default_factory=lambda: ["prometheus"],
                                                           description="Metrics reporters.")
    decode_log_interval: int = param(40, "Log a decode-batch summary every N steps.", ge=1)
    enable_cache_report: bool = param(True, "Report cached prompt tokens in usage.prompt_tokens_details "
                                      "(OpenAI's shape); false leaves prompt_tokens_details out.")
    kv_events: KvEventsConfig = param(default_factory=KvEventsConfig, description="KV cache events publisher.",
                                      flags=None, json_flag="--kv-events-config")
    dump_path: str | None = param(None, "Append every chat/completions request and its response as JSON lines "
                                  "to this file. Unset: no dump.", flags=("--dump-path", "--dump"))

    @field_validator("log_level", "log_level_http", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v


__all__ = [
    "ApiCaps", "ApiSection", "KvEventsConfig", "MultimodalSection", "ObservabilitySection", "SamplingSection",
    "SpeculativeSection",
]
