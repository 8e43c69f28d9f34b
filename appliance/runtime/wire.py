"""The typed wire between pipeline processes: frozen dataclasses <-> msgpack, decoded against a schema.

A frame is `[tag, {field: value}]`, a field at its (immutable or empty) default left out. The decoder knows every message type by tag and checks each field against
the dataclass' type hints (recursively for nested records, lists, tuples, dicts and optionals), so a malformed or
hostile frame is rejected as a whole with `WireError`; nothing is ever unpickled or executed.

Each type hint is compiled once, when the codec is built, into a small converter function: a step's frames (a
plan or result with hundreds of requests, an output batch per step) cross the wire on every step, and
re-reading the hints per frame cost more CPU than the scheduler's own planning at high concurrency.
"""
from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable
from typing import Any, Union

import msgpack


class WireError(ValueError):
    """A frame that does not decode to a known, well-typed message."""


class _Bad(Exception):
    """A value that does not fit its hint; `path` collects the field names on the way out."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []

    def at(self, part: str) -> _Bad:
        self.path.append(part)
        return self


Decoder = Callable[[Any], Any]
Encoder = Callable[[Any], Any]
_NoneType = type(None)
_SCALARS: dict[Any, frozenset[type]] = {  # the msgpack types each scalar hint accepts (bool is not an int here)
    int: frozenset({int}), float: frozenset({int, float}), str: frozenset({str}), bool: frozenset({bool}),
    bytes: frozenset({bytes}), _NoneType: frozenset({_NoneType}),
}


class Codec:
    """Encodes and decodes one closed set of message types; unknown tags are errors."""

    def __init__(self, *message_types: type) -> None:
        self._by_tag: dict[str, type] = {}
        self._decoders: dict[type, Decoder] = {}
        self._encoders: dict[type, Encoder] = {}
        for cls in message_types:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls!r} is not a dataclass")
            self._by_tag[cls.__name__] = cls
            self._record_decoder(cls)
            self._record_encoder(cls)
        self.num_malformed = 0  # frames rejected by `decode_or_none`

    # -- encoding ------------------------------------------------------------------------------------------

    def encode(self, msg: Any) -> bytes:
        cls = type(msg)
        if self._by_tag.get(cls.__name__) is not cls:
            raise TypeError(f"{cls.__name__} is not a message type of this codec")
        return msgpack.packb([cls.__name__, self._encoders[cls](msg)], use_bin_type=True)

    def _record_encoder(self, cls: type) -> Encoder:
        if cls in self._encoders:
            return self._encoders[cls]
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        names = tuple(f.name for f in fields)
        self._encoders[cls] = lambda obj: encode(obj)  # recursive records resolve through the table
        nested = [(n, enc) for n in names if (enc := self._encoder(hints[n])) is not None]
        values = operator.attrgetter(*names) if len(names) > 1 else (lambda obj: (getattr(obj, names[0]),))
        # a field at its default is left out (the decoder's dataclass fills it in): most of an output's or a
        # plan row's optional fields are None or 0 on most steps, and every key costs on both sides
        omittable = [(f.name, d) for f in fields if (d := _omittable(f)) is not _KEEP]

        def encode(obj: Any) -> dict[str, Any]:
            out = dict(zip(names, values(obj)))
            for name, default in omittable:
                value = out[name]
                if value is default or (type(value) is type(default) and value == default):
                    del out[name]
            for name, enc in nested:
                if name in out:
                    out[name] = enc(out[name])
            return out

        self._encoders[cls] = encode
        return encode

    def _encoder(self, hint: Any) -> Encoder | None:
        """A converter to msgpack-native values, or None where the value already is one (scalars, lists and
        tuples of them: msgpack packs a tuple as an array)."""
        if hint is Any:
            return _to_plain
        if dataclasses.is_dataclass(hint):
            return self._record_encoder(hint)
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        inner = [self._encoder(a) for a in args]
        if all(e is None for e in inner):
            return None
        origin = typing.get_origin(hint)
        if origin in (Union, types.UnionType):
            return _to_plain  # a union holding records: rare, take the generic path
        if origin in (list, tuple) and len(inner) == 1:
            item = inner[0] or _identity
            return lambda v: [item(x) for x in v]
        return _to_plain

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
        try:
            return self._decoders[cls](obj[1])
        except _Bad as bad:
            raise WireError(f"{obj[0]}{''.join(reversed(bad.path))}: {bad.message}") from None

    def decode_or_none(self, frame: bytes) -> Any | None:
        """Decode, or count the frame as malformed and return None (the receive loops drop it)."""
        try:
            return self.decode(frame)
        except WireError:
            self.num_malformed += 1
            return None

    def _record_decoder(self, cls: type) -> Decoder:
        if cls in self._decoders:
            return self._decoders[cls]
        self._decoders[cls] = lambda v: build(v)  # recursive records resolve through the table
        hints = typing.get_type_hints(cls)
        plan = [(f.name, self._decoder(hints[f.name]),
                 f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                for f in dataclasses.fields(cls)]
        decoders = {name: dec for name, dec, _ in plan}
        required = frozenset(name for name, _, req in plan if req)

        def build(value: Any) -> Any:
            if type(value) is not dict:
                raise _Bad("expected a record")
            kwargs: dict[str, Any] = {}
            for name, item in value.items():  # the fields present (the encoder leaves defaults out)
                dec = decoders.get(name)
                if dec is None:
                    raise _Bad(f"unknown fields {sorted(map(str, set(value) - decoders.keys()))[:5]}")
                try:
                    kwargs[name] = dec(item)
                except _Bad as bad:
                    raise bad.at(f".{name}") from None
            if not required.issubset(kwargs):
                raise _Bad(f"missing field {min(required - kwargs.keys())!r}")
            try:
                return cls(**kwargs)
            except (TypeError, ValueError) as exc:  # __post_init__ validation
                raise _Bad(str(exc)) from None

        self._decoders[cls] = build
        return build

    def _decoder(self, hint: Any) -> Decoder:
        if hint is Any:
            return _identity
        if dataclasses.is_dataclass(hint):
            return self._record_decoder(hint)
        if hint in _SCALARS:
            return _scalar_decoder(hint)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (Union, types.UnionType):
            return self._union_decoder(args)
        if origin is list:
            return self._list_decoder(args[0] if args else Any)
        if origin is tuple:
            return self._tuple_decoder(args)
        if origin is dict:
            key_t, val_t = args or (Any, Any)
            return self._dict_decoder(self._decoder(key_t), self._decoder(val_t))
        raise TypeError(f"the wire cannot carry {hint!r}")

    def _union_decoder(self, args: tuple[Any, ...]) -> Decoder:
        optional = _NoneType in args
        choices = [self._decoder(a) for a in args if a is not _NoneType]
        if len(choices) == 1:
            only = choices[0]
            return (lambda v: None if v is None else only(v)) if optional else only

        def union(value: Any) -> Any:
            if value is None and optional:
                return None
            first: _Bad | None = None
            for dec in choices:
                try:
                    return dec(value)
                except _Bad as bad:
                    first = first or bad
            raise first or _Bad("bad value")

        return union

    def _list_decoder(self, item: Any) -> Decoder:
        if item in _SCALARS:  # token ids, block ids, logprobs: one C-level type scan instead of a call per item
            allowed, name, to_float = _SCALARS[item], item.__name__, item is float

            def scalars(value: Any) -> Any:
                if type(value) is not list:
                    raise _Bad("expected a list")
                if not allowed.issuperset(set(map(type, value))):
                    raise _Bad(f"expected {name} items").at("[]")
                return [float(x) for x in value] if to_float else value

            return scalars
        dec = self._decoder(item)

        def items(value: Any) -> Any:
            if type(value) is not list:
                raise _Bad("expected a list")
            try:
                return [dec(x) for x in value]
            except _Bad as bad:
                raise bad.at("[]") from None

        return items

    def _tuple_decoder(self, args: tuple[Any, ...]) -> Decoder:
        if len(args) == 2 and args[1] is Ellipsis:
            as_list = self._list_decoder(args[0])
            return lambda v: tuple(as_list(v))
        decs = [self._decoder(a) for a in args]

        def fixed(value: Any) -> Any:
            if type(value) is not list:
                raise _Bad("expected a tuple")
            if len(value) != len(decs):
                raise _Bad(f"expected {len(decs)} items")
            try:
                return tuple(dec(x) for dec, x in zip(decs, value))
            except _Bad as bad:
                raise bad.at("[]") from None

        return fixed

    @staticmethod
    def _dict_decoder(key: Decoder, val: Decoder) -> Decoder:
        def mapping(value: Any) -> Any:
            if type(value) is not dict:
                raise _Bad("expected a map")
            try:
                return {key(k): val(v) for k, v in value.items()}
            except _Bad as bad:
                raise bad.at("{}") from None

        return mapping


_KEEP = object()  # a field the encoder always writes


def _omittable(f: dataclasses.Field) -> Any:
    """The default a field may be left out at: an immutable scalar default or an empty container's factory; else
    _KEEP."""
    if f.default is not dataclasses.MISSING:
        return f.default if type(f.default) in (_NoneType, bool, int, float, str, bytes) else _KEEP
    if f.default_factory in (list, dict, tuple):  # type: ignore[comparison-overlap]
        return f.default_factory()  # type: ignore[misc]
    return _KEEP


def _identity(value: Any) -> Any:
    return value


def _scalar_decoder(hint: Any) -> Decoder:
    allowed, name = _SCALARS[hint], getattr(hint, "__name__", str(hint))
    if hint is float:
        def as_float(value: Any) -> float:
            if type(value) in allowed:
                return float(value)
            raise _Bad(f"expected float, got {type(value).__name__}")
        return as_float

    def exact(value: Any) -> Any:
        if type(value) in allowed:
            return value
        raise _Bad(f"expected {name}, got {type(value).__name__}")

    return exact


def _to_plain(obj: Any) -> Any:
    """The generic conversion for values typed Any: records become maps, tuples lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj
