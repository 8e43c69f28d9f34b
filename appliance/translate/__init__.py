"""Launch commands of other engines <-> appliance config.

`translate_text(script) -> ScriptResult` (one Translation per engine command), `to_toml(translation)` and
`to_command(document, "vllm" | "sglang")`. The per-engine flag tables are data in `appliance.translate.tables`.
"""
from __future__ import annotations

from appliance.translate.emit import to_toml
from appliance.translate.reverse import to_command
from appliance.translate.translator import ScriptResult, TranslateError, translate_text

__all__ = ["ScriptResult", "TranslateError", "to_command", "to_toml", "translate_text"]
