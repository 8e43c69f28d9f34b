"""An engine's argument list -> flag uses, the way the engine's own parser reads it.

argparse rules carried over: `--flag=value`, exact names before unique-prefix abbreviations (`--tensor 8`),
`--no-X` for BooleanOptionalAction flags, multi-char short options with attached values (`-O3`, `-tp=8`).
vLLM's additions: `--flag_with_underscores`, dotted JSON keys (`--speculative-config.method mtp`) and
`--config FILE.yaml` (flat YAML of long names; the command line wins).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from appliance.translate.spec import NO_VALUE, EngineTable, Flag

_NUMBER = re.compile(r"^-\d+(\.\d*)?([eE][-+]?\d+)?$")
_BOOL_WORDS = ("true", "false", "True", "False", "1", "0")


@dataclass(frozen=True)
class FlagUse:
    flag: Flag | None  # None: unknown to the engine's table
    written: str  # the option as written (before abbreviation / underscore resolution)
    value: Any  # str, list[str], NO_VALUE, or a bool for switches
    subkey: str | None = None  # dotted JSON form: "method" of --speculative-config.method
    origin: str = "command line"
    problem: str = ""  # why the use could not be read (ambiguous abbreviation, missing value ...)

    @property
    def display(self) -> str:
        val = self.value
        if val is NO_VALUE or isinstance(val, bool):
            return self.written
        if isinstance(val, list):
            return " ".join([self.written, *map(str, val)])
        return f"{self.written} {val}"


def _is_option(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not _NUMBER.match(word)


class ArgvReader:
    def __init__(self, table: EngineTable, allow_abbrev: bool = True) -> None:
        self.table = table
        self.allow_abbrev = allow_abbrev
        self._long = table.long_names()

    def resolve(self, name: str) -> tuple[Flag | None, bool, str]:
        """(flag, negated, problem) for a long option name without value."""
        lookup = self.table.lookup
        if name in lookup:
            return lookup[name], False, ""
        if name.startswith("--no-") and ("--" + name[5:]) in lookup and lookup["--" + name[5:]].arity == "flag":
            # `--no-X` of a plain switch is not valid for every engine, but its meaning (X off) is unambiguous
            return lookup["--" + name[5:]], True, ""
        for prefix, why in self.table.families:
            if name.startswith(prefix):
                return None, False, why
        if self.allow_abbrev and name.startswith("--"):
            hits = sorted({n for n in self._long if n.startswith(name)})
            if len(hits) == 1:
                flag, negated, _ = self.resolve(hits[0])
                return flag, negated, ""
            if len(hits) > 1:
                return None, False, f"ambiguous abbreviation (matches {', '.join(hits[:5])})"
        return None, False, ""

    def read(self, words: list[str], origin: str = "command line") -> tuple[list[FlagUse], list[str]]:
        """Flag uses and positional words, in order."""
        uses: list[FlagUse] = []
        positionals: list[str] = []
        i = 0
        while i < len(words):
            word = words[i]
            i += 1
            if word == "--":
                positionals.extend(words[i:])
                break
            if not _is_option(word):
                positionals.append(word)
                continue
            head, eq, attached = word.partition("=")
            sub: str | None = None
            if head.startswith("--"):
                base, dot, sub_path = head.partition(".")
                name = "--" + base[2:].replace("_", "-")
                sub = sub_path if dot else None
                flag, negated, problem = self.resolve(name)
            else:
                flag, negated, problem = self._short(head)
                if flag is None and not eq:
                    flag, attached, eq = self._short_attached(head)
            if flag is None:
                value: Any = attached if eq else NO_VALUE
                if not eq and i < len(words) and not _is_option(words[i]):
                    value, i = words[i], i + 1  # an unknown option most likely takes the next word
                uses.append(FlagUse(None, word if not eq else head, value, sub, origin, problem))
                continue
            value, i, problem = self._value(flag, words, i, attached if eq else None, negated, sub)
            uses.append(FlagUse(flag, head, value, sub, origin, problem))
        return uses, positionals

    def _short(self, head: str) -> tuple[Flag | None, bool, str]:
        flag = self.table.lookup.get(head)
        return flag, False, ""

    def _short_attached(self, head: str) -> tuple[Flag | None, str, str]:
        """`-O3` -> (flag of -O, "3"): the longest registered short option the word starts with."""
        shorts = sorted((n for n in self.table.lookup if not n.startswith("--") and head.startswith(n)), key=len)
        if shorts and shorts[-1] != head:
            return self.table.lookup[shorts[-1]], head[len(shorts[-1]):], "="
        return None, "", ""

    def _value(self, flag: Flag, words: list[str], i: int, attached: str | None, negated: bool,
               sub: str | None) -> tuple[Any, int, str]:
        arity = "value" if sub is not None else flag.arity
        if arity == "flag":
            if attached is not None:
                return attached.lower() in ("true", "1", "yes"), i, ""
            return not negated, i, ""
        if attached is not None:
            return ([attached] if arity == "list" else attached), i, ""
        if arity == "optional":
            # `--x [<BOOL>]` (const True) takes only true/false; `--dump [PATH]` any word
            if i < len(words) and not _is_option(words[i]) and (flag.const is not True or words[i] in _BOOL_WORDS):
                return words[i], i + 1, ""
            return NO_VALUE, i, ""
        if arity == "list":
            vals = []
            while i < len(words) and not _is_option(words[i]):
                vals.append(words[i])
                i += 1
            return vals, i, "" if vals else "expects at least one value"
        if i < len(words) and not _is_option(words[i]):
            return words[i], i + 1, ""
        return NO_VALUE, i, "expects a value"


def config_file_words(text: str, name: str) -> list[str]:
    """A flat YAML config file (`--config`) as the command-line words it stands for."""
    import yaml

    data = yaml.safe_load(text)
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"{name}: expected a mapping of flag names to values")
    words: list[str] = []
    for key, value in data.items():
        name = "--" + str(key).lstrip("-")
        if value is True:
            words.append(name)
        elif value is False:
            words.append("--no-" + name[2:])
        elif isinstance(value, list):
            words.extend([name, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)])
        elif isinstance(value, dict):
            words.extend([name, json.dumps(value)])
        elif value is not None:
            words.extend([name, str(value)])
    return words
