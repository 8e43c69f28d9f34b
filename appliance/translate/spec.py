"""The records a flag table is made of: one `Flag` per engine flag, built with the small constructors below.

A table is data: each engine module in `appliance/translate/tables/` is a tuple of these records and nothing else.
The status says how faithfully a flag carries over:

- same: the appliance key means the same thing (values may be renamed through `values`);
- similar: near-equivalent (seed 001 "Similar But Not Identical"); `note` says what changes and goes into the TOML;
- implied: the appliance always behaves this way (or derives it), nothing to set; noted, never warned;
- none: no equivalent here; warned on stderr and commented in the TOML;
- removed: the source engine itself dropped the flag; warned like `none`, with the version in `note`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["same", "similar", "implied", "none", "removed"]
# How a flag consumes the command line. value: one word; flag: none (store_true, also `--no-X` when `negatable`);
# optional: zero or one word (Atlas `--dump [PATH]`); list: words until the next option; json: a JSON document
# (also reachable key by key with dotted forms `--flag.key value`).
Arity = Literal["value", "flag", "optional", "list", "json"]

NO_VALUE = object()  # what an `optional` flag given without a word carries


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # first is canonical; long `--x` and short `-x` forms
    status: Status
    target: str | None = None  # "section.key" or "@scratch" (combined by the engine's rules); None = not mapped
    arity: Arity = "value"
    note: str = ""
    const: Any = None  # value set when a `flag` is present (default True; False for `--disable-*` style)
    values: tuple[tuple[str, Any], ...] = ()  # source value -> appliance value renames (compared lowercased)
    closed: bool = False  # values outside `values` have no equivalent (backend names) instead of passing through
    negatable: bool = False  # `--no-X` also accepted (argparse BooleanOptionalAction)
    subkeys: tuple[tuple[str, str], ...] = ()  # json flags: source key -> "section.key"; empty = whole value
    neutral: tuple[str, ...] = ()  # values that change nothing here (e.g. pipeline size 1): noted, not warned
    group: str = ""  # heading in docs/translation.md

    @property
    def canonical(self) -> str:
        return self.names[0]

    @property
    def mapped(self) -> bool:
        return self.status in ("same", "similar") and self.target is not None

    def value_map(self) -> dict[str, Any]:
        return {k.lower(): v for k, v in self.values}


@dataclass(frozen=True)
class EngineTable:
    """Everything the translator knows about one engine."""

    name: str  # "vllm", "sglang", "tokenspeed", "atlas"
    title: str
    flags: tuple[Flag, ...]
    # appliance settings the engine's own defaults imply when the command leaves them out (key, value, why):
    # kept so that translated deployments behave like the originals (e.g. SGLang listens on port 30000).
    defaults: tuple[tuple[str, Any, str], ...] = ()
    # environment variables the engine reads that map to settings: name -> (flag name it acts like)
    env_flags: tuple[tuple[str, str], ...] = ()
    source: str = ""  # where the flag list was read (docs/translation.md cites it)
    families: tuple[tuple[str, str], ...] = ()  # flag-name prefix -> why the whole family has no equivalent
    lookup: dict[str, Flag] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for flag in self.flags:
            for name in flag.names:
                if name in self.lookup:
                    raise ValueError(f"{self.name}: flag {name} is declared twice")
                self.lookup[name] = flag

    def long_names(self) -> list[str]:
        """Every long option string the engine's parser registers (`--no-X` included), for abbreviations."""
        out: list[str] = []
        for flag in self.flags:
            for name in flag.names:
                if name.startswith("--"):
                    out.append(name)
                    if flag.negatable:
                        out.append("--no-" + name[2:])
        return out


def _f(names: str | tuple[str, ...], status: Status, target: str | None, group: str, **kw: Any) -> Flag:
    return Flag(names=(names,) if isinstance(names, str) else tuple(names), status=status, target=target,
                group=group, **kw)


def same(names: str | tuple[str, ...], target: str, group: str = "", **kw: Any) -> Flag:
    return _f(names, "same", target, group, **kw)


def similar(names: str | tuple[str, ...], target: str, note: str, group: str = "", **kw: Any) -> Flag:
    return _f(names, "similar", target, group, note=note, **kw)


def implied(names: str | tuple[str, ...], note: str, group: str = "", **kw: Any) -> Flag:
    return _f(names, "implied", None, group, note=note, **kw)


def none(names: str | tuple[str, ...], note: str, group: str = "", **kw: Any) -> Flag:
    return _f(names, "none", None, group, note=note, **kw)


def removed(names: str | tuple[str, ...], note: str, group: str = "", **kw: Any) -> Flag:
    return _f(names, "removed", None, group, note=note, **kw)


def nones(group: str, note: str, *names: str, arity: Arity = "value") -> tuple[Flag, ...]:
    """Many flags of one group with the same reason for having no equivalent."""
    return tuple(none(n, note, group, arity=arity) for n in names)


def switches(group: str, note: str, *names: str) -> tuple[Flag, ...]:
    """Like `nones` for store_true switches (they take no value)."""
    return nones(group, note, *names, arity="flag")
