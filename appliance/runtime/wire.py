"""The typed wire between pipeline processes: frozen dataclasses <-> msgpack, decoded against a schema.

A frame is `[tag, {field: value}]`. The decoder knows every message type by tag and checks each field against
the dataclass' type hints (recursively for nested records, lists, tuples, dicts and optionals), so a malformed or
hostile frame is rejected as a whole with `WireError`; nothing is ever unpickled or executed.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import msgpack


class WireError(ValueError):
    """A frame that does not decode to a known, well-typed message."""


_NoneType = type(None)


class Codec:
    """Encodes and decodes one closed set of message types; unknown tags are errors."""

    def __init__(self, *message_types: type) -> None:
        self._by_tag: dict[str, type] = {}
        self._hints: dict[type, dict[str, Any]] = {}
        for cls in message_types:
            self._register(cls)
        self.num_malformed = 0  # frames rejected by `decode_or_none`

    def _register(self, cls: type) -> None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        if cls in self._hints:
            return
        self._by_tag[cls.__name__] = cls
        self._hints[cls] = typing.get_type_hints(cls)
        for hint in self._hints[cls].values():  # nested records decode with the same schema rules
            for inner in _dataclasses_in(hint):
                self._register_nested(inner)

    def _register_nested(self, cls: type) -> None:
        if cls not in self._hints:
            self._hints[cls] = typing.get_type_hints(cls)
            for hint in self._hints[cls].values():
                for inner in _dataclasses_in(hint):
                    self._register_nested(inner)

    # -- encoding ------------------------------------------------------------------------------------------

    def encode(self, msg: Any) -> bytes:
        cls = type(msg)
        if self._by_tag.get(cls.__name__) is not cls:
            raise TypeError(f"{cls.__name__} is not a message type of this codec")
        return msgpack.packb([cls.__name__, _to_plain(msg)], use_bin_type=True)

    # -- decoding ------------------------------------------------------------------------------------------

    def decode(self, frame: bytes) -> Any:
        try:
            obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
            raise WireError(f"not msgpack: {type(exc).__name__}") from None
        if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], dict)):
            raise WireError("frame is not [tag, fields]")
        cls = self._by_tag.get(obj[0])
        if cls is None:
            raise WireError(f"unknown message tag {obj[0][:64]!r}")
        return self._build(cls, obj[1], obj[0])

    def decode_or_none(self, frame: bytes) -> Any | None:
        """Decode, or count the frame as malformed and return None (the receive loops drop it)."""
        try:
            return self.decode(frame)
        except WireError:
            self.num_malformed += 1
            return None

    def _build(self, cls: type, fields: dict, path: str) -> Any:
        hints = self._hints[cls]
        unknown = set(fields) - set(hints)
        if unknown:
            raise WireError(f"{path}: unknown fields {sorted(map(str, unknown))[:5]}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in fields:
                kwargs[f.name] = self._convert(fields[f.name], hints[f.name], f"{path}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise WireError(f"{path}: missing field {f.name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:  # __post_init__ validation
            raise WireError(f"{path}: {exc}") from None

    def _convert(self, value: Any, hint: Any, path: str) -> Any:
        if hint is Any:
            return value
        origin = typing.get_origin(hint)
        if origin in (Union, types.UnionType):
            args = typing.get_args(hint)
            if value is None and _NoneType in args:
                return None
            errors = []
            for arg in args:
                if arg is _NoneType:
                    continue
                try:
                    return self._convert(value, arg, path)
                except WireError as exc:
                    errors.append(str(exc))
            raise WireError(errors[0] if errors else f"{path}: bad value")
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise WireError(f"{path}: expected a record")
            return self._build(hint, value, path)
        if origin is list:
            (item,) = typing.get_args(hint) or (Any,)
            if not isinstance(value, list):
                raise WireError(f"{path}: expected a list")
            return [self._convert(v, item, f"{path}[]") for v in value]
        if origin is tuple:
            args = typing.get_args(hint)
            if not isinstance(value, list):
                raise WireError(f"{path}: expected a tuple")
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(self._convert(v, args[0], f"{path}[]") for v in value)
            if len(args) != len(value):
                raise WireError(f"{path}: expected {len(args)} items")
            return tuple(self._convert(v, a, f"{path}[]") for v, a in zip(value, args))
        if origin is dict:
            key_t, val_t = typing.get_args(hint) or (Any, Any)
            if not isinstance(value, dict):
                raise WireError(f"{path}: expected a map")
            return {self._convert(k, key_t, path): self._convert(v, val_t, f"{path}{{}}") for k, v in value.items()}
        return _scalar(value, hint, path)


def _scalar(value: Any, hint: Any, path: str) -> Any:
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint in (str, bool, bytes):
        if type(value) is hint:
            return value
    elif hint is _NoneType:
        if value is None:
            return None
    else:
        raise WireError(f"{path}: unsupported type {hint!r}")
    raise WireError(f"{path}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _dataclasses_in(hint: Any) -> list[type]:
    if dataclasses.is_dataclass(hint):
        return [hint]
    found: list[type] = []
    for arg in typing.get_args(hint):
        found.extend(_dataclasses_in(arg))
    return found
