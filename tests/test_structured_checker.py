"""structured/validate.SpecChecker: compiles off the event loop, answers a 400-worthy error past its time bound,
keeps results (and failures) in a bounded LRU, and gives JSON schemas their EBNF for the workers."""
from __future__ import annotations

import asyncio
import time

import pytest

from appliance.structured import StructuredOutputError, StructuredSpec
from appliance.structured.validate import SpecChecker

pytest.importorskip("xgrammar")


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


def test_a_schema_gets_its_ebnf_and_the_spec_keeps_its_identity() -> None:
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    out = asyncio.run(SpecChecker(30, 4).prepare(spec))
    assert out == spec and out.kind == "json_schema" and "root ::=" in out.ebnf
    assert StructuredSpec.from_dict(out.to_dict()).ebnf == out.ebnf  # travels to the workers


def test_over_the_time_bound_is_an_error_and_the_late_result_is_kept() -> None:
    checker = SpecChecker(0.01, 4)
    spec = StructuredSpec.json_schema(nested(60))
    with pytest.raises(StructuredOutputError, match="api.grammar_compile_timeout"):
        asyncio.run(checker.prepare(spec))
    deadline = time.monotonic() + 120
    while spec not in checker._cache:  # the compile finishes on its thread and lands in the cache
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert asyncio.run(checker.prepare(spec)).ebnf  # now answered at once


def test_the_cache_is_bounded_and_keeps_failures() -> None:
    checker = SpecChecker(30, 2)
    bad = StructuredSpec.regex("(")
    for _ in range(2):
        with pytest.raises(StructuredOutputError, match="cannot compile the regex"):
            asyncio.run(checker.prepare(bad))
    for pattern in ("a+", "b+", "c+"):
        asyncio.run(checker.prepare(StructuredSpec.regex(pattern)))
    assert list(checker._cache) == [StructuredSpec.regex("b+"), StructuredSpec.regex("c+")]
