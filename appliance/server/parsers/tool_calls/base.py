"""The streaming machine every tool-call format shares.

A format is a set of block syntaxes (an opening marker, a closing marker or none, and whether the opener counts
only at the very start of the output) plus `parse_block`, which reads the calls out of one whole block. The
machine finds blocks in streamed text, passes everything else through as content, and holds back only what
might still turn out to be a marker. Non-streaming `parse` runs the same machine over the whole text, so the
two paths cannot disagree.

Rules (documented for the API in appliance/server/parsers/__init__.py):
- A block is all or nothing. If its text does not follow the format, a call names a function that is not in
  `tools`, or a call's arguments fail that tool's JSON schema, the whole block (markers included) is returned
  as content, unchanged, and the reason is recorded in `errors`.
- A call's arguments are emitted when its block is complete (they must be checked first): one delta with id,
  type and name (arguments ""), then one delta with the whole arguments string.
- Whitespace between content and a valid block is dropped, as is whitespace at the end of the output when
  the output has tool calls; content text is otherwise passed through byte for byte.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from appliance.server.parsers.tool_calls.records import (
    BlockError,
    BlockParse,
    Delta,
    IdFactory,
    ParsedTools,
    ToolCallDelta,
    assemble,
    openai_call_id,
)
from appliance.server.parsers.tool_calls.tools import ToolSet


@dataclass(frozen=True)
class BlockSyntax:
    start: str
    end: str | None  # None: the block runs to the end of the output
    at_start_only: bool = False  # the opener counts only as the first non-whitespace text of the output

    def body(self, block: str) -> str:
        """A whole block without its opener and, when present, its closer (a block cut off by the end of the
        output has none)."""
        inner = block[len(self.start) :]
        if self.end and inner.endswith(self.end):
            inner = inner[: -len(self.end)]
        return inner


class ToolParser(ABC):
    """One instance per request and choice: `feed` deltas, then `finish` once; or call `parse` on whole text."""

    name: ClassVar[str] = ""
    blocks: ClassVar[tuple[BlockSyntax, ...]] = ()
    # The markers are special tokens that a detokenizer skipping special tokens would drop.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[Mapping[str, Any]] | ToolSet | None, *, id_factory: IdFactory | None = None) -> None:
        self.tools = tools if isinstance(tools, ToolSet) else ToolSet(tools)
        self._new_id: IdFactory = id_factory or self.default_call_id
        self._buf = ""
        self._block: BlockSyntax | None = None
        self._end_scan_from = 0  # in a block, where the search for its end marker resumes (no rescans)
        self._output_started = False  # non-whitespace text seen (at-start openers no longer apply)
        self._pending_ws = ""
        self._content_emitted = False
        self._calls_emitted = 0
        self._finished = False
        self.errors: list[str] = []

    @staticmethod
    def default_call_id() -> str:
        return openai_call_id()

    @abstractmethod
    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        """Read the calls out of one block (its markers included; the closing one is absent at end of output).

        Raise BlockError when the text does not follow the format.
        """

    # ----------------------------------------------------------------------------------------------- API
    def parse(self, text: str) -> ParsedTools:
        fresh = type(self)(self.tools, id_factory=self._new_id)
        deltas = fresh.feed(text) + fresh.finish()
        return assemble(deltas, errors=tuple(fresh.errors))

    def feed(self, delta_text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta_text
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        out: list[Delta] = []
        if self._block is not None:
            self._close_block(self._buf, self._block, out)
        else:
            self._emit_content(self._buf, out)
        self._buf = ""
        if self._pending_ws and self._calls_emitted == 0:
            out.append(Delta(content=self._pending_ws))
        self._pending_ws = ""
        return out

    # ----------------------------------------------------------------------------------- the machine
    def _step(self, out: list[Delta]) -> bool:
        """Consume what can be decided now; True when another step may consume more."""
        if self._block is not None:
            return self._step_block(out)
        found = self._find_opener()
        if found is None:
            keep = self._holdback()
            self._emit_content(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        pos, syntax = found
        self._emit_content(self._buf[:pos], out)
        self._buf = self._buf[pos:]
        self._block = syntax
        self._output_started = True
        return True

    def _step_block(self, out: list[Delta]) -> bool:
        syntax = self._block
        assert syntax is not None
        if syntax.end is None:
            return False  # runs to the end of the output: decided in finish()
        end = self._buf.find(syntax.end, max(len(syntax.start), self._end_scan_from))
        if end < 0:
            self._end_scan_from = max(0, len(self._buf) - len(syntax.end) + 1)
            return False
        self._end_scan_from = 0
        cut = end + len(syntax.end)
        block, self._buf = self._buf[:cut], self._buf[cut:]
        self._block = None
        self._close_block(block, syntax, out)
        return True

    def _find_opener(self) -> tuple[int, BlockSyntax] | None:
        if not self._output_started:
            stripped = self._buf.lstrip()
            lead = len(self._buf) - len(stripped)
            for syntax in self.blocks:
                if syntax.at_start_only and stripped.startswith(syntax.start):
                    return lead, syntax
        best: tuple[int, BlockSyntax] | None = None
        for syntax in self.blocks:
            if syntax.at_start_only:
                continue
            pos = self._buf.find(syntax.start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, syntax)
        return best

    def _holdback(self) -> int:
        """How many trailing characters might still begin an opener."""
        if not self._output_started:
            stripped = self._buf.lstrip()
            if not stripped:
                return len(self._buf)
            if any(s.at_start_only and s.start.startswith(stripped) for s in self.blocks):
                return len(self._buf)
            self._output_started = True
        keep = 0
        for syntax in self.blocks:
            if syntax.at_start_only:
                continue
            for k in range(min(len(syntax.start) - 1, len(self._buf)), keep, -1):
                if syntax.start.startswith(self._buf[-k:]):
                    keep = k
                    break
        return keep

    def _close_block(self, block: str, syntax: BlockSyntax, out: list[Delta]) -> None:
        try:
            parsed = self.parse_block(block, syntax)
            if not parsed.calls:
                raise BlockError("the block holds no call")
            problems = [p for call in parsed.calls for p in self.tools.check_arguments(call.name, call.arguments)]
            if problems:
                raise BlockError("; ".join(problems))
        except BlockError as e:
            self.errors.append(f"{self.name}: {e}")
            self._emit_content(block, out)
            return
        for call in parsed.calls:
            index = self._calls_emitted
            self._calls_emitted += 1
            out.append(Delta(tool_call=ToolCallDelta(index=index, id=call.id or self._new_id(), name=call.name)))
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            out.append(Delta(tool_call=ToolCallDelta(index=index, arguments=arguments)))
        self._emit_content(parsed.trailing_content, out)

    def _emit_content(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        combined = self._pending_ws + text
        head = combined.rstrip()
        if not head:
            self._pending_ws = combined
            return
        self._pending_ws = combined[len(head) :]
        if self._calls_emitted and not self._content_emitted:
            head = head.lstrip()  # whitespace between a leading tool call and the first content
        out.append(Delta(content=head))
        self._content_emitted = True
