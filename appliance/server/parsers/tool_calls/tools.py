"""The request's `tools` list: checked once, then looked up by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from appliance.server.parsers.tool_calls.schema_check import validate


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]  # JSON schema of the arguments object; {} accepts any object


class ToolSet:
    """Tools by name. Accepts OpenAI's `{"type": "function", "function": {...}}` entries and bare function dicts."""

    def __init__(self, tools: list[Mapping[str, Any]] | None) -> None:
        self._by_name: dict[str, ToolSpec] = {}
        for i, entry in enumerate(tools or ()):
            spec = _read_tool(entry, i)
            if spec.name in self._by_name:
                raise ValueError(f"tools[{i}]: duplicate function name {spec.name!r}")
            self._by_name[spec.name] = spec

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> ToolSpec | None:
        return self._by_name.get(name)

    def check_arguments(self, name: str, arguments: Any) -> list[str]:
        """Why this call is not acceptable (unknown function, arguments not an object, schema violations)."""
        spec = self._by_name.get(name)
        if spec is None:
            return [f"unknown function {name!r}"]
        if not isinstance(arguments, dict):
            return [f"{name}: arguments must be a JSON object, got {type(arguments).__name__}"]
        try:
            return [f"{name}: {e}" for e in validate(arguments, spec.parameters)]
        except ValueError as e:  # the client's schema uses something we cannot evaluate
            return [f"{name}: cannot check arguments: {e}"]


def _read_tool(entry: Mapping[str, Any], i: int) -> ToolSpec:
    if not isinstance(entry, Mapping):
        raise ValueError(f"tools[{i}] must be an object")
    kind = entry.get("type", "function")
    if kind != "function":
        raise ValueError(f"tools[{i}].type must be 'function', got {kind!r}")
    fn = entry.get("function", entry)
    if not isinstance(fn, Mapping):
        raise ValueError(f"tools[{i}].function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tools[{i}].function.name must be a non-empty string")
    params = fn.get("parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return ToolSpec(name=name, parameters=params)
