"""Reading config documents (TOML or YAML) with the line of every key, and following `extends` chains."""
from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from appliance.config.errors import ConfigError, Problem

KeyPath = tuple[str, ...]
EXTENDS = "extends"


@dataclass(frozen=True)
class Document:
    """One parsed file: its data and where (file:line) each key was written."""

    name: str
    data: dict[str, Any]
    lines: dict[KeyPath, int] = field(default_factory=dict)

    def where(self, path: KeyPath) -> str:
        """file:line of the key, or of its nearest written parent (inline tables, whole sections)."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.lines:
                return f"{self.name}:{self.lines[path[:n]]}"
        return self.name


def parse_text(text: str, name: str, fmt: str | None = None) -> Document:
    """Parse TOML or YAML text. fmt None: by file suffix; unknown suffix (stdin): TOML, then YAML."""
    if fmt is None:
        suffix = Path(name).suffix.lower()
        fmt = "yaml" if suffix in (".yaml", ".yml") else "toml" if suffix == ".toml" else "guess"
    if fmt == "guess":
        try:
            return _parse_toml(text, name)
        except ConfigError as toml_error:
            try:
                doc = _parse_yaml(text, name)
            except ConfigError:
                raise toml_error from None
            if doc.data or not text.strip():
                return doc
            raise toml_error from None
    return _parse_yaml(text, name) if fmt == "yaml" else _parse_toml(text, name)


def _parse_toml(text: str, name: str) -> Document:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        where = f"{name}:{m.group(1)}" if m else name
        raise ConfigError([Problem("", f"TOML syntax error: {re.sub(r' [(]at line.*', '', msg)}"
                                   + (f" (column {m.group(2)})" if m else ""), where=where)]) from None
    return Document(name, data, _toml_lines(text))


_HEADER = re.compile(r"^\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^((?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)\s*=")


def _split_key(key: str) -> KeyPath:
    parts = re.findall(r"\"([^\"]*)\"|'([^']*)'|([A-Za-z0-9_-]+)", key)
    return tuple(a or b or c for a, b, c in parts)


def _toml_lines(text: str) -> dict[KeyPath, int]:
    # tomllib keeps no positions; a line scan of headers and `key =` is enough for error messages.
    lines: dict[KeyPath, int] = {}
    table: KeyPath = ()
    in_multiline = False
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if in_multiline:
            in_multiline = line.count('"""') % 2 == 0 and line.count("'''") % 2 == 0
            continue
        if not line or line.startswith("#"):
            continue
        header = _HEADER.match(line)
        if header:
            table = _split_key(header.group(1))
            lines.setdefault(table, number)
            continue
        key = _KEY.match(line)
        if key:
            lines.setdefault(table + _split_key(key.group(1)), number)
            if line.count('"""') % 2 or line.count("'''") % 2:
                in_multiline = True
    return lines


def _parse_yaml(text: str, name: str) -> Document:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{name}:{mark.line + 1}" if mark else name
        problem = " ".join(str(x) for x in (exc.context, exc.problem) if x)
        raise ConfigError([Problem("", f"YAML syntax error: {problem}", where=where)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem("", f"YAML error: {exc}", where=name)]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([Problem("", "the document must be a mapping of sections", where=f"{name}:1")])
    lines: dict[KeyPath, int] = {}
    _yaml_lines(node, (), lines, name)
    return Document(name, data, lines)


def _yaml_lines(node: yaml.Node | None, prefix: KeyPath, out: dict[KeyPath, int], name: str) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        path = prefix + (str(key_node.value),)
        line = key_node.start_mark.line + 1
        if path in out:  # PyYAML keeps the last silently; TOML refuses, and so do we
            raise ConfigError([Problem(".".join(path), f"duplicate key (first set on line {out[path]})",
                                       where=f"{name}:{line}")])
        out[path] = line
        _yaml_lines(value_node, path, out, name)


def read_document(path: Path) -> Document:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([Problem("", f"cannot read config file: {exc.strerror or exc}", where=str(path))]) from None
    return parse_text(text, str(path))


def extends_chain(doc: Document, base_dir: Path) -> list[Document]:
    """[root base, ..., doc]: the document and everything it extends, base first, `extends` keys removed."""
    chain = [doc]
    seen = [str(Path(doc.name).resolve())] if Path(doc.name).exists() else [doc.name]
    current, directory = doc, base_dir
    while EXTENDS in current.data:
        target = current.data[EXTENDS]
        where = current.where((EXTENDS,))
        if not isinstance(target, str) or not target:
            raise ConfigError([Problem(EXTENDS, "must be a file path string", where=where)])
        path = (directory / target).resolve()
        shown = Path(os.path.normpath(directory / target))  # messages keep the user's relative form
        if str(path) in seen:
            cycle = " -> ".join([*seen, str(path)])
            raise ConfigError([Problem(EXTENDS, f"extends cycle: {cycle}", where=where)])
        if not path.is_file():
            raise ConfigError([Problem(EXTENDS, f"extended file not found: {target} (looked for {path})",
                                       where=where)])
        seen.append(str(path))
        current, directory = read_document(shown), shown.parent
        chain.insert(0, current)
    return [Document(d.name, {k: v for k, v in d.data.items() if k != EXTENDS}, d.lines) for d in chain]
