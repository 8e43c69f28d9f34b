"""Request bodies of the HTTP API (OpenAI's shapes; vLLM's extensions for sampling and /tokenize).

Validation is strict (a string is not a number) so wrong types get a 400 naming the field. Range checks that
depend on the deployment (caps, max_model_len) happen in `sampling.py`, where the config is known.
"""
from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from appliance.server.errors import ApiError

TokenIds = list[int]
log = logging.getLogger("appliance.server")


class RequestBody(BaseModel):
    # extra="ignore": clients send fields we do not model; parse_body logs each such name once (WARNING), the
    # ones that would change generation are declared below and refused when unsupported.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(RequestBody):
    model: str | None = None
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's shape) -> bias in [-100, 100]
    user: str | None = None
    # vLLM's extensions
    prompt_logprobs: int | None = Field(None, ge=-1)
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    use_beam_search: bool = False
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)  # lower is served first; scheduler.policy = "slo" only

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, v: bool) -> bool:
        if v:
            raise ValueError("beam search is not supported by this server; sample n choices instead")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("best_of other than 1 is not supported; use n")
        return v


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # read from the raw body (server/constraints.py)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)  # tool_calls, name, tool_call_id... go to the template

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: Any) -> str:
        if not isinstance(v, str) or not v:
            raise ValueError("role must be a non-empty string")
        return v


class ThinkingOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)  # "type": "enabled" etc. are accepted

    budget_tokens: int | None = Field(None, ge=0)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary, capped by api.caps.max_logprobs
    echo: bool = False  # vLLM: the answer's content starts with the last message's content
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # response_format and the other output constraints are read from the raw body (server/constraints.py)
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking: ThinkingOptions | None = None  # Anthropic-style {"budget_tokens": N} (see parsers/reasoning/budget.py)

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestBody):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# fields read from the raw body rather than the models (server/constraints.py)
RAW_BODY_FIELDS = frozenset({"structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                             "regex", "ebnf"})
_warned: set[str] = set()


def warn_unknown_fields(model: type[BaseModel], body: dict[str, Any]) -> list[str]:
    """Fields of `body` that `model` does not read: accepted (clients send extras), logged at WARNING once per
    field name for the process's life, so an ignored setting is never silent. Returns the new names."""
    known = model.model_fields.keys() | RAW_BODY_FIELDS
    new = sorted(k for k in body if k not in known and f"{model.__name__}.{k}" not in _warned)
    for name in new:
        _warned.add(f"{model.__name__}.{name}")
        log.warning("%s: request field %r is not supported and is ignored (logged once)", model.__name__, name)
    return new


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; the first problem becomes a 400 whose `param` names the field. Unknown fields are
    ignored, each name logged once (warn_unknown_fields)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    warn_unknown_fields(model, body)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        # union members show up in the location ("prompt.str", "prompt.list[int]"); name the field only
        loc = ".".join(str(p) for p in err.get("loc", ()) if not _is_type_tag(p))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None) from None


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "none") or "[" in part
                                      or part.startswith(("function-", "tagged-union")))


def parse_tokenize(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    if isinstance(body, dict) and "messages" in body:
        return parse_body(TokenizeChatRequest, body)
    return parse_body(TokenizeCompletionRequest, body)
