"""What a request asks the output to follow, read from the request body, as a small hashable record.

Accepted fields (at most one of them per request):
- OpenAI `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (a JSON object),
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
- vLLM `structured_outputs`: {"json": schema, "regex": str, "choice": [str], "grammar": EBNF, "json_object": true}
  (exactly one key), and vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
- SGLang's `regex` and `ebnf`.
The record travels to the workers in SamplingParams.extra["structured"] as `to_dict()`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from appliance.structured.errors import StructuredOutputError

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    kind: Kind
    # canonical text: compact schema JSON, the regex, the choices as a JSON list, EBNF. Schema keys keep their
    # order: it is the order the grammar generates properties in (models expect the declared order).
    value: str = ""
    # a json_schema's grammar as the HTTP front end translated it off its event loop (validate.worker_spec): the
    # workers compile this rather than translate the schema again; not part of the spec's identity
    ebnf: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured-output kind {self.kind!r}")

    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool) -> StructuredSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e.msg}") from None
        if not isinstance(schema, (Mapping, bool)):
            raise StructuredOutputError("a JSON schema must be an object")
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def regex(cls, pattern: str) -> StructuredSpec:
        if not isinstance(pattern, str) or not pattern:
            raise StructuredOutputError("regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Any) -> StructuredSpec:
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredSpec:
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise StructuredOutputError("grammar must be a non-empty EBNF string")
        return cls("grammar", ebnf)

    @property
    def schema(self) -> Any:
        return json.loads(self.value) if self.kind == "json_schema" else None

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value) if self.kind == "choice" else []

    def to_dict(self) -> dict[str, str]:
        d = {"kind": self.kind, "value": self.value}
        if self.ebnf:
            d["ebnf"] = self.ebnf
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StructuredSpec:
        return cls(kind=d["kind"], value=d.get("value", ""), ebnf=d.get("ebnf", ""))


_VLLM_KEYS = {"json": StructuredSpec.json_schema, "regex": StructuredSpec.regex, "choice": StructuredSpec.choice,
              "grammar": StructuredSpec.grammar}
_LEGACY_FIELDS = {"guided_json": StructuredSpec.json_schema, "guided_regex": StructuredSpec.regex,
                  "guided_choice": StructuredSpec.choice, "guided_grammar": StructuredSpec.grammar,
                  "regex": StructuredSpec.regex, "ebnf": StructuredSpec.grammar}


def spec_from_request(body: Mapping[str, Any]) -> StructuredSpec | None:
    """The constraint a chat/completions request body asks for, or None (StructuredOutputError on bad input)."""
    found: list[tuple[str, StructuredSpec]] = []
    rf = body.get("response_format")
    if rf is not None:
        spec = _from_response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    so = body.get("structured_outputs")
    if so is not None:
        found.append(("structured_outputs", _from_structured_outputs(so)))
    for key, make in _LEGACY_FIELDS.items():
        if body.get(key) is not None:
            found.append((key, make(body[key])))
    if len(found) > 1:
        raise StructuredOutputError(f"give at most one output constraint; got {', '.join(k for k, _ in found)}")
    return found[0][1] if found else None


def _from_response_format(rf: Any) -> StructuredSpec | None:
    if not isinstance(rf, Mapping):
        raise StructuredOutputError("response_format must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping) or "schema" not in js:
            raise StructuredOutputError("response_format json_schema needs json_schema.schema")
        return StructuredSpec.json_schema(js["schema"])
    raise StructuredOutputError(f"response_format.type must be text, json_object or json_schema; got {kind!r}")


def _from_structured_outputs(so: Any) -> StructuredSpec:
    if not isinstance(so, Mapping):
        raise StructuredOutputError("structured_outputs must be an object")
    keys = [k for k, v in so.items() if v is not None and v is not False]
    if len(keys) != 1:
        raise StructuredOutputError(
            f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {keys}"
        )
    key = keys[0]
    if key == "json_object":
        return StructuredSpec.json_object()
    if key not in _VLLM_KEYS:
        raise StructuredOutputError(f"unknown structured_outputs key {key!r}")
    return _VLLM_KEYS[key](so[key])
