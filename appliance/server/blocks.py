"""The chat output processors' fields (content, reasoning_content, tool_calls; server/chat.py) as an ordered list
of typed blocks, the shape both /v1/responses (output items) and /v1/messages (content blocks) answer in.

A block is reasoning text, answer text or one tool call. Streaming, `BlockStream.feed` turns each delta's
fields into block events (start, delta, stop) in order: a new kind of text or a new tool call closes the open
block first, so a client sees one block at a time, as both APIs require; `stream_blocks` runs a streamed chat
generation through it for both.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from appliance.server.generation import with_deadline

if TYPE_CHECKING:
    from appliance.server.chat import ChatOutputProcessor
    from appliance.server.generation import Generation

Kind = Literal["reasoning", "text", "tool"]


@dataclass
class Block:
    kind: Kind
    index: int  # position among the answer's blocks
    text: str = ""  # reasoning or answer text; a tool call's arguments (a JSON string)
    call_id: str | None = None
    name: str | None = None

    def arguments(self) -> dict[str, Any]:
        """The tool call's arguments as an object ({} when they are not a JSON object)."""
        try:
            value = json.loads(self.text or "{}")
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class BlockEvent:
    type: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""


def blocks_of_message(fields: dict[str, Any]) -> list[Block]:
    """A whole answer's fields (a ChatOutputProcessor's `final`) as blocks: reasoning, text, then tool calls."""
    out: list[Block] = []
    if fields.get("reasoning_content"):
        out.append(Block("reasoning", len(out), fields["reasoning_content"]))
    if fields.get("content"):
        out.append(Block("text", len(out), fields["content"]))
    for call in fields.get("tool_calls") or []:
        fn = call.get("function") or {}
        out.append(Block("tool", len(out), fn.get("arguments") or "", call.get("id"), fn.get("name")))
    return out


@dataclass
class BlockStream:
    """Streamed fields -> block events; `blocks` holds every block so far (whole text, for the final object)."""

    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None
    _calls: dict[int, Block] = field(default_factory=dict)  # tool call index in the chat deltas -> its block

    def feed(self, fields: dict[str, Any]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if fields.get("reasoning_content"):
            events += self._text("reasoning", fields["reasoning_content"])
        if fields.get("content"):
            events += self._text("text", fields["content"])
        for call in fields.get("tool_calls") or []:
            events += self._tool(call)
        return events

    def close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block)]

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        return events + [BlockEvent("start", block)]

    def _text(self, kind: Kind, text: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._open is None or self._open.kind != kind:
            events += self._start(Block(kind, len(self.blocks)))
        assert self._open is not None
        self._open.text += text
        return events + [BlockEvent("delta", self._open, text)]

    def _tool(self, call: dict[str, Any]) -> list[BlockEvent]:
        fn = call.get("function") or {}
        events: list[BlockEvent] = []
        block = self._calls.get(call.get("index", 0))
        if block is None:
            block = Block("tool", len(self.blocks), "", call.get("id"), fn.get("name"))
            self._calls[call.get("index", 0)] = block
            events += self._start(block)
        args = fn.get("arguments") or ""
        if args:
            block.text += args
            if block is self._open:  # a call already closed keeps its whole arguments for its final shape
                events.append(BlockEvent("delta", block, args))
        return events


def merged_fields(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two processor deltas as one (texts joined, tool call fragments listed in order)."""
    out = dict(a)
    for key, value in b.items():
        if key == "tool_calls":
            out["tool_calls"] = list(out.get("tool_calls") or []) + list(value)
        elif isinstance(value, str) and isinstance(out.get(key), str):
            out[key] = out[key] + value
        else:
            out[key] = value
    return out


@dataclass
class StreamEnd:
    """What a streamed chat generation ended with (stream_blocks fills it): the texts, the finish reason as
    the processor maps it, and the engine's stop reason."""

    texts: list[str] = field(default_factory=list)
    finish: str | None = None
    stop: Any = None


async def stream_blocks(gen: Generation, proc: ChatOutputProcessor, timeout: float | None, blocks: BlockStream,
                        end: StreamEnd) -> AsyncIterator[BlockEvent]:
    """The block events of a streamed chat generation (its one choice through `proc`, under the request
    deadline), the closing ones included; `end` holds how it ended. Close it with contextlib.aclosing."""
    stream = with_deadline(gen.stream(), timeout)
    async with contextlib.aclosing(stream) as deltas:
        async for d in deltas:
            end.texts.append(d.text)
            fields = proc.delta(d.text)
            if d.finish_reason is not None:
                fields = merged_fields(fields, proc.end())
                end.finish, end.stop = proc.finish_reason(d.finish_reason), d.stop_reason
            for ev in blocks.feed(fields):
                yield ev
    for ev in blocks.close():
        yield ev
