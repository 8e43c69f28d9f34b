"""Command-line flags and flat keyword names, generated from the schema's field metadata (fields.param).

`FLAG_TABLE` maps every flag name (`--tp`, `--max-num-seqs`, `--kv-events-config`, ...) to its schema path.
`add_config_flags(parser)` adds them all to an argparse parser; `overrides_from_args(ns)` returns what was given.
The flat names of the Python API (`tensor_parallel_size=2`, `dtype="float32"`) are the flag names with
underscores: `FLAT_NAMES`.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel

from appliance.config.errors import ConfigError, Problem, did_you_mean
from appliance.config.fields import DERIVED, FLAGS_KEY, JSON_FLAG_KEY
from appliance.config.paths import KeyPath, coerce_text, is_bool, is_list

FlagKind = Literal["bool", "value", "list", "json"]
OVERRIDES_DEST = "_config_overrides"

# vLLM's names inside --speculative-config JSON, mapped to ours (the JSON is otherwise our section's keys).
JSON_KEY_ALIASES: dict[KeyPath, dict[str, str]] = {
    ("speculative",): {
        "method": "algorithm", "model": "draft_model_path", "num_speculative_tokens": "num_steps",
        "quantization": "draft_model_quantization",
    },
}
# vLLM's speculative methods -> speculative.algorithm (the translator's vLLM table reads this too); any other
# `<arch>_mtp` is the model's own MTP layers
VLLM_SPEC_METHODS: tuple[tuple[str, str], ...] = (
    ("mtp", "MTP"), ("deepseek_mtp", "MTP"), ("qwen3_next_mtp", "MTP"), ("glm4_moe_mtp", "MTP"), ("ernie_mtp", "MTP"),
    ("mimo_mtp", "MTP"), ("qwen3_5_mtp", "MTP"), ("step3p5_mtp", "MTP"), ("longcat_flash_mtp", "MTP"),
    ("eagle", "EAGLE"), ("eagle3", "EAGLE3"), ("ngram", "NGRAM"), ("[ngram]", "NGRAM"), ("ngram_gpu", "NGRAM"),
    ("draft_model", "STANDALONE"), ("dflash", "DFLASH"), ("dspark", "DSPARK"))
# what a vLLM method says beyond the algorithm (speculative keys)
VLLM_METHOD_IMPLIES: dict[str, dict[str, str]] = {"ngram_gpu": {"ngram_proposer": "device"}}


def vllm_spec_method(method: str) -> tuple[str | None, dict[str, str]]:
    """speculative.algorithm and the other keys a vLLM method name stands for ((None, {}) for one unknown)."""
    word = method.strip().lower()
    algorithm = dict(VLLM_SPEC_METHODS).get(word) or ("MTP" if word.endswith("_mtp") else None)
    return algorithm, VLLM_METHOD_IMPLIES.get(word, {})


@dataclass(frozen=True)
class FlagSpec:
    names: tuple[str, ...]  # first is canonical
    path: KeyPath
    kind: FlagKind
    help: str

    @property
    def flat_names(self) -> tuple[str, ...]:
        return tuple(n.lstrip("-").replace("-", "_") for n in self.names)


def _walk(model: type[BaseModel], prefix: KeyPath) -> Iterator[FlagSpec]:
    for key, info in model.model_fields.items():
        path = prefix + (key,)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        desc = info.description or ""
        if JSON_FLAG_KEY in extra:
            yield FlagSpec((str(extra[JSON_FLAG_KEY]),), path, "json", f"{desc} (JSON)")
        names = extra.get(FLAGS_KEY)
        if names:
            names = ["--" + key.replace("_", "-")] if names == [DERIVED] else names
            kind: FlagKind = "bool" if is_bool(info.annotation) else "list" if is_list(info.annotation) else "value"
            yield FlagSpec(tuple(str(n) for n in names), path, kind, desc)
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from _walk(sub, path)


@cache
def flag_specs() -> tuple[FlagSpec, ...]:
    from appliance.config.schema import ApplianceConfig

    specs = tuple(_walk(ApplianceConfig, ()))
    seen: dict[str, KeyPath] = {}
    for spec in specs:
        for name in spec.names + tuple("--no-" + n[2:] for n in spec.names if spec.kind == "bool"):
            if name in seen:
                raise RuntimeError(f"flag {name} is declared for both {seen[name]} and {spec.path}")
            seen[name] = spec.path
    return specs


@cache
def flag_table() -> dict[str, FlagSpec]:
    return {name: spec for spec in flag_specs() for name in spec.names}


@cache
def flat_table() -> dict[str, FlagSpec]:
    return {flat: spec for spec in flag_specs() for flat in spec.flat_names}


def json_value(spec: FlagSpec, raw: Any, name: str) -> Any:
    """Parse a JSON flag's value (text or an already-parsed mapping) and map foreign key names."""
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError([Problem(".".join(spec.path), f"{name} is not valid JSON: {exc}",
                                       where=f"flag {name}")]) from None
    if not isinstance(value, dict):
        raise ConfigError([Problem(".".join(spec.path), f"{name} must be a JSON object", where=f"flag {name}")])
    aliases = JSON_KEY_ALIASES.get(spec.path, {})
    doc = {aliases.get(k, k): v for k, v in value.items()}
    if spec.path == ("speculative",) and isinstance(value.get("method"), str):
        algorithm, implied = vllm_spec_method(value["method"])
        if algorithm is not None:
            doc = {**implied, **doc, "algorithm": algorithm}
    return doc


def typed_value(spec: FlagSpec, raw: Any, name: str) -> Any:
    """The value of a flag typed by its schema field (text from argv, or a Python value from the flat API)."""
    if spec.kind == "json":
        return json_value(spec, raw, name)
    if not isinstance(raw, str):
        return raw
    if spec.kind == "bool":
        return _parse_bool(raw, name)
    return coerce_text(spec.path, raw)


def _parse_bool(raw: str, name: str) -> bool:
    word = raw.strip().lower()
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise ConfigError([Problem("", f"{name} takes true or false, got {raw!r}", where=f"flag {name}")])


class _Record(argparse.Action):
    """Records (path, value, flag) in the namespace, in command-line order; later flags win."""

    def __init__(self, *args: Any, spec: FlagSpec, const_value: Any = None, **kwargs: Any) -> None:
        self.spec, self.const_value = spec, const_value
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        name = option_string or self.spec.names[0]
        if self.const_value is not None:
            value: Any = self.const_value
        elif self.spec.kind == "bool":
            value = True if values is None else _parse_bool(values, name)
        elif self.spec.kind == "list":
            items = list(values)  # pydantic types the items; a single "[1, 2]" is parsed as a list
            value = coerce_text(self.spec.path, items[0]) if len(items) == 1 and items[0].startswith("[") \
                else items
        else:
            value = typed_value(self.spec, values, name)
        getattr(ns, OVERRIDES_DEST).append((self.spec.path, value, f"flag {name}"))


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add every generated config flag plus `--set section.key=value` to an argparse parser."""
    parser.set_defaults(**{OVERRIDES_DEST: []})
    group = parser.add_argument_group("config flags (generated from the schema; see docs/parameters.md)")
    group.add_argument("--set", dest="config_set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="Set any config key (repeatable); highest precedence with the flags.")
    for spec in flag_specs():
        metavar = spec.path[-1].upper()
        if spec.kind == "bool":
            group.add_argument(*spec.names, action=_Record, spec=spec, nargs="?", metavar="true|false",
                               dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=spec.help)
            group.add_argument(*("--no-" + n[2:] for n in spec.names), action=_Record, spec=spec, nargs=0,
                               const_value=False, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                               help=f"Set {'.'.join(spec.path)} to false.")
        else:
            group.add_argument(*spec.names, action=_Record, spec=spec, nargs="+" if spec.kind == "list" else None,
                               metavar=metavar, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                               help=spec.help)


def overrides_from_args(ns: argparse.Namespace) -> list[tuple[KeyPath, Any, str]]:
    """(path, value, origin) for every config flag given, in order."""
    return list(getattr(ns, OVERRIDES_DEST, []))


# Familiar flags whose meaning differs here: refused with a pointer rather than mapped to a guess.
FLAG_HINTS: dict[str, str] = {
    "--max-num-batched-tokens": "use --chunked-prefill-size (the per-step token budget) or --max-total-tokens "
                                "(the KV token pool); `appliance translate` maps vLLM commands",
}


def unknown_flag_problems(unknown: Sequence[str]) -> list[Problem]:
    names = list(flag_table()) + ["--no-" + n[2:] for n, s in flag_table().items() if s.kind == "bool"]
    problems = []
    for arg in unknown:
        flag = arg.split("=")[0]
        if not arg.startswith("-"):
            problems.append(Problem("", f"unexpected argument {arg!r}", where="command line"))
        elif flag in FLAG_HINTS:
            problems.append(Problem("", f"unsupported flag {flag}: {FLAG_HINTS[flag]}", where="command line"))
        else:
            problems.append(Problem("", f"unknown flag {flag}{did_you_mean(flag, names)}", where="command line"))
    return problems
