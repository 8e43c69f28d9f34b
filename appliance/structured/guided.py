"""The offline API's way to ask for structured output (vLLM's StructuredOutputsParams / GuidedDecodingParams):

    from appliance.structured import StructuredOutputsParams
    params = SamplingParams(max_tokens=64, extra=StructuredOutputsParams(json=schema).to_extra())
    LLM(...).generate(prompt, params)

Exactly one of json (a schema), regex, choice, grammar (EBNF) or json_object=True. The workers enforce it
(executor/logits_processors.py); the output ends, with EOS, when the grammar is complete.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.structured.errors import StructuredOutputError
from appliance.structured.spec import StructuredSpec, spec_from_request


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def spec(self) -> StructuredSpec:
        fields = {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object}
        spec = spec_from_request({"structured_outputs": fields})
        assert spec is not None  # structured_outputs always yields one (or raises)
        return spec

    def to_extra(self) -> dict[str, Any]:
        """The SamplingParams.extra entries that carry this constraint."""
        return {"structured": self.spec().to_dict()}


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


def structured_spec_of(extra: Mapping[str, Any]) -> StructuredSpec | None:
    """The spec a SamplingParams.extra carries, checked (StructuredOutputError when malformed)."""
    d = extra.get("structured") if extra else None
    if d is None:
        return None
    if not isinstance(d, Mapping) or "kind" not in d:
        raise StructuredOutputError('extra["structured"] must be StructuredSpec.to_dict() (kind, value)')
    return StructuredSpec.from_dict(d)
