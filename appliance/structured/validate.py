"""Checking a spec where no tokenizer-bound compiler exists (the HTTP front end): parse it into a grammar.

A spec that parses here compiles in the workers; a bad schema, regex or grammar is the client's 400, caught
before it reaches the engine.
"""
from __future__ import annotations

import functools
import re

from appliance.structured.backend import require_xgrammar
from appliance.structured.compiler import choice_ebnf
from appliance.structured.errors import StructuredOutputError
from appliance.structured.spec import StructuredSpec

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def check_spec(spec: StructuredSpec) -> None:
    """StructuredOutputError (StructuredOutputUnavailable without xgrammar) when the spec cannot be compiled."""
    require_xgrammar()
    _check(spec)


@functools.lru_cache(maxsize=256)
def _check(spec: StructuredSpec) -> None:
    xgr = require_xgrammar()
    try:
        if spec.kind == "json_object":
            return
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(spec.choices))
        else:
            xgr.Grammar.from_ebnf(spec.value)
    except Exception as e:  # noqa: BLE001 - xgrammar reports bad input with several exception types
        lines = str(e).strip().splitlines()
        detail = _LOG_PREFIX.sub("", lines[0])[:300] if lines else type(e).__name__
        raise StructuredOutputError(f"cannot compile the {spec.kind.replace('_', ' ')}: {detail}") from None
