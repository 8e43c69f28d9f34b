"""gpt-oss's harmony format: the output is a sequence of messages, each a header and a body.

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"SF"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The header (up to `<|message|>`) names the channel and, for a tool call, the recipient (`to=functions.NAME`, in
the channel part or after the role); the body runs to `<|end|>`, `<|call|>` or `<|return|>`. Bodies of the
analysis channel are reasoning; final and commentary bodies without a recipient are content; a call to
`functions.NAME` is passed on as content in one normal form, `<|channel|>commentary to=functions.NAME<|message|>
ARGS<|call|>`, which the harmony tool-call parser (tool_calls/harmony.py) reads. Text that does not start with a
header is content. Rules as in openai-harmony's StreamableParser (the reference implementation; it needs the
o200k vocabulary, which it downloads, so the tests check the documented examples instead).
"""
from __future__ import annotations

import re

from appliance.server.parsers.reasoning.parser import ReasoningDelta, ReasoningFormat, ReasoningParser, _join_list

MESSAGE = "<|message|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _partial(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest proper prefix of any tag that `text` ends with."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if tag.startswith(text[-k:]):
                best = k
                break
    return best


class HarmonyParser(ReasoningParser):
    def __init__(self, fmt: ReasoningFormat, *, thinking_enabled: bool = True, prompt_text: str | None = None) -> None:
        super().__init__(fmt, thinking_enabled=thinking_enabled, prompt_text=prompt_text)
        self._kind: str | None = None  # None: reading a header; else the open body's kind: reasoning/content/call

    @property
    def in_reasoning(self) -> bool:
        return self._kind == "reasoning"

    def parse(self, text: str) -> ReasoningDelta:
        fresh = HarmonyParser(self.format, thinking_enabled=self.thinking_enabled, prompt_text=self._prompt_text)
        r1, c1 = fresh.feed(text)
        r2, c2 = fresh.finish()
        return _join_list([r1 or "", r2 or ""]), _join_list([c1 or "", c2 or ""])

    def _step(self, reasoning: list[str], content: list[str], *, final: bool) -> bool:
        if self._kind is None:
            return self._header(content, final)
        ends = [(self._buf.find(t), t) for t in TERMINATORS if t in self._buf]
        if ends:
            pos, tag = min(ends)
            self._body(self._buf[:pos], reasoning, content)
            if self._kind == "call":
                content.append("<|call|>")
            self._buf, self._kind = self._buf[pos + len(tag):], None
            return True
        keep = 0 if final else _partial(self._buf, TERMINATORS)
        self._body(self._buf[: len(self._buf) - keep], reasoning, content)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _header(self, content: list[str], final: bool) -> bool:
        stripped = self._buf.lstrip()
        if stripped and not stripped.startswith("<|") and not (stripped == "<" and not final):
            self._kind = "content"  # no header: plain text up to a terminator
            return True
        pos = self._buf.find(MESSAGE)
        if pos < 0:
            if final and stripped:
                content.append(self._buf)  # a header cut off by the end of the output
                self._buf = ""
            return False
        header, self._buf = self._buf[:pos], self._buf[pos + len(MESSAGE):]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith("functions."):
            self._kind = "call"
            content.append(f"<|channel|>commentary to={recipient.group(1)}{MESSAGE}")
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"
        return True

    def _body(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            self._emit_reasoning(text, reasoning)
        else:
            content.append(text)
