"""Checking a spec where no tokenizer-bound compiler exists (the HTTP front end): parse it into a grammar.

A spec that parses here compiles in the workers; a bad schema, regex or grammar is the client's 400, caught
before it reaches the engine. Parsing a JSON schema is the slow part of compiling it (seconds for a deeply
nested one; xgrammar releases the GIL meanwhile), so the front end does it once, on a thread (`SpecChecker`,
bounded by api.grammar_compile_timeout, results kept in an LRU of api.grammar_cache_size), and sends the
workers the resulting EBNF grammar with the spec (StructuredSpec.ebnf): their compile is then milliseconds, and other requests' steps are not held.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from appliance.structured.backend import require_xgrammar
from appliance.structured.compiler import choice_ebnf, json_schema_ebnf
from appliance.structured.errors import StructuredOutputError
from appliance.structured.spec import StructuredSpec

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def check_spec(spec: StructuredSpec) -> None:
    """StructuredOutputError (StructuredOutputUnavailable without xgrammar) when the spec cannot be compiled."""
    require_xgrammar()
    _prepare_cached(spec)


@functools.lru_cache(maxsize=64)
def _prepare_cached(spec: StructuredSpec) -> StructuredSpec:
    return worker_spec(spec)


def worker_spec(spec: StructuredSpec) -> StructuredSpec:
    """The spec the workers compile: a JSON schema with its EBNF grammar (the schema's translation done here,
    once), any other kind checked. StructuredOutputError when it cannot be compiled."""
    xgr = require_xgrammar()
    try:
        if spec.kind == "json_object":
            return spec
        if spec.kind == "json_schema":
            return dataclasses.replace(spec, ebnf=json_schema_ebnf(xgr, spec.value))
        if spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(spec.choices))
        else:
            xgr.Grammar.from_ebnf(spec.value)
        return spec
    except Exception as e:  # noqa: BLE001 - xgrammar reports bad input with several exception types
        lines = str(e).strip().splitlines()
        detail = _LOG_PREFIX.sub("", lines[0])[:300] if lines else type(e).__name__
        raise StructuredOutputError(f"cannot compile the {spec.kind.replace('_', ' ')}: {detail}") from None


class SpecChecker:
    """worker_spec on a thread pool, off the event loop, each spec at most once at a time: the answer is awaited
    up to `timeout` seconds (then StructuredOutputError); a compile that outlives its request still finishes and
    is kept, so the same spec sent again is answered from the cache."""

    def __init__(self, timeout: float, cache_size: int, threads: int = 2) -> None:
        self.timeout = timeout
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(threads, "grammar")
        self._cache: OrderedDict[StructuredSpec, StructuredSpec | StructuredOutputError] = OrderedDict()
        self._running: dict[StructuredSpec, Future] = {}
        self._lock = threading.RLock()  # done callbacks run on the pool's threads, or here when already done

    async def prepare(self, spec: StructuredSpec) -> StructuredSpec:
        require_xgrammar()
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
            else:
                fut = self._running.get(spec)
                if fut is None:
                    fut = self._running[spec] = self._pool.submit(worker_spec, spec)
                    fut.add_done_callback(functools.partial(self._store, spec))
        if hit is None:
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout)
            except TimeoutError:
                raise StructuredOutputError(
                    f"compiling the {spec.kind.replace('_', ' ')} took longer than {self.timeout:g} s "
                    "(api.grammar_compile_timeout)") from None
        if isinstance(hit, StructuredOutputError):
            raise hit
        return hit

    def _store(self, spec: StructuredSpec, fut: Future) -> None:
        exc = fut.exception()
        if exc is not None and not isinstance(exc, StructuredOutputError):
            exc = StructuredOutputError(f"cannot compile the {spec.kind.replace('_', ' ')}: {type(exc).__name__}")
        with self._lock:
            self._running.pop(spec, None)
            if self.cache_size > 0:
                self._cache[spec] = exc if exc is not None else fut.result()
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
