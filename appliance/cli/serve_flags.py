"""For subcommands that take config flags (run, serve, bench): the generated flags and how to resolve them.

    add_serve_arguments(parser)          # positional MODEL, --config FILE, --set, every schema flag
    add_config_flags(parser)             # --set and every schema flag only (no MODEL / --config)
    resolved = config_from_namespace(args)   # -> Resolved(config, provenance, warnings); raises ConfigError
"""
from __future__ import annotations

from appliance.config.flags import add_config_flags, overrides_from_args
from appliance.config.serve_args import add_serve_arguments, config_from_namespace, parse_serve_args

__all__ = ["add_config_flags", "add_serve_arguments", "config_from_namespace", "overrides_from_args",
           "parse_serve_args"]
