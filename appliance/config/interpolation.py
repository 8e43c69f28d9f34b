"""`${oc.env:VAR}` interpolation in config values, resolved by omegaconf when a config is built.

A value such as `dist_init_addr = "${oc.env:MASTER_IP}:${oc.env:PORT}"` keeps a deployment's host-specific
parts in the environment (`appliance translate` writes shell variables this way). Resolved text is typed by the
schema field like any text value (`paths.coerce_text`: a port becomes an int).

An unset variable (without a `${oc.env:VAR,default}` default) is an error when the deployment is built to run.
`appliance validate` judges a file without its run-time environment: there it is a warning, and the check goes on
with the raw text for a plain string field, or with the field's default for any other.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from appliance.config.errors import Problem
from appliance.config.paths import KeyPath, _flatten, coerce_text, resolve_path

MARK = "${"
_UNSET_BELOW = re.compile(r"Environment variable '([A-Za-z_]\w*)' not found")
_ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(,[^}]*)?\}")


def env_ref(name: str) -> str:
    """The interpolation that reads environment variable `name`."""
    return "${oc.env:" + name + "}"


def unset_variables(text: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Variables the text reads that are unset and have no default."""
    env = os.environ if environ is None else environ
    return [m.group(1) for m in _ENV_REF.finditer(text) if m.group(2) is None and m.group(1) not in env]


def _leaves(data: Any, prefix: KeyPath = ()) -> Iterator[tuple[KeyPath, str]]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _leaves(value, prefix + (str(key),))
    elif isinstance(data, str) and MARK in data:
        yield prefix, data


def _put(data: dict[str, Any], path: KeyPath, value: Any) -> None:
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _drop(data: dict[str, Any], path: KeyPath) -> None:
    node = data
    for key in path[:-1]:
        node = node[key]
    node.pop(path[-1], None)


def _plain_text(path: KeyPath) -> bool:
    try:
        annotation = resolve_path(path).annotation
    except KeyError:
        return True  # unknown keys are reported by validation, with the raw text
    return str in _flatten(annotation) or annotation is Any


def interpolate(data: dict[str, Any], *, strict: bool,
                where: Any = None) -> tuple[list[Problem], list[Problem]]:
    """Resolve every interpolation in `data` in place. Returns (errors, warnings); `where(path)` locates a key."""
    locate = where or (lambda path: None)
    errors: list[Problem] = []
    warnings: list[Problem] = []
    leaves = list(_leaves(data))
    if not leaves:
        return errors, warnings
    from omegaconf import OmegaConf  # only configs that interpolate pay for the import
    from omegaconf.errors import OmegaConfBaseException

    try:
        tree = OmegaConf.create(data)
    except OmegaConfBaseException as exc:  # a value omegaconf cannot hold (a TOML date, say)
        return [Problem("", f"cannot resolve interpolations: {str(exc).splitlines()[0]}", "error")], warnings
    for path, text in leaves:
        dotted = ".".join(path)
        missing = unset_variables(text)
        if missing and not strict:
            names = ", ".join(missing)
            kept = _plain_text(path)
            warnings.append(Problem(dotted, f"environment variable {names} is not set here: the value {text!r} is "
                                    "resolved when the deployment starts (set it there); "
                                    + ("checked as written" if kept else "checked with the default"),
                                    "warning", locate(path)))
            if not kept:
                _drop(data, path)
            continue
        try:
            value = OmegaConf.select(tree, dotted, throw_on_resolution_failure=True)
        except OmegaConfBaseException as exc:
            why = f"environment variable {', '.join(missing)} is not set" if missing else str(exc).splitlines()[0]
            unset_below = _UNSET_BELOW.search(why)  # a key reference to a value that reads an unset variable
            if unset_below and not strict:
                warnings.append(Problem(dotted, f"{text!r} reads environment variable {unset_below.group(1)}, "
                                        "which is not set here: checked with the default", "warning", locate(path)))
                _drop(data, path)
                continue
            errors.append(Problem(dotted, f"cannot resolve {text!r}: {why}", "error", locate(path)))
            continue
        try:
            _put(data, path, coerce_text(path, value) if isinstance(value, str) else value)
        except KeyError:
            _put(data, path, value)
    return errors, warnings
