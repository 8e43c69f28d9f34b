"""`appliance run [FILE] [--set k=v ...]` and `appliance serve MODEL [flags]`: resolve the config, refuse what
this build cannot honour, then hand it to the supervisor (which blocks until shutdown and gives the exit code)."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    run = subparsers.add_parser("run", help="serve what a config file describes",
                                description="Serve what a config file describes (the default recipe without one).")
    run.add_argument("file", nargs="?", metavar="FILE", help="TOML or YAML config file")
    run.add_argument("--set", dest="dotlist", action="append", default=[], metavar="KEY=VALUE",
                     help="override one key, e.g. --set api.port=9000 (repeatable)")
    from appliance.cli.serve_flags import add_serve_arguments

    serve = subparsers.add_parser("serve", help="serve a model configured by familiar flags", allow_abbrev=False,
                                  description="Serve a model; takes vLLM / SGLang / TokenSpeed flag names.")
    add_serve_arguments(serve)


def resolve_config(args: argparse.Namespace) -> Any:
    from appliance import config as cfg

    if args.command == "serve":
        from appliance.cli.serve_flags import config_from_namespace

        return config_from_namespace(args).config
    # no file: the embedded default recipe (recipes/default.toml), as its header promises
    return cfg.build_config(args.file or cfg.default_recipe_path(), dotlist=args.dotlist)


def main(args: argparse.Namespace) -> int:
    from appliance.config import ConfigError, check_supported

    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"appliance {args.command}: {exc}", file=sys.stderr)
        return 2
    unsupported = check_supported(config)
    if unsupported:
        print(f"appliance {args.command}: this build cannot honour:\n  " + "\n  ".join(unsupported), file=sys.stderr)
        return 2
    logging.basicConfig(level=config.observability.log_level.upper(),
                        format="%(asctime)s supervisor %(levelname)s %(message)s")
    from appliance.runtime.supervisor import Supervisor

    return Supervisor(config).run()
