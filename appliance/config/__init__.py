"""The appliance config: schema, layered loading, overrides, provenance and checks.

Public API: ApplianceConfig (and its sections), build_config, load_config, parse_serve_args, check_supported,
UNSUPPORTED, ConfigError, Problem.
"""
from __future__ import annotations

from appliance.config.errors import ConfigError, Problem
from appliance.config.schema import (
    ApiCaps,
    ApiSection,
    ApplianceConfig,
    BackendsSection,
    CacheSection,
    KvEventsConfig,
    ModelSection,
    ObservabilitySection,
    ParallelismSection,
    PrecisionSection,
    SamplingSection,
    SchedulerSection,
    SpeculativeSection,
)
from appliance.config.checks import resolve_model_path

__all__ = [
    "ApiCaps", "ApiSection", "ApplianceConfig", "BackendsSection", "CacheSection", "ConfigError",
    "KvEventsConfig", "ModelSection", "ObservabilitySection", "ParallelismSection", "PrecisionSection", "Problem",
    "SamplingSection", "SchedulerSection", "SpeculativeSection", "UNSUPPORTED", "build_config", "check_supported",
    "default_recipe_path", "load_config", "parse_serve_args", "recipe_path", "resolve", "resolve_model_path",
]


def __getattr__(name: str):  # loading machinery imported on first use, the schema stays cheap to import
    if name in ("build_config", "load_config", "resolve"):
        from appliance.config import loader

        return getattr(loader, name)
    if name == "parse_serve_args":
        from appliance.config.serve_args import parse_serve_args

        return parse_serve_args
    if name in ("recipe_path", "default_recipe_path"):
        from appliance.config import recipes

        return getattr(recipes, name)
    if name in ("UNSUPPORTED", "check_supported"):
        from appliance.config import support

        return getattr(support, name)
    raise AttributeError(name)
