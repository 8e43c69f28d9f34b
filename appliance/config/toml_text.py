"""TOML scalars, keys and inline values as text: the one writer behind `appliance config show`
(config/render.py) and `appliance translate` (translate/emit.py). Whatever it writes parses back with tomllib
to the same value (tests/test_translate_emit.py checks that property)."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")  # ASCII only: TOML bare keys take no other letters


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_string(text: str) -> str:
    # JSON string escapes are valid TOML basic-string escapes; TOML also forbids a raw DEL
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".eE") else text + ".0"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"
    if value is None:
        raise ValueError("TOML has no null; leave the key out")
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
