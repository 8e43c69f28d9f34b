"""Structured outputs: constraints read from a request, compiled once per spec, enforced with token bitmasks.

    spec = spec_from_request(body)                      # or tool_choice_spec(...), None when unconstrained
    compiler = GrammarCompiler.from_tokenizer(hf_tokenizer, vocab_size=model_vocab)   # one per model
    matcher = GrammarMatcher(compiler.compile(spec))    # one per request (and per choice when n > 1)
    each step:  matcher.apply_to_logits(logits_row); ...sample...; matcher.accept_token(token_id)
                finished when matcher.is_terminated()

The serving path: the server checks the spec off its event loop (validate.SpecChecker; a JSON schema gets its EBNF
translation, StructuredSpec.ebnf) and sends it in SamplingParams.extra["structured"]; each worker compiles it once
and masks that request's logits (executor/logits_processors.py).
Offline: SamplingParams(extra=StructuredOutputsParams(json=schema).to_extra()).

xgrammar is a dependency of appliance; where it is missing anyway (a broken install), building a compiler
or a matcher raises StructuredOutputUnavailable (a StructuredOutputError, so a 400 for the request that asked).
"""
from __future__ import annotations

from appliance.structured.backend import require_xgrammar, xgrammar_available
from appliance.structured.compiler import (
    CacheInfo,
    CompiledGrammar,
    GrammarCompiler,
    choice_ebnf,
)
from appliance.structured.errors import (
    StructuredOutputError,
    StructuredOutputUnavailable,
)
from appliance.structured.guided import (
    GuidedDecodingParams,
    StructuredOutputsParams,
    structured_spec_of,
)
from appliance.structured.matcher import GrammarMatcher, apply_batch
from appliance.structured.spec import StructuredSpec, spec_from_request
from appliance.structured.tool_choice import (
    named_function,
    tool_choice_schema,
    tool_choice_spec,
)

__all__ = [
    "CacheInfo",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "GuidedDecodingParams",
    "StructuredOutputError",
    "StructuredOutputUnavailable",
    "StructuredOutputsParams",
    "StructuredSpec",
    "apply_batch",
    "choice_ebnf",
    "named_function",
    "require_xgrammar",
    "spec_from_request",
    "structured_spec_of",
    "tool_choice_schema",
    "tool_choice_spec",
    "xgrammar_available",
]
