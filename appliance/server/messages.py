"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat completions path.

A request becomes a chat request (`to_chat_body`: system -> a system message; text / tool_use / tool_result /
thinking blocks -> content, assistant tool_calls, tool messages, reasoning_content; tools' input_schema ->
function parameters; tool_choice auto / any / tool / none -> auto / required / named / none;
stop_sequences -> stop; thinking {type, budget_tokens} -> enable_thinking and the thinking budget) and runs
through server/chat.py's `prepare_chat`, like /v1/chat/completions. The answer's blocks (server/blocks.py)
become content blocks: thinking, text, tool_use. Errors are Anthropic's shape
({"type": "error", "error": {"type", "message"}}); streaming is server/messages_stream.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.server.blocks import Block, blocks_of_message
from appliance.server.chat import PreparedChat, prepare_chat, render_prompt
from appliance.server.context import ServerContext
from appliance.server.errors import ApiError, bad_request
from appliance.server.exchange import Exchange, run_exchange
from appliance.server.generation import collect_choices, with_deadline
from appliance.server.protocol import (
    ChatCompletionRequest,
    RequestBody,
    TokenizeChatRequest,
    parse_body,
)
from appliance.server.request_body import read_json
from appliance.server.sse import run_until_disconnect

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    """An ApiError in Anthropic's shape (the message scrubbed as in OpenAI's)."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.body()["error"]["message"]}}


def anthropic_error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(err), status_code=err.status, headers=err.headers)


class ThinkingConfig(RequestBody):
    type: str  # "enabled" | "disabled"
    budget_tokens: int | None = Field(None, ge=0)


class MessagesRequest(RequestBody):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(RequestBody):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad_request(f"{where}: only text blocks are allowed here", "messages")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _message(i: int, m: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message -> chat messages (tool_result blocks become tool messages, ahead of the text)."""
    role, where = m.get("role"), f"messages[{i}]"
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be user or assistant", "messages")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
    texts, thinking, calls, results = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            text = _text(result, f"{where}.content[{j}]") if result is not None else ""
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": f"Error: {text}" if block.get("is_error") else text})
        else:
            raise bad_request(f"{where}.content[{j}]: block type {kind!r} is not supported in a {role} message",
                              "messages")
    out: list[dict[str, Any]] = list(results)
    if role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if thinking:
            turn["reasoning_content"] = "".join(thinking)
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request("tool_choice.type must be auto, any, tool (with name) or none", "tool_choice")


def to_chat_body(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        messages += _message(i, m)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        body.update(add_generation_prompt=False, continue_final_message=True)  # Anthropic's prefill
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema") or {}}}
                         for t in req.tools]
    choice, parallel = _tool_choice(req.tool_choice)
    body.update({k: v for k, v in (("tool_choice", choice), ("parallel_tool_calls", parallel)) if v is not None})
    if req.thinking is not None:
        enabled = req.thinking.type == "enabled"
        body["chat_template_kwargs"] = {"enable_thinking": enabled}
        if enabled and req.thinking.budget_tokens is not None:
            body["thinking"] = {"budget_tokens": req.thinking.budget_tokens}
    if isinstance(req, MessagesRequest):
        optional = {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "temperature": req.temperature,
                    "top_p": req.top_p, "top_k": req.top_k}
        body.update({k: v for k, v in optional.items() if v is not None})
    return body


def content_block(block: Block) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": block.arguments()}


def stop_reason(finish: str | None, stop: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the chat finish and stop reasons."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


@dataclass
class MessageRun:
    ctx: ServerContext
    prepared: PreparedChat
    exchange: Exchange
    mid: str

    def usage(self) -> dict[str, Any]:
        u = self.prepared.gen.usage
        return {"input_tokens": len(self.prepared.gen.prompt_token_ids), "output_tokens": u.completion_tokens,
                "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}

    def message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None) -> dict[str, Any]:
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.ctx.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage()}

    def record(self, finish: str | None, text: str, body: dict[str, Any] | None) -> None:
        self.exchange.done(self.prepared.gen.usage.as_dict(True), finish, text, body)


async def create_message(ctx: ServerContext, request: Request) -> Response:
    return await run_exchange(ctx, request, _create)


async def _create(ctx: ServerContext, request: Request, body: Any, exchange: Exchange) -> Response:
    req: MessagesRequest = parse_body(MessagesRequest, body)
    chat_body = to_chat_body(req)
    chat: ChatCompletionRequest = parse_body(ChatCompletionRequest, chat_body)
    prepared = await prepare_chat(ctx, chat, chat_body, exchange, id_prefix="msg")
    run = MessageRun(ctx, prepared, exchange, prepared.rid.replace("msg-", "msg_"))
    if req.stream:
        from appliance.server.messages_stream import stream_message

        return stream_message(run)
    result = await run_until_disconnect(request.receive, lambda: _collect(run))
    return JSONResponse(result) if result is not None else Response(status_code=499)


async def _collect(run: MessageRun) -> dict[str, Any]:
    got = await collect_choices(with_deadline(run.prepared.gen.stream(), run.ctx.request_timeout))
    proc = run.prepared.processors[0]
    finish, stop = got.reasons(0)
    blocks = blocks_of_message(proc.final(got.text(0)))
    finish = proc.finish_reason(finish)  # after `final`: "tool_calls" once the parser found calls
    body = run.message([content_block(b) for b in blocks], *stop_reason(finish, stop))
    run.record(finish, got.text(0), body)
    return body


async def count_tokens(ctx: ServerContext, request: Request) -> Response:
    """The prompt's token count as /v1/messages would render it (the chat template with tools)."""
    body = await read_json(request, ctx.config.api.caps.max_body_bytes)
    req: CountTokensRequest = parse_body(CountTokensRequest, body)
    ctx.check_model(req.model)
    chat_body = to_chat_body(req)
    tok: TokenizeChatRequest = parse_body(TokenizeChatRequest, {
        k: v for k, v in chat_body.items() if k in TokenizeChatRequest.model_fields})
    _, ids = await ctx.off_loop(render_prompt, ctx, tok, _thinking(req))
    return JSONResponse({"input_tokens": len(ids)})


def _thinking(req: CountTokensRequest) -> bool | None:
    return None if req.thinking is None else req.thinking.type == "enabled"

