"""POST /v1/responses: OpenAI's Responses API over the chat completions path.

A request becomes a chat request (`to_chat_body`: instructions -> a system message, input items -> messages,
function_call / function_call_output items -> assistant tool_calls / tool messages, text.format ->
response_format, max_output_tokens -> max_tokens, reasoning.effort -> reasoning_effort) and runs through
server/chat.py's `prepare_chat`: the same template, constraints, thinking budget, tool-call and reasoning
parsers, sampling, engine path, metrics, request log and dump. The answer's blocks (server/blocks.py) become
output items: reasoning, message (output_text), function_call. Streaming is server/responses_stream.py.

previous_response_id continues a stored conversation: answers are kept in a bounded in-memory store
(api.responses_store_size entries, oldest dropped first; 0 turns the store off and such requests get a 400).
"""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.server.blocks import Block, blocks_of_message
from appliance.server.chat import PreparedChat, prepare_chat
from appliance.server.context import ServerContext
from appliance.server.errors import ApiError, bad_request
from appliance.server.exchange import Exchange, run_exchange
from appliance.server.generation import collect_choices, with_deadline
from appliance.server.protocol import ChatCompletionRequest, RequestBody, parse_body
from appliance.server.sse import run_until_disconnect


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string or a list of input_text / output_text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad_request(f"{where}: content part type {kind!r} is not supported (text parts only)", "input")
        texts.append(str(part.get("text") or part.get("refusal") or ""))
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input -> chat messages (consecutive function_call items join one assistant message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer", "input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if not call["id"] or not call["function"]["name"]:
                raise bad_request(f"{where}: a function_call needs call_id and name", "input")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not part of the next prompt (chat templates drop it too)
        else:
            raise bad_request(f"{where}: input item type {kind!r} is not supported", "input")
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        if t.get("type") != "function":
            raise bad_request(f"tool type {t.get('type')!r} is not supported (function tools only)", "tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if k in t}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise bad_request("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise bad_request(f"text.format type {fmt.get('type')!r} is not supported", "text.format")


def to_chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    optional = {"max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
                "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
                "reasoning_effort": (req.reasoning or {}).get("effort")}
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


@dataclass
class ResponseStore:
    """previous_response_id's memory: response id -> the conversation it ended (chat messages), newest last."""

    capacity: int
    _items: OrderedDict[str, list[dict[str, Any]]] | None = None

    def __post_init__(self) -> None:
        self._items = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        if self.capacity <= 0:
            raise bad_request("previous_response_id needs the response store; api.responses_store_size is 0",
                              "previous_response_id")
        assert self._items is not None
        if response_id not in self._items:
            raise ApiError(404, f"response {response_id!r} is not stored here (unknown, or dropped from the "
                           f"store of {self.capacity})", param="previous_response_id")
        return list(self._items[response_id])

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        assert self._items is not None
        self._items[response_id] = conversation
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def store_of(ctx: ServerContext) -> ResponseStore:
    if ctx.response_store is None:
        ctx.response_store = ResponseStore(ctx.config.api.responses_store_size)
    return ctx.response_store


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_item(block: Block, rid: str) -> dict[str, Any]:
    """One finished block as a Responses output item."""
    item_id = f"{'rs' if block.kind == 'reasoning' else 'msg' if block.kind == 'text' else 'fc'}_{rid[5:]}_{block.index}"
    if block.kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": block.text}], "status": "completed"}
    if block.kind == "text":
        return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
                "content": [output_text(block.text)]}
    return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
            "arguments": block.text, "status": "completed"}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def assistant_turn(blocks: list[Block]) -> dict[str, Any]:
    """The answer as the chat message a follow-up request's history holds."""
    text = "".join(b.text for b in blocks if b.kind == "text")
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
             for b in blocks if b.kind == "tool"]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


@dataclass
class ResponseRun:
    """One /v1/responses request once accepted: what both the JSON and the streamed answer need."""

    ctx: ServerContext
    req: ResponsesRequest
    prepared: PreparedChat
    conversation: list[dict[str, Any]]  # the history without instructions, this request's input included
    exchange: Exchange
    rid: str
    created_at: int

    def usage(self, blocks: list[Block]) -> dict[str, Any]:
        u = self.prepared.gen.usage
        reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
        return {"input_tokens": len(self.prepared.gen.prompt_token_ids), "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                # the reasoning text's own tokens, re-encoded (the parser split text, not token ids)
                "output_tokens_details": {"reasoning_tokens": len(self.ctx.tokenizer.encode(
                    reasoning, add_special_tokens=False)) if reasoning else 0},
                "total_tokens": len(self.prepared.gen.prompt_token_ids) + u.completion_tokens}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 incomplete: str | None = None) -> dict[str, Any]:
        req = self.req
        return {"id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.ctx.model_name, "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "previous_response_id": req.previous_response_id, "parallel_tool_calls": req.parallel_tool_calls
                is not False, "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
                "tool_choice": req.tool_choice or "auto", "text": req.text or {"format": {"type": "text"}},
                "reasoning": req.reasoning, "metadata": req.metadata or {}, "store": req.store,
                "truncation": "disabled", "user": req.user}

    def finish(self, blocks: list[Block], finish_reason: str | None) -> dict[str, Any]:
        """The completed response object; stores the conversation; records the exchange."""
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        usage = self.usage(blocks)
        body = self.response("incomplete" if incomplete else "completed",
                             [output_item(b, self.rid) for b in blocks], usage, incomplete)
        if self.req.store:
            store_of(self.ctx).put(self.rid, self.conversation + [assistant_turn(blocks)])
        return body

    def record(self, finish_reason: str | None, text: str, body: dict[str, Any] | None) -> None:
        self.exchange.done(self.prepared.gen.usage.as_dict(True), finish_reason, text, body)


async def create_response(ctx: ServerContext, request: Request, body: Any = None) -> Response:
    return await run_exchange(ctx, request, _create, body)


async def _create(ctx: ServerContext, request: Request, body: Any, exchange: Exchange) -> Response:
    req: ResponsesRequest = parse_body(ResponsesRequest, body)
    history = store_of(ctx).get(req.previous_response_id) if req.previous_response_id else []
    conversation = history + input_messages(req.input)
    chat_body = to_chat_body(req, conversation)
    chat: ChatCompletionRequest = parse_body(ChatCompletionRequest, chat_body)
    prepared = await prepare_chat(ctx, chat, chat_body, exchange, id_prefix="resp")
    run = ResponseRun(ctx, req, prepared, conversation, exchange, prepared.rid.replace("resp-", "resp_"),
                      int(time.time()))
    if req.stream:
        from appliance.server.responses_stream import stream_response

        return stream_response(run)
    result = await run_until_disconnect(request.receive, lambda: _collect(run))
    return JSONResponse(result) if result is not None else Response(status_code=499)


async def _collect(run: ResponseRun) -> dict[str, Any]:
    got = await collect_choices(with_deadline(run.prepared.gen.stream(), run.ctx.request_timeout))
    proc = run.prepared.processors[0]
    reason, _ = got.reasons(0)
    fields = proc.final(got.text(0))
    body = run.finish(blocks_of_message(fields), proc.finish_reason(reason))
    run.record(proc.finish_reason(reason), got.text(0), body)
    return body

