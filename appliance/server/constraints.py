"""What a request constrains generation with, turned into SamplingParams.extra for the workers.

- Output constraints (appliance.structured): response_format json_object / json_schema, vLLM's
  `structured_outputs` and `guided_*` fields, SGLang's `regex` / `ebnf`, and tool_choice "required" or a named
  function (forced_tool_spec). At most one per request; each is checked here (a bad schema, regex or grammar
  is a 400, as is a missing xgrammar) and travels as extra["structured"] = spec.to_dict().
- The thinking budget (resolve_thinking's decision) travels as extra["thinking_budget"]: the budget and the
  token ids of the reasoning tags, which the workers' ThinkingBudgetProcessor enforces.
The workers apply both in executor/logits_processors.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.engine.sampling_params import SamplingParams
from appliance.server.errors import ApiError
from appliance.structured import (
    StructuredOutputError,
    StructuredSpec,
    spec_from_request,
)
from appliance.structured.tool_choice import named_function, tool_choice_schema

_TOOL_CHOICE_FORCES = ("required",)


def forces_tool_call(tool_choice: Any) -> bool:
    """tool_choice "required" or a named function (checked against `tools` when the spec is built)."""
    return tool_choice in _TOOL_CHOICE_FORCES or isinstance(tool_choice, Mapping)


async def checked_output_spec(ctx: Any, body: Mapping[str, Any], **kwargs: Any) -> StructuredSpec | None:
    """output_spec, then compiled on the grammar threads (structured/validate.SpecChecker): the spec to send the
    workers, or None; 400 on a bad constraint or one that takes longer than api.grammar_compile_timeout."""
    from appliance.structured.validate import SpecChecker

    spec = output_spec(body, **kwargs)
    if spec is None:
        return None
    checker = getattr(ctx, "spec_checker", None)
    if checker is None:
        api = ctx.config.api
        checker = ctx.spec_checker = SpecChecker(api.grammar_compile_timeout, api.grammar_cache_size)
    try:
        return await checker.prepare(spec)
    except StructuredOutputError as exc:
        raise ApiError(400, str(exc), param=_constraint_field(body) or "tool_choice") from None


def output_spec(body: Mapping[str, Any], *, tools: list[Mapping[str, Any]] | None = None, tool_choice: Any = None,
                parallel_tool_calls: bool | None = None) -> StructuredSpec | None:
    """The request's output constraint (400 on bad input or without xgrammar), or None; compiling it is
    checked_output_spec's part."""
    from appliance.structured import validate

    try:
        spec = spec_from_request(body)
        param = _constraint_field(body)
        if forces_tool_call(tool_choice):
            if spec is not None:
                raise StructuredOutputError(f"tool_choice {_describe(tool_choice)} already constrains the output; "
                                            f"drop {param}")
            spec, param = _tool_spec(tools or [], tool_choice, parallel_tool_calls), "tool_choice"
        if spec is not None:
            validate.require_xgrammar()
    except StructuredOutputError as exc:
        raise ApiError(400, str(exc), param=_constraint_field(body) or "tool_choice") from None
    return spec


def _tool_spec(tools: list[Mapping[str, Any]], tool_choice: Any, parallel: bool | None) -> StructuredSpec:
    from appliance.server.parsers.tool_calls import ToolSet

    try:
        toolset = ToolSet(tools)
    except ValueError as exc:
        raise StructuredOutputError(str(exc)) from None
    schema = tool_choice_schema({t.name: t.parameters for t in toolset}, tool_choice)
    assert schema is not None  # forces_tool_call said so
    if named_function(tool_choice) is None and parallel is False:
        schema["maxItems"] = 1  # parallel_tool_calls=false: exactly one call
    return StructuredSpec.json_schema(schema)


def _constraint_field(body: Mapping[str, Any]) -> str | None:
    for key in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "regex", "ebnf"):
        if body.get(key) is not None:
            return key
    return None


def _describe(tool_choice: Any) -> str:
    name = named_function(tool_choice) if isinstance(tool_choice, Mapping) else None
    return f"naming {name!r}" if name else repr(tool_choice)


def check_compatible(params: SamplingParams, spec: StructuredSpec | None) -> None:
    """Settings a grammar cannot honour together with its forced end of output are refused, not ignored."""
    if spec is None:
        return
    if params.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be combined with structured outputs (the grammar ends the output "
                       "with EOS)", param="ignore_eos")
    if params.min_tokens:
        raise ApiError(400, "min_tokens cannot be combined with structured outputs (the grammar decides where the "
                       "output ends)", param="min_tokens")


def with_extra(params: SamplingParams, **extra: Any) -> SamplingParams:
    """params with these extra entries (None values are left out)."""
    add = {k: v for k, v in extra.items() if v is not None}
    if not add:
        return params
    return SamplingParams.from_dict({**params.to_dict(), "extra": {**params.extra, **add}})


def thinking_budget_extra(ctx: Any, budget: int | None, prompt_text: str) -> dict[str, Any] | None:
    """extra["thinking_budget"] for a thinking request with a budget (on the tokenizer thread: it encodes)."""
    if budget is None or not ctx.config.api.reasoning_parser:
        return None
    from appliance.server.parsers.reasoning import (
        get_reasoning_format,
        prompt_opens_reasoning,
    )

    fmt = get_reasoning_format(ctx.config.api.reasoning_parser)

    def encode(text: str) -> list[int]:
        return list(ctx.encode(text, add_special_tokens=False))

    return {"budget": int(budget), "end_token_ids": encode(f"\n{fmt.end}\n\n"),
            "start_tag_ids": encode(fmt.start), "end_tag_ids": encode(fmt.end),
            "in_reasoning": bool(fmt.starts_in_reasoning or prompt_opens_reasoning(prompt_text, fmt))}
