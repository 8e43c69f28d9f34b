"""Turn an API request into engine SamplingParams: server-wide defaults from `[sampling]`, caps from
`[api.caps]`, and the model's context length. Anything out of range is a 400 naming the parameter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.engine.sampling_params import SamplingParams
from appliance.server.errors import ApiError, bad_request
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_n: int = 16
    max_logprobs: int = 20
    max_tokens: int | None = None
    max_stop: int = 16

    def check_n(self, n: int) -> None:
        """api.caps.max_n, checked before the queue check: an n that can never be served is a 400, not a 429."""
        if n > self.max_n:
            raise bad_request(f"n must be at most {self.max_n}, got {n}", "n")

    @classmethod
    def from_config(cls, config: ApplianceConfig, max_model_len: int, vocab_size: int) -> Limits:
        caps = config.api.caps
        return cls(max_model_len, vocab_size, caps.max_n, caps.max_logprobs, caps.max_tokens, caps.max_stop)


def build_sampling(req: CompletionRequest | ChatCompletionRequest, defaults: Any, limits: Limits,
                   num_prompt_tokens: int) -> SamplingParams:
    """SamplingParams for ONE choice (n is fanned out by the caller)."""
    if req.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n}, got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty", "prompt")
    if num_prompt_tokens >= limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, leaving no room for output.", "messages" if _is_chat(req) else "prompt")
    room = limits.max_model_len - num_prompt_tokens
    max_tokens = req.effective_max_tokens if isinstance(req, ChatCompletionRequest) else req.max_tokens
    if max_tokens == 0:
        if not getattr(req, "echo", False) or isinstance(req, ChatCompletionRequest):
            raise bad_request("max_tokens must be at least 1 (0 is allowed on /v1/completions with echo, to score "
                              "the prompt only)", "max_tokens")
        max_tokens = 1  # the engine generates one token; completions.py drops it (prompt_only)
    if max_tokens is None:
        max_tokens = room if limits.max_tokens is None else min(room, limits.max_tokens)
    elif limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise bad_request(f"max_tokens must be at most {limits.max_tokens}, got {max_tokens}", "max_tokens")
    elif max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion).", "max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop:
        raise bad_request(f"at most {limits.max_stop} stop sequences are allowed, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise bad_request("stop sequences must be non-empty", "stop")
    stop_ids = list(req.stop_token_ids or [])
    if len(stop_ids) > max(limits.max_stop, 64):
        raise bad_request("too many stop_token_ids", "stop_token_ids")
    for t in stop_ids:
        if not 0 <= t < limits.vocab_size:
            raise bad_request(f"stop_token_ids: token id {t} is outside the vocabulary [0, {limits.vocab_size})",
                              "stop_token_ids")
    logprobs = _logprobs(req, limits)
    prompt_logprobs = _capped(req.prompt_logprobs, "prompt_logprobs", limits)
    if req.min_tokens > max_tokens:
        raise bad_request("min_tokens must not exceed max_tokens", "min_tokens")
    try:
        return SamplingParams(
            n=1,
            temperature=_pick(req.temperature, defaults.temperature),
            top_p=_pick(req.top_p, defaults.top_p),
            top_k=_pick(req.top_k, defaults.top_k),
            min_p=_pick(req.min_p, defaults.min_p),
            top_n_sigma=float(getattr(defaults, "top_n_sigma", 0.0)),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=_pick(req.repetition_penalty, defaults.repetition_penalty),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(req.logit_bias, limits),
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            priority=req.priority,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def child_sampling(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n: distinct seeds, so seeded requests with n > 1 still give n different samples."""
    if params.seed is None or index == 0:
        return params
    d = params.to_dict()
    d["seed"] = (params.seed + index) % (2**63)
    return SamplingParams.from_dict(d)


def _logprobs(req: CompletionRequest | ChatCompletionRequest, limits: Limits) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        value, name = ((req.top_logprobs or 0) if req.logprobs else None), "top_logprobs"
    else:
        value, name = req.logprobs, "logprobs"
    return _capped(value, name, limits)


def _capped(value: int | None, name: str, limits: Limits) -> int | None:
    """A number of top logprobs: -1 is the whole vocabulary, capped by api.caps.max_logprobs (vLLM's -1)."""
    if value == -1:
        return min(limits.vocab_size, limits.max_logprobs)
    if value is not None and value > limits.max_logprobs:
        raise bad_request(f"{name} must be at most {limits.max_logprobs}, got {value}", name)
    return value


def _logit_bias(bias: dict[str, float] | None, limits: Limits) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        token = int(key)
        if not 0 <= token < limits.vocab_size:
            raise bad_request(f"logit_bias: token id {token} is outside the vocabulary [0, {limits.vocab_size})",
                              "logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def truncate_prompt(ids: list[int], req: CompletionRequest | ChatCompletionRequest, limits: Limits) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (truncation_side "right": the first k);
    -1 keeps up to max_model_len - 1, leaving room for one output token."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = limits.max_model_len - 1
    elif k >= limits.max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be below max_model_len ({limits.max_model_len}), got {k}",
                          "truncate_prompt_tokens")
    if len(ids) <= k:
        return ids
    return ids[:k] if req.truncation_side == "right" else ids[len(ids) - k:]


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _is_chat(req: Any) -> bool:
    return isinstance(req, ChatCompletionRequest)
