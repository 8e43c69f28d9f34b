"""What the translator needs from the config schema: key order, value kinds, allowed values, defaults, and
validation. Read from `appliance.config.ApplianceConfig` so the tables never restate types or choices."""
from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

Kind = Literal["int", "float", "bool", "str", "list[int]", "list[str]", "dict", "section", "any"]


@dataclass(frozen=True)
class KeyInfo:
    path: str
    kind: Kind
    choices: tuple[Any, ...] | None  # Literal values, None when free
    default: Any
    model: type[BaseModel] | None = None  # for nested sections (api.caps, observability.kv_events)


def _root() -> type[BaseModel]:
    from appliance.config.schema import ApplianceConfig

    return ApplianceConfig


def _unwrap(annotation: Any) -> tuple[Any, ...]:
    """The non-None members of an annotation (`int | None` -> (int,))."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _kind(annotation: Any) -> tuple[Kind, tuple[Any, ...] | None, type[BaseModel] | None]:
    members = _unwrap(annotation)
    ann = members[0]
    origin = typing.get_origin(ann)
    if origin is Literal:
        choices = typing.get_args(ann)
        return ("str" if isinstance(choices[0], str) else "int"), choices, None
    if origin is list:
        (item,) = typing.get_args(ann) or (str,)
        if typing.get_origin(item) is Literal:
            return "list[str]", typing.get_args(item), None
        return ("list[int]" if item is int else "list[str]"), None, None
    if origin is dict or ann is dict:
        return "dict", None, None
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section", None, ann
    return {bool: "bool", int: "int", float: "float"}.get(ann, "str"), None, None  # type: ignore[return-value]


def normalized(path: str, value: Any) -> Any:
    """The value as the schema stores it (`gpt-oss` -> `gpt_oss`, `half` -> `float16`), by validating it in its
    section; ValueError when the field refuses it. Keys inside free dicts (hf_overrides) are returned as given."""
    *parents, leaf = path.split(".")
    model: Any = _root()
    for part in parents:
        field = model.model_fields.get(part)
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return value
    if leaf not in model.model_fields:
        return value
    try:
        return getattr(model.model_validate({leaf: value}), leaf)
    except ValidationError as exc:
        errors = [e for e in exc.errors() if e["loc"][:1] == (leaf,)] or exc.errors()
        raise ValueError(errors[0]["msg"].removeprefix("Value error, ")) from None


def _default(field: Any) -> Any:
    if field.default_factory is not None:
        value = field.default_factory()
        return value.model_dump() if isinstance(value, BaseModel) else value
    return field.default


@lru_cache(maxsize=None)
def key_info(path: str) -> KeyInfo | None:
    """Info for "section.key" (or "section.sub.key"); None when the schema has no such key."""
    model: type[BaseModel] = _root()
    parts = path.split(".")
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return None
        kind, choices, sub = _kind(field.annotation)
        if depth == len(parts) - 1:
            return KeyInfo(path, kind, choices, _default(field), sub)
        if sub is None:
            return None if kind != "dict" else KeyInfo(path, "any", None, None)  # inside a free dict
        model = sub
    return None


@lru_cache(maxsize=None)
def sections() -> tuple[str, ...]:
    return tuple(_root().model_fields)


@lru_cache(maxsize=None)
def keys(section: str) -> tuple[str, ...]:
    """Keys of a section in schema order; nested sections are spelled out as dotted keys after the rest."""
    info = key_info(section)
    if info is None or info.model is None:
        return ()
    flat, nested = [], []
    for name, field in info.model.model_fields.items():
        kind, _, sub = _kind(field.annotation)
        if kind == "section" and sub is not None:
            nested.extend(f"{name}.{k}" for k in sub.model_fields)
        else:
            flat.append(name)
    return tuple(flat + nested)


def _resolved(document: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The document with `${oc.env:VAR}` values resolved as `appliance validate` does (an unset variable: the
    raw text in a text field, else the default), and the resolution errors."""
    import copy

    from appliance.config.interpolation import interpolate

    data = copy.deepcopy(document)
    errors, _ = interpolate(data, strict=False)
    return data, [f"{p.path}: {p.message}" for p in errors]


def validate(document: dict[str, Any]) -> list[str]:
    """Schema and cross-field problems of a nested config dict, as `path: message` lines (empty when valid)."""
    document, errors = _resolved(document)
    if errors:
        return errors
    try:
        _root().model_validate(document)
    except ValidationError as exc:
        return [f"{'.'.join(str(p) for p in err['loc']) or '(config)'}: {err['msg']}" for err in exc.errors()]
    return []


def unsupported(document: dict[str, Any]) -> list[str]:
    """Settings of a valid document that this build cannot honour yet (appliance.config's one list)."""
    from appliance.config import check_supported

    try:
        config = _root().model_validate(_resolved(document)[0])
    except ValidationError:
        return []
    return check_supported(config)
