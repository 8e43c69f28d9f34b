"""Key paths through the schema: finding the field a dotted path names, and typing text values by it.

Used by everything that takes values as text (env variables, `--set a.b=c`, flags): a string field keeps the
text as is, anything else is parsed as a YAML scalar or flow collection (so `2`, `true`, `[1, 2]`, `{a: 1}` work,
the same typing omegaconf's dotlist gives), and pydantic then validates it.
"""
from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from appliance.config.errors import did_you_mean

KeyPath = tuple[str, ...]
_NULL_WORDS = ("null", "none", "~")


@dataclass(frozen=True)
class Target:
    """What a key path names: a field (with its annotation), or a free key inside a dict field."""

    field: FieldInfo | None
    annotation: Any
    free: bool = False  # below a dict-typed field (hf_overrides): any key is allowed


def _root() -> type[BaseModel]:
    from appliance.config.schema import ApplianceConfig

    return ApplianceConfig


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for arg in _flatten(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _flatten(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in _flatten(arg)]
    return [annotation]


def _is_dict(annotation: Any) -> bool:
    return any(typing.get_origin(a) is dict or a is dict for a in _flatten(annotation))


def resolve_path(path: KeyPath) -> Target:
    """The field a path names; raises KeyError with a 'did you mean' message for unknown keys."""
    model: type[BaseModel] | None = _root()
    target: Target | None = None
    for i, key in enumerate(path):
        if target is not None and target.free:
            continue
        if model is None:
            if target is not None and _is_dict(target.annotation):
                target = Target(None, Any, free=True)
                continue
            raise KeyError(f"{'.'.join(path[:i])} is not a section; it has no key {key!r}")
        fields = model.model_fields
        if key not in fields:
            where = ".".join(path[:i]) or "the top level"
            raise KeyError(f"unknown key {key!r} in {where}{did_you_mean(key, fields)}")
        info = fields[key]
        target = Target(info, info.annotation)
        model = _model_of(info.annotation)
    if target is None:
        raise KeyError("empty key path")
    return target


def accepts_text(annotation: Any) -> bool:
    """True when the annotation takes a plain string (str, or a Literal of strings) besides None."""
    for arg in _flatten(annotation):
        if arg is str:
            return True
        if typing.get_origin(arg) is Literal and any(isinstance(v, str) for v in typing.get_args(arg)):
            return True
    return False


def is_optional(annotation: Any) -> bool:
    return any(a is type(None) for a in _flatten(annotation))


def is_bool(annotation: Any) -> bool:
    """bool, or an optional bool (None = decided at start-up): both take --flag / --no-flag."""
    return annotation is bool or set(_flatten(annotation)) == {bool, type(None)}


def is_list(annotation: Any) -> bool:
    return any(typing.get_origin(a) is list for a in _flatten(annotation))


def coerce_text(path: KeyPath, raw: str) -> Any:
    """Type a text value by the schema field at path (see the module docstring)."""
    target = resolve_path(path)
    if is_optional(target.annotation) and raw.strip().lower() in _NULL_WORDS:
        return None
    if accepts_text(target.annotation) and not (is_list(target.annotation) and raw.lstrip().startswith("[")):
        return raw
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw  # pydantic reports the type error with the key path


def split_dotted(key: str) -> KeyPath:
    return tuple(part for part in key.strip().split("."))


def nest(path: KeyPath, value: Any) -> dict[str, Any]:
    out: Any = value
    for key in reversed(path):
        out = {key: out}
    return out
