"""Errors a structured-output request can fail with; both fail that request alone (4xx), never the engine."""
from __future__ import annotations


class StructuredOutputError(ValueError):
    """The request's schema, regex, choice list or grammar is invalid (HTTP 400)."""


class StructuredOutputUnavailable(StructuredOutputError):
    """Structured outputs need xgrammar, which is not installed (HTTP 400: the request asks for a missing feature)."""

    def __init__(self) -> None:
        super().__init__(
            "structured outputs (response_format json_object/json_schema, regex, choice, grammar, and "
            "tool_choice 'required' or a named function) need xgrammar, which is not installed on this server; "
            "install it with: pip install xgrammar"
        )
