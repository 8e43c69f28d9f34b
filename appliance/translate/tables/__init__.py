"""Per-engine flag tables (data). `TABLES[name]` is the EngineTable of one source engine."""
from __future__ import annotations

from appliance.translate.spec import EngineTable
from appliance.translate.tables import atlas, sglang, tokenspeed, vllm

TABLES: dict[str, EngineTable] = {t.name: t for t in (vllm.TABLE, sglang.TABLE, tokenspeed.TABLE, atlas.TABLE)}

__all__ = ["TABLES"]
