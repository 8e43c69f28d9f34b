"""Separates reasoning (`<think>...</think>`) from the answer, whole or streamed.

Where the reasoning starts: the output is in reasoning from its first token when thinking is on and either the
format says the chat template always opens the block (deepseek_r1) or the rendered prompt ends inside an open
block (a start tag after the last end tag: Qwen3-2507 thinking, DeepSeek V3.1 with thinking, Kimi). Otherwise
the output is in reasoning only if it begins (after whitespace) with the start tag. A start tag the model
repeats at the very start of an already open block is dropped.

What is reasoning: everything up to the end tag; if the end tag never comes (truncated thinking), all of it.
Whitespace at both ends of the reasoning, and right after the end tag, is dropped; content is otherwise passed
through unchanged. With thinking off (per request or globally) the output is all content.
"""
from __future__ import annotations

from dataclasses import dataclass

ReasoningDelta = tuple[str | None, str | None]  # (reasoning_delta, content_delta)


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False  # the chat template always opens the block at the end of the prompt
    needs_special_tokens: bool = False  # the tags are special tokens a detokenizer skipping them would drop
    harmony: bool = False  # gpt-oss's channelled messages (reasoning/harmony.py) rather than one tagged block


def prompt_opens_reasoning(prompt_text: str | None, fmt: ReasoningFormat) -> bool:
    if not prompt_text:
        return False
    start = prompt_text.rfind(fmt.start)
    return start >= 0 and prompt_text.rfind(fmt.end) < start


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """One per request and choice: `feed` deltas then `finish` once, or `parse` whole text."""

    def __init__(self, fmt: ReasoningFormat, *, thinking_enabled: bool = True, prompt_text: str | None = None) -> None:
        self.format = fmt
        self.thinking_enabled = thinking_enabled
        opened = thinking_enabled and (fmt.starts_in_reasoning or prompt_opens_reasoning(prompt_text, fmt))
        # "open": inside a block, a repeated start tag may still come; "detect": a start tag may open a block
        self._mode = ("open" if opened else "detect") if thinking_enabled else "content"
        self._prompt_text = prompt_text
        self._buf = ""
        self._reasoning_started = False
        self._reasoning_ws = ""  # trailing whitespace of the reasoning, held until more reasoning comes
        self._strip_content_ws = False
        self._finished = False

    @property
    def in_reasoning(self) -> bool:
        return self._mode in ("open", "reasoning")

    def parse(self, text: str) -> ReasoningDelta:
        fresh = ReasoningParser(self.format, thinking_enabled=self.thinking_enabled, prompt_text=self._prompt_text)
        r1, c1 = fresh.feed(text)
        r2, c2 = fresh.finish()
        return _join(r1, r2), _join(c1, c2)

    def feed(self, delta_text: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta_text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content, final=False):
            pass
        return _join_list(reasoning), _join_list(content)

    def finish(self) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content, final=True):
            pass
        return _join_list(reasoning), _join_list(content)

    def _step(self, reasoning: list[str], content: list[str], *, final: bool) -> bool:
        start, end = self.format.start, self.format.end
        if self._mode in ("detect", "open"):
            stripped = self._buf.lstrip()
            if stripped.startswith(start):
                self._buf = stripped[len(start) :]
                self._mode = "reasoning"
                return True
            if not final and start.startswith(stripped):
                return False  # whitespace or a partial start tag: undecided
            self._mode = "reasoning" if self._mode == "open" else "content"
            return True
        if self._mode == "reasoning":
            pos = self._buf.find(end)
            if pos >= 0:
                self._emit_reasoning(self._buf[:pos], reasoning)
                self._buf = self._buf[pos + len(end) :]
                self._mode = "content"
                self._strip_content_ws = True
                return True
            keep = 0 if final else _partial_suffix(self._buf, end)
            self._emit_reasoning(self._buf[: len(self._buf) - keep], reasoning)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        text, self._buf = self._buf, ""
        if self._strip_content_ws:
            text = text.lstrip()
            if not text:
                return False
            self._strip_content_ws = False
        if text:
            content.append(text)
        return False

    def _emit_reasoning(self, text: str, out: list[str]) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return
            self._reasoning_started = True
        combined = self._reasoning_ws + text
        head = combined.rstrip()
        self._reasoning_ws = combined[len(head) :]
        if head:
            out.append(head)


def _join(a: str | None, b: str | None) -> str | None:
    text = (a or "") + (b or "")
    return text or None


def _join_list(parts: list[str]) -> str | None:
    text = "".join(parts)
    return text or None
