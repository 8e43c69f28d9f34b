"""Records a tool-call parser produces: whole calls, streamed deltas, and the parse result."""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any, Callable

IdFactory = Callable[[], str]


def openai_call_id() -> str:
    """`call_` + 24 hex digits: the shape OpenAI's own ids have."""
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """Mistral chat templates reject tool-call ids that are not 9 alphanumeric characters."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """One complete call: `arguments` is a JSON object serialized as a string, as OpenAI sends it."""

    id: str
    name: str
    arguments: str
    type: str = "function"

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of a streamed `choices[0].delta.tool_calls` list.

    The first delta of a call carries id, type and name (arguments ""); later ones carry only index and an
    arguments fragment. Concatenating the fragments of one index gives that call's arguments string.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass(frozen=True)
class Delta:
    """What one streaming step yields: either content text or one tool-call delta, never both."""

    content: str | None = None
    tool_call: ToolCallDelta | None = None

    def __post_init__(self) -> None:
        if (self.content is None) == (self.tool_call is None):
            raise ValueError("a Delta carries exactly one of content and tool_call")


@dataclass(frozen=True)
class ParsedTools:
    """The non-streaming result. `errors` says why a block that looked like a tool call was kept as content."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class RawCall:
    """A call as a format parser read it, before the tool lookup and the schema check."""

    name: str
    arguments: Any  # must turn out to be a dict (a JSON object)
    id: str | None = None  # some formats (Mistral v11) carry the model's own id


@dataclass(frozen=True)
class BlockParse:
    """What a format parser made of one tool-call block: the calls, and text after them that is content."""

    calls: tuple[RawCall, ...]
    trailing_content: str = ""


class BlockError(ValueError):
    """A tool-call block that does not follow its format; the block is then returned as content."""


def assemble(deltas: list[Delta], *, errors: tuple[str, ...] = ()) -> ParsedTools:
    """Fold streamed deltas into the non-streaming result (the server's non-streaming path uses this too)."""
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        if d.content is not None:
            content.append(d.content)
            continue
        tc = d.tool_call
        assert tc is not None
        entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
        if tc.id is not None:
            entry["id"] = tc.id
        if tc.name is not None:
            entry["name"] = tc.name
        entry["arguments"] += tc.arguments
    text = "".join(content)
    return ParsedTools(
        content=text or None,
        tool_calls=tuple(ToolCall(**c) for _, c in sorted(calls.items())),
        errors=errors,
    )
