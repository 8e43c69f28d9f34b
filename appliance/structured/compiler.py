"""Compiles output constraints into xgrammar grammars for one tokenizer, each spec once (an LRU cache)."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from appliance.structured.backend import require_xgrammar
from appliance.structured.errors import StructuredOutputError
from appliance.structured.spec import StructuredSpec

# Whitespace inside generated JSON is fixed (", " and ": ") rather than free: with free whitespace a model can
# loop on newlines forever while every token stays "valid".
_JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False}
# Two leaks in xgrammar's (0.2.x) JSON string rules, closed by rewriting their character classes:
# - strings with minLength/maxLength use `[^"\\\r\n]`, which lets raw control characters (tab, form feed)
#   in: output no strict JSON parser accepts;
# - all string rules accept UTF-8-encoded surrogates (ED A0..BF xx), which are not valid UTF-8.
_LOOSE_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_STRICT_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


@dataclass(frozen=True)
class CompiledGrammar:
    spec: StructuredSpec
    vocab_size: int
    handle: Any  # xgrammar.CompiledGrammar


@dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    size: int


def choice_ebnf(choices: Sequence[str]) -> str:
    """`root ::= "a" | "b"`, with every choice as an escaped EBNF string literal."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


class GrammarCompiler:
    """One per tokenizer (per served model). Thread-safe; compile() raises StructuredOutputError on bad specs."""

    def __init__(self, tokenizer_info: Any, *, max_threads: int = 2, cache_size: int = 256) -> None:
        xgr = require_xgrammar()
        self._xgr = xgr
        self._info = tokenizer_info
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[StructuredSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> GrammarCompiler:
        """From a Hugging Face tokenizer. `vocab_size` is the model's logits width (may exceed the tokenizer's)."""
        xgr = require_xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=None if stop_token_ids is None else list(stop_token_ids)
        )
        return cls(info, **kwargs)

    @property
    def vocab_size(self) -> int:
        return int(self._info.vocab_size)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(hits=self._hits, misses=self._misses, size=len(self._cache))

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self._hits += 1
                return hit
            self._misses += 1
        compiled = CompiledGrammar(spec=spec, vocab_size=self.vocab_size, handle=self._compile(spec))
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> Any:
        c = self._compiler
        try:
            if spec.kind == "json_object":
                return c.compile_grammar(self._json_schema_grammar(json.dumps({"type": "object"})))
            if spec.kind == "json_schema":
                return c.compile_grammar(self._json_schema_grammar(spec.value))
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                return c.compile_grammar(choice_ebnf(spec.choices))
            return c.compile_grammar(spec.value)
        except StructuredOutputError:
            raise
        except Exception as e:  # xgrammar reports bad schemas/regexes/grammars with several exception types
            raise StructuredOutputError(f"cannot compile the {spec.kind.replace('_', ' ')}: {_first_line(e)}") from None


    def _json_schema_grammar(self, schema: str) -> Any:
        grammar = self._xgr.Grammar.from_json_schema(schema, **_JSON_OPTIONS)
        text = str(grammar)
        fixed = text
        for loose in _LOOSE_STRING_CHARS:
            fixed = fixed.replace(loose, _STRICT_STRING_CHAR)
        return grammar if fixed == text else self._xgr.Grammar.from_ebnf(fixed)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
