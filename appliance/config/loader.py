"""Layered loading: defaults < extends chain (base first) < the file < environment < flags and `--set`.

Every leaf value remembers where it came from (default, file:line, env variable, flag, --set, keyword), and
every problem found is reported at once with that location.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from appliance.config.checks import check_consistency, check_model
from appliance.config.errors import ConfigError, Problem, did_you_mean
from appliance.config.flags import flat_table, typed_value
from appliance.config.interpolation import interpolate
from appliance.config.paths import KeyPath, coerce_text, resolve_path, split_dotted
from appliance.config.schema import SKIP_CROSS_CHECKS, ApplianceConfig
from appliance.config.sources import Document, extends_chain, parse_text, read_document
from appliance.config.support import unsupported_problems

ENV_PREFIX = "APPLIANCE_"
DEFAULT = "default"


@dataclass(frozen=True)
class Resolved:
    """A built config, where each of its values came from, and the warnings (settings not honoured yet)."""

    config: ApplianceConfig
    provenance: dict[str, str]  # dotted leaf path -> "default" | "file.toml:12" | "env APPLIANCE_X__Y" | ...
    warnings: tuple[Problem, ...]


class _Layers:
    """The merged raw data and the origin of every leaf."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.origins: dict[KeyPath, str] = {}
        self.tables: dict[KeyPath, str] = {}  # where a file opened a table: the line for errors about it

    def put(self, path: KeyPath, value: Any, origin: str) -> None:
        if isinstance(value, Mapping) and value:
            for key, sub in value.items():
                self.put(path + (str(key),), sub, origin)
            return
        node = self.data
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = dict(value) if isinstance(value, Mapping) else value
        for known in [p for p in self.origins if p[: len(path)] == path]:
            del self.origins[known]  # a replaced subtree loses its old origins
        self.origins[path] = origin

    def where(self, path: Sequence[str]) -> str | None:
        """Origin of the value at path, else of its nearest parent, else of its first written child."""
        for n in range(len(path), 0, -1):
            if tuple(path[:n]) in self.origins:
                return self.origins[tuple(path[:n])]
        if tuple(path) in self.tables:
            return self.tables[tuple(path)]
        below = [origin for p, origin in self.origins.items() if p[: len(path)] == tuple(path)]
        return below[0] if below else None


def _apply_document(layers: _Layers, doc: Document) -> None:
    def walk(data: Mapping[str, Any], prefix: KeyPath) -> None:
        for key, value in data.items():
            path = prefix + (str(key),)
            if isinstance(value, Mapping) and value:
                layers.tables[path] = doc.where(path)
                walk(value, path)
            else:
                layers.put(path, value, doc.where(path))

    walk(doc.data, ())


def _env_overrides(env: Mapping[str, str]) -> tuple[list[tuple[KeyPath, Any, str]], list[Problem]]:
    out: list[tuple[KeyPath, Any, str]] = []
    problems: list[Problem] = []
    for name in sorted(env):
        rest = name[len(ENV_PREFIX):]
        if not name.startswith(ENV_PREFIX) or "__" not in rest:
            continue  # APPLIANCE_<SECTION>__<KEY> only; other APPLIANCE_* variables are not config
        path = tuple(part.lower() for part in rest.split("__"))
        try:
            out.append((path, coerce_text(path, env[name]), f"env {name}"))
        except KeyError as exc:
            problems.append(Problem(".".join(path), str(exc.args[0]), where=f"env {name}"))
    return out, problems


def _dotlist(dotlist: Iterable[str]) -> tuple[list[tuple[KeyPath, Any, str]], list[Problem]]:
    out: list[tuple[KeyPath, Any, str]] = []
    problems: list[Problem] = []
    for item in dotlist:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(Problem("", f"--set takes SECTION.KEY=VALUE, got {item!r}", where="--set"))
            continue
        path = split_dotted(key)
        try:
            out.append((path, coerce_text(path, raw), f"--set {key.strip()}"))
        except KeyError as exc:
            problems.append(Problem(key.strip(), str(exc.args[0]), where="--set"))
    return out, problems


def _flat(flat: Mapping[str, Any]) -> tuple[list[tuple[KeyPath, Any, str]], list[Problem]]:
    out: list[tuple[KeyPath, Any, str]] = []
    problems: list[Problem] = []
    table = flat_table()
    for name, value in flat.items():
        if "." in name:
            path = split_dotted(name)
            try:
                resolve_path(path)
            except KeyError as exc:
                problems.append(Problem(name, str(exc.args[0]), where=f"keyword {name}"))
                continue
            out.append((path, value, f"keyword {name}"))
            continue
        spec = table.get(name.replace("-", "_"))
        if spec is None:
            problems.append(Problem("", f"unknown setting {name!r}{did_you_mean(name, table)}",
                                    where=f"keyword {name}"))
            continue
        try:
            out.append((spec.path, typed_value(spec, value, name), f"keyword {name}"))
        except ConfigError as exc:
            problems.extend(exc.problems)
    return out, problems


def _validation_problems(exc: ValidationError, layers: _Layers) -> list[Problem]:
    problems = []
    for err in exc.errors():
        loc = tuple(str(x) for x in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            try:
                resolve_path(loc)
            except KeyError as key_error:
                msg = str(key_error.args[0])
        elif err["type"] != "value_error" and "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg}, got {err['input']!r}"
        msg = msg.removeprefix("Value error, ")
        problems.append(Problem(".".join(loc), msg, where=layers.where(loc)))
    return problems


def resolve(file: str | Path | None = None, *, text: str | None = None, flat: Mapping[str, Any] | None = None,
            dotlist: Sequence[str] = (), env: Mapping[str, str] | None = None,
            flags: Sequence[tuple[KeyPath, Any, str]] = (), run_env: bool = True) -> Resolved:
    """Build a config from all layers. `text` (with `file` as its name, e.g. "<stdin>") replaces reading `file`.
    Raises ConfigError listing every error; settings this build cannot honour come back as warnings.
    `${oc.env:VAR}` values are resolved from the environment; run_env False (validate: the file is judged
    without its run-time environment) reports an unset variable as a warning instead of an error."""
    layers = _Layers()
    if file is not None or text is not None:
        name = str(file) if file is not None else "<stdin>"
        doc = parse_text(text, name) if text is not None else read_document(Path(file))  # type: ignore[arg-type]
        base_dir = Path(name).parent if text is None else Path.cwd()
        for document in extends_chain(doc, base_dir):
            _apply_document(layers, document)
    env_items, problems = _env_overrides(os.environ if env is None else env)
    set_items, set_problems = _dotlist(dotlist)
    flat_items, flat_problems = _flat(flat or {})
    problems += set_problems + flat_problems
    for path, value, origin in [*env_items, *flat_items, *flags, *set_items]:
        layers.put(path, value, origin)
    interp_errors, interp_warnings = interpolate(layers.data, strict=run_env, where=layers.where)
    problems += interp_errors
    if problems:
        raise ConfigError(problems)
    try:
        config = ApplianceConfig.model_validate(layers.data, context={SKIP_CROSS_CHECKS: True})
    except ValidationError as exc:
        problems = _validation_problems(exc, layers)
        raise ConfigError(problems + _checks_of_valid_sections(layers, problems)) from None
    checked = _located(check_consistency(config) + check_model(config), layers)
    errors = [p for p in checked if p.severity == "error"]
    if errors:
        raise ConfigError(errors)
    warnings = interp_warnings + [p for p in checked if p.severity == "warning"] + [
        Problem(p.path, p.message, p.severity, layers.where(split_dotted(p.path)))
        for p in unsupported_problems(config)]
    return Resolved(config, _provenance(config, layers), tuple(warnings))


def _located(problems: list[Problem], layers: _Layers) -> list[Problem]:
    return [Problem(p.path, p.message, p.severity, p.where or layers.where(split_dotted(p.path)))
            for p in problems]


def _checks_of_valid_sections(layers: _Layers, problems: list[Problem]) -> list[Problem]:
    """Cross-field errors among the sections that did validate, so that one run reports everything."""
    bad = {p.path.split(".")[0] for p in problems}
    good = {k: v for k, v in layers.data.items() if k not in bad and k in ApplianceConfig.model_fields}
    try:
        partial = ApplianceConfig.model_validate(good, context={SKIP_CROSS_CHECKS: True})
    except ValidationError:
        return []
    # without a valid model section the partial config would name the embedded model: no model checks then
    found = check_consistency(partial) + (check_model(partial) if "model" not in bad else [])
    return [p for p in _located(found, layers) if p.severity == "error" and p.path.split(".")[0] not in bad]


def _provenance(config: ApplianceConfig, layers: _Layers) -> dict[str, str]:
    out: dict[str, str] = {}

    def walk(data: Any, prefix: KeyPath) -> None:
        if isinstance(data, dict) and data:
            for key, value in data.items():
                walk(value, prefix + (key,))
        else:
            out[".".join(prefix)] = layers.where(prefix) or DEFAULT

    walk(config.model_dump(mode="json"), ())
    return out


def build_config(file: str | Path | None = None, *, flat: Mapping[str, Any] | None = None,
                 dotlist: Sequence[str] = (), env: Mapping[str, str] | None = None) -> ApplianceConfig:
    """The config from an optional file, environment (os.environ when env is None), flat keyword overrides
    (`tensor_parallel_size=2`, `dtype="float32"`, `model="/path"` ...) and `--set` style dotlist."""
    return resolve(file, flat=flat, dotlist=dotlist, env=env).config


def load_config(file: str | Path | None = None) -> ApplianceConfig:
    return build_config(file)
