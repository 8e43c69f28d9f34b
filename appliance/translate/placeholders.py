"""Words the translator cannot decide (shell variables, `<placeholders>`) as `${oc.env:VAR}` interpolation.

`--dist-init-addr $MASTER_IP:$PORT` becomes `dist_init_addr = "${oc.env:MASTER_IP}:${oc.env:PORT}"`, which the
config loader resolves from the environment the appliance starts in; `${TP:-8}` keeps its default
(`${oc.env:TP,8}`); a docs placeholder `<prefill_http_port_rank0>` names a variable the same way
(`${oc.env:PREFILL_HTTP_PORT_RANK0}`). Command substitutions (`$(hostname -I)`) and free-text placeholders
(`/path/to/model`) cannot be read from one variable: they are kept verbatim in a text field, or left pending.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from appliance.config.interpolation import env_ref
from appliance.translate.shell import restore

_SHELL_REF = re.compile(r"\$\{([A-Za-z_]\w*)(?::?-([^}]*))?\}|\$([A-Za-z_]\w*)")
_OTHER_REF = re.compile(r"\$(\([^)]*\)+|\{[^}]*\}|[0-9@*#?$!])")
_ANGLE = re.compile(r"<([A-Za-z_][^<>\s]*)>")
_MUSTACHE = re.compile(r"\{\{\s*([A-Za-z_][\w.-]*)\s*\}\}")
FREE_TEXT = re.compile(r"/path/to/|^YOUR[_-][A-Z0-9_-]+$|^\.\.\.$|^xxx+$", re.I)


@dataclass(frozen=True)
class Interpolated:
    text: str  # the value with `${oc.env:VAR}` references
    variables: tuple[str, ...]  # the environment variables it reads


def _var_name(placeholder: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", placeholder).strip("_").upper() or "VALUE"


def _default(value: str) -> str:
    return "," + value.replace("\\", "\\\\").replace(",", "\\,").replace("}", "\\}")


def interpolated(word: str) -> Interpolated | None:
    """The word with its shell references and named placeholders as interpolation; None when something in it
    (a command substitution, a positional parameter) has no such form, or there is nothing to interpolate."""
    text = restore(word)
    names: list[str] = []

    def shell(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        names.append(name)
        return env_ref(name)[:-1] + (_default(m.group(2)) if m.group(2) is not None else "") + "}"

    def named(m: re.Match[str]) -> str:
        names.append(_var_name(m.group(1)))
        return env_ref(names[-1])

    out = _SHELL_REF.sub(shell, text)
    if _OTHER_REF.search(out.replace("${oc.env:", "")):
        return None
    out = _MUSTACHE.sub(named, _ANGLE.sub(named, out))
    return Interpolated(out, tuple(dict.fromkeys(names))) if names else None


_INTERP = re.compile(r"\$\{oc\.env:([A-Za-z_]\w*)(?:,((?:\\.|[^}\\])*))?\}")


def to_shell(text: str) -> str:
    """`${oc.env:VAR}` / `${oc.env:VAR,default}` back to the shell's `${VAR}` / `${VAR:-default}`."""
    def sub(m: re.Match[str]) -> str:
        default = m.group(2)
        return "${" + m.group(1) + ("" if default is None else ":-" + re.sub(r"\\(.)", r"\1", default)) + "}"

    return _INTERP.sub(sub, text)
