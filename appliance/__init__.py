"""appliance: a declarative, config-driven LLM serving appliance.

`from appliance import LLM, SamplingParams` is the offline API (imported lazily: `import appliance` stays cheap
and torch-free for the config and CLI layers).
"""
from __future__ import annotations

from typing import Any

from appliance.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from appliance.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'appliance' has no attribute {name!r}")
