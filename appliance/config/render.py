"""Writing a resolved config back as TOML (for `appliance config show`), optionally with the origin of every
value as a trailing comment. TOML has no null: unset values are written as comments."""
from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel

from appliance.config.schema import ApplianceConfig
from appliance.config.toml_text import toml_key, toml_value

_SECRET_KEYS = ("api.api_key",)


def render_toml(config: ApplianceConfig, provenance: Mapping[str, str] | None = None,
                show_secrets: bool = False) -> str:
    """The config as TOML; with provenance, each line ends with `# <where the value came from>`."""
    lines: list[str] = []
    _section(config, (), lines, provenance, show_secrets)
    return "\n".join(lines).strip() + "\n"


def _section(model: BaseModel, prefix: tuple[str, ...], lines: list[str],
             provenance: Mapping[str, str] | None, show_secrets: bool) -> None:
    nested: list[tuple[str, BaseModel]] = []
    for key in type(model).model_fields:
        value = getattr(model, key)
        path = ".".join(prefix + (key,))
        if isinstance(value, BaseModel):
            nested.append((key, value))
            continue
        dumped = model.model_dump(mode="json", include={key})[key]
        note = ""
        if provenance is not None:
            origins = sorted({v for k, v in provenance.items() if k == path or k.startswith(path + ".")})
            note = f"  # {', '.join(origins) or 'default'}"
        if dumped is None:
            lines.append(f"# {key} is unset{note}")
        elif path in _SECRET_KEYS and not show_secrets:
            lines.append(f'{key} = "***"{note}')
        else:
            lines.append(f"{toml_key(key)} = {toml_value(dumped)}{note}")
    for key, sub in nested:
        lines.append("")
        lines.append(f"[{'.'.join(prefix + (key,))}]")
        _section(sub, prefix + (key,), lines, provenance, show_secrets)
