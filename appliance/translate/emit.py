"""Translation -> TOML text with comments.

A small emitter of our own rather than tomli-w: the output's value is in its comments (where each setting came
from, what changed, what was not carried over) and tomli-w cannot write comments. It is deterministic: sections
and keys in schema order, one `key = value` per line, nested keys dotted (`caps.max_logprobs = 20`).
"""
from __future__ import annotations

import json
import re
import shlex
import textwrap

from appliance.config.toml_text import toml_key, toml_value
from appliance.translate import schema_view
from appliance.translate.result import Translation

_WIDTH = 110
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _one_line(text: str) -> str:
    """Comment-safe text: TOML comments may not hold control characters (a newline would end the comment)."""
    return _CONTROL.sub(lambda m: " " if m.group() in "\n\r" else repr(m.group())[1:-1], text)


def _comment(text: str, bullet: str = "") -> list[str]:
    """Comment lines wrapped to the width; with a bullet, continuation lines are indented under it."""
    wrapped = textwrap.wrap(_one_line(text), _WIDTH - 2 - len(bullet), break_on_hyphens=False) or [""]
    pad = " " * len(bullet)
    return [f"# {bullet if i == 0 else pad}{line}".rstrip() for i, line in enumerate(wrapped)]


def _header(tr: Translation, origin: str) -> list[str]:
    lines = [f"# Translated by `appliance translate` from the {tr.title} command at {origin} line {tr.line}:"]
    cmd = _one_line(shlex.join(tr.command))
    lines += [f"#   {chunk}" for chunk in textwrap.wrap(cmd, _WIDTH - 4, break_on_hyphens=False)]
    unmapped = [f for f in tr.findings if f.level == "warning"]
    notes = [f for f in tr.findings if f.level == "note"]
    if unmapped:
        lines.append("#")
        lines.append("# Not carried over (review these):")
        for f in unmapped:
            lines += _comment(f"{f.subject}: {f.message}", "  - ")
    if notes:
        lines.append("#")
        lines.append("# Notes:")
        for f in notes:
            lines += _comment(f"{f.subject}: {f.message}", "  - ")
    if tr.context:
        lines.append("#")
        lines.append("# Environment:")
        for c in tr.context:
            lines += _comment(c, "  - ")
    if tr.unsupported:
        lines.append("#")
        lines.append("# Valid, but not available in this build yet:")
        for u in tr.unsupported:
            lines += _comment(u, "  - ")
    if tr.problems:
        lines.append("#")
        lines.append("# Validation problems (fix before use):")
        for p in tr.problems:
            lines += _comment(p, "  - ")
    return lines


def _order(path: str) -> tuple[int, int, str]:
    section, _, key = path.partition(".")
    sections = schema_view.sections()
    keys = schema_view.keys(section)
    s = sections.index(section) if section in sections else len(sections)
    k = keys.index(key) if key in keys else len(keys)
    return s, k, key


def to_toml(tr: Translation, origin: str = "input") -> str:
    lines = _header(tr, origin)
    entries: dict[str, list[tuple[str, list[str]]]] = {}
    said: set[str] = set()  # a note shared by several keys (one JSON flag) is written once, above the first
    for s in sorted(tr.settings.values(), key=lambda s: _order(s.path)):
        section, _, key = s.path.partition(".")
        block = _comment(s.note) if s.note and s.note not in said else []
        said.add(s.note)
        block.append(f"{'.'.join(toml_key(k) for k in key.split('.'))} = {toml_value(s.value)}  "
                     f"# {_one_line(s.source)}")
        entries.setdefault(section, []).append((key, block))
    for p in sorted(tr.pending, key=lambda p: _order(p.path)):
        section, _, key = p.path.partition(".")
        block = [f"# {key} = {json.dumps(p.raw)}  # {_one_line(p.source)}: {p.reason}, fill in before use"]
        entries.setdefault(section, []).append((key, block))
    for section in sorted(entries, key=lambda sec: _order(sec + ".")):
        lines.append("")
        lines.append(f"[{section}]")
        for _, block in entries[section]:
            lines.extend(line.rstrip() for line in block)
    return "\n".join(lines) + "\n"
