"""Output parsers of the chat route: tool calls and reasoning. Pure text in, records out; no HTTP, no torch.

How the chat route uses them (one parser instance per request and per choice; none is shared). The short path:

    decision = resolve_thinking(disable_thinking=api.disable_thinking, enable_thinking=kwargs.get("enable_thinking"),
                                reasoning_effort=..., budget_tokens=..., max_thinking_budget=api.thinking_budget,
                                max_tokens=max_tokens, structured_output=<a grammar constrains this request>)
    spec = forced_tool_spec(ToolSet(body.tools), body.tool_choice)      # tool_choice "required" / named, else None
    spec = spec or appliance.structured.spec_from_request(body)          # a request giving both is a 400
    # render the template with enable_thinking=decision.enabled; generate (under `spec` when it is not None)
    mp = build_message_parser(reasoning_parser=api.reasoning_parser, tool_call_parser=api.tool_call_parser,
                              tools=body.tools, tool_choice=body.tool_choice,
                              thinking_enabled=decision.enabled, prompt_text=prompt)    # ValueError -> 400
    message = mp.parse(text)        # ParsedMessage(reasoning_content, content, tool_calls, errors, finish_reason)
    delta = mp.feed(text_delta)     # MessageDelta | None; delta.to_openai() is the choices[i].delta body
    delta = mp.finish()             # once, at the end of the choice
    (finish_reason: "tool_calls" when any call was emitted, else the engine's)

The pieces, for finer control:

Reasoning (api.reasoning_parser; skip when it is unset)
    decision = resolve_thinking(disable_thinking=api.disable_thinking,
                                enable_thinking=body.chat_template_kwargs.get("enable_thinking"),
                                reasoning_effort=body.reasoning_effort,
                                budget_tokens=(body.thinking or {}).get("budget_tokens"),
                                max_thinking_budget=api.thinking_budget, max_tokens=max_tokens)
    # render the template with enable_thinking=decision.enabled, then:
    rp = get_reasoning_parser(api.reasoning_parser, thinking_enabled=decision.enabled, prompt_text=prompt)
    reasoning, content = rp.parse(text)                      # non-streaming
    r_delta, c_delta = rp.feed(delta); ...; rp.finish()      # streaming: strings or None
    ThinkingBudget(decision.budget, end_token_ids=tok.encode("\n</think>\n\n"), start_tag_ids=[think_id],
                   in_reasoning=rp.in_reasoning) is the per-request state for the sampler (forced_token/observe)
    when decision.budget is not None. The chat route sends it to the workers as SamplingParams.extra
    ["thinking_budget"] (server/constraints.py); executor/logits_processors.py enforces it.

Tool calls (api.tool_call_parser; skip when the request has no tools or tool_choice is "none")
    tools = ToolSet(body.tools)                              # ValueError -> 400 (bad tool definitions)
    if (spec := forced_tool_spec(tools, body.tool_choice)) is not None:
        # tool_choice "required" or a named function: generate under `spec` (appliance.structured), then
        parsed = parse_forced_output(text, tools, body.tool_choice)   # or ForcedToolStream(...).feed/finish
    else:
        parser = get_tool_parser(api.tool_call_parser)(tools)        # ValueError for an unknown name
        parsed = parser.parse(content)                        # ParsedTools(content, tool_calls, errors)
        deltas = parser.feed(c_delta); ...; parser.finish()   # list[Delta]
    Feed the tool parser the *content* the reasoning parser returns, not the raw text.
    A Delta has either `.content` (text) or `.tool_call` (ToolCallDelta; `.to_openai()` is one entry of
    `choices[0].delta.tool_calls`). A call's first delta has id, type, name and arguments ""; the next one
    has the whole arguments string (calls are emitted when complete, because they are checked first).
    `assemble(deltas)` folds streamed deltas into the non-streaming ParsedTools.
    finish_reason is "tool_calls" when parsed.tool_calls is non-empty.
    Parsers whose markers are special tokens have `needs_special_tokens = True` (llama3_json, mistral,
    deepseek_v3; reasoning: mistral; MessageParser.needs_special_tokens combines them): detokenize their
    requests with skip_special_tokens=False or the markers are lost.

Rule for calls that fail: a tool-call block is all or nothing. If it does not follow the format, names a
function not in `tools`, or has arguments that fail the tool's JSON schema (appliance/server/parsers/
tool_calls/schema_check.py lists the keywords checked), the block's raw text is returned as content and the
reason is appended to `parser.errors` / `ParsedTools.errors` (log it; the response stays 200, as the model
did answer). Under a forced tool_choice, invalid output (e.g. cut by max_tokens) likewise comes back as content.

Names: tool parsers hermes (alias qwen, qwen25), llama3_json (llama3), mistral, deepseek_v3 (deepseek_v31),
pythonic, qwen3_coder; reasoning parsers deepseek_r1, qwen3, deepseek_v31, kimi_k2, kimi_k25, mistral, and base
(any tags: get_reasoning_parser("base", start="<think>", end="</think>")).
"""
from __future__ import annotations

from appliance.server.parsers.message import MessageDelta, MessageParser, ParsedMessage, build_message_parser
from appliance.server.parsers.reasoning import (
    ReasoningFormat,
    ReasoningParser,
    ThinkingBudget,
    ThinkingDecision,
    get_reasoning_parser,
    reasoning_parser_names,
    resolve_thinking,
)
from appliance.server.parsers.tool_calls import (
    Delta,
    ForcedToolStream,
    ParsedTools,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolSet,
    assemble,
    forced_tool_spec,
    get_tool_parser,
    parse_forced_output,
    tool_parser_names,
)

__all__ = [
    "Delta",
    "ForcedToolStream",
    "MessageDelta",
    "MessageParser",
    "ParsedMessage",
    "ParsedTools",
    "ReasoningFormat",
    "ReasoningParser",
    "ThinkingBudget",
    "ThinkingDecision",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolSet",
    "assemble",
    "build_message_parser",
    "forced_tool_spec",
    "get_reasoning_parser",
    "get_tool_parser",
    "parse_forced_output",
    "reasoning_parser_names",
    "resolve_thinking",
    "tool_parser_names",
]
