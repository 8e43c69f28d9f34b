"""`appliance serve [MODEL] [flags]`: the familiar launch command line (TokenSpeed/vLLM/SGLang flag names)
turned into an ApplianceConfig through the generated flags."""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from appliance.config.errors import ConfigError, Problem
from appliance.config.flags import add_config_flags, overrides_from_args, unknown_flag_problems


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit; callers want one ConfigError
        raise ConfigError([Problem("", message, where="command line")])


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Positional MODEL, --config FILE, --set and every generated config flag."""
    parser.add_argument("model_positional", nargs="?", metavar="MODEL",
                        help="Model path or repo id (same as --model).")
    parser.add_argument("--config", dest="config_file", metavar="FILE",
                        help="A config file (TOML or YAML) below the flags.")
    add_config_flags(parser)


def serve_parser(prog: str = "appliance serve") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, allow_abbrev=False, description="Serve a model, configured by familiar flags.")
    add_serve_arguments(parser)
    return parser


def config_from_namespace(ns: argparse.Namespace, *, env: Mapping[str, str] | None = None) -> Any:
    """Resolve a namespace made by a parser with add_serve_arguments (or add_config_flags) -> Resolved."""
    from appliance.config.loader import resolve

    flags = overrides_from_args(ns)
    model = getattr(ns, "model_positional", None)
    if model is not None:
        if any(path == ("model", "path") for path, _, _ in flags):
            raise ConfigError([Problem("model.path", "the model is given both positionally and with --model",
                                       where="command line")])
        flags.insert(0, (("model", "path"), model, "argument MODEL"))
    return resolve(getattr(ns, "config_file", None), flags=flags, dotlist=getattr(ns, "config_set", []), env=env)


def parse_serve_args(argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> Any:
    """argv (without the `serve` word) -> ApplianceConfig; unknown flags are errors with a suggestion."""
    ns, unknown = serve_parser().parse_known_args(list(argv))
    if unknown:
        raise ConfigError(unknown_flag_problems(unknown))
    return config_from_namespace(ns, env=env).config
