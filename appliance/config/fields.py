"""Field metadata: the one place a schema field says which command-line flags feed it.

Every field of the schema is declared with `param()`. Besides pydantic's own arguments it records the familiar
flag names of that field (from the seeds: TokenSpeed, vLLM, SGLang, Atlas). Flags, flat keyword names of the
Python API and docs/parameters.md are all generated from this metadata; there is no hand-written parser per flag.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

FLAGS_KEY = "x-flags"
JSON_FLAG_KEY = "x-json-flag"
DERIVED = "derived"


def param(
    default: Any = ...,
    description: str = "",
    *,
    flags: tuple[str, ...] | str | None = DERIVED,
    json_flag: str | None = None,
    default_factory: Any = None,
    **constraints: Any,
) -> Any:
    """Declare a schema field.

    flags: the familiar flag names, first one canonical. The default derives `--key-with-dashes` from the field
    name; `None` means no flag (reachable through the file, env and `--set` only).
    json_flag: a flag that takes the whole (nested) value as one JSON string, e.g. `--kv-events-config`.
    """
    extra: dict[str, Any] = {}
    if flags is not None:
        extra[FLAGS_KEY] = [flags] if isinstance(flags, str) else list(flags)
    if json_flag is not None:
        extra[JSON_FLAG_KEY] = json_flag
    if default_factory is not None:
        return Field(default_factory=default_factory, description=description,
                     json_schema_extra=extra or None, **constraints)
    return Field(default, description=description, json_schema_extra=extra or None, **constraints)
