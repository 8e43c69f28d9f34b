"""`appliance config show [FILE] [--set k=v] [flags] [--explain]`: print the resolved config as TOML."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from appliance.config.errors import ConfigError


def add_parser(subparsers: Any) -> None:
    from appliance.config.flags import add_config_flags

    p = subparsers.add_parser("config", help="show the resolved config and where each value came from")
    actions = p.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print the resolved config as TOML", allow_abbrev=False)
    show.add_argument("file", nargs="?", metavar="FILE", help="a TOML or YAML config file")
    show.add_argument("--explain", action="store_true",
                      help="add where each value came from (default, file:line, env variable, flag)")
    show.add_argument("--show-secrets", action="store_true", help="print api_key instead of ***")
    add_config_flags(show)


def main(args: argparse.Namespace) -> int:
    from appliance.config.flags import overrides_from_args
    from appliance.config.loader import resolve
    from appliance.config.render import render_toml

    try:
        resolved = resolve(args.file, flags=overrides_from_args(args), dotlist=args.config_set)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem.format(), file=sys.stderr)
        return 1
    sys.stdout.write(render_toml(resolved.config, resolved.provenance if args.explain else None,
                                 show_secrets=args.show_secrets))
    for warning in resolved.warnings:
        print(warning.format(), file=sys.stderr)
    return 0
