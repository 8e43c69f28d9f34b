"""`appliance` command: subcommands dispatched through one table; each module is imported only when needed so
one broken subcommand cannot break the others."""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help). Each module exposes add_parser(subparsers) and main(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("appliance.cli.run_cmd", "serve what a config file describes"),
    "serve": ("appliance.cli.run_cmd", "serve a model configured by familiar flags"),
    "validate": ("appliance.cli.validate_cmd", "check config files (exit 0 when all are valid)"),
    "config": ("appliance.cli.config_cmd", "show the resolved config and where each value came from"),
    "schema": ("appliance.cli.schema_cmd", "write the JSON schema and docs/parameters.md"),
    "translate": ("appliance.cli.translate_cmd", "turn a vLLM/SGLang/TokenSpeed/Atlas command into TOML"),
    "bench": ("appliance.cli.bench_cmd", "benchmark the offline engine or a running server"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, just that subcommand's module is imported (the others stay stubs)."""
    parser = argparse.ArgumentParser(prog="appliance", description="A declarative LLM serving appliance.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if only is not None:
        importlib.import_module(COMMANDS[only][0]).add_parser(sub)
        if only not in sub.choices:
            raise ImportError(f"{COMMANDS[only][0]}.add_parser did not add the {only!r} subcommand")
    for name, (_, help_text) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = args_list[0] if args_list and args_list[0] in COMMANDS else None
    if command is None:
        parser = build_parser()
        if args_list and not args_list[0].startswith("-"):
            parser.error(f"unknown command {args_list[0]!r}; choose from {', '.join(COMMANDS)}")
        parser.print_help()
        return 0 if args_list[:1] in (["-h"], ["--help"]) else 2
    try:
        parser = build_parser(only=command)
    except ImportError as exc:
        print(f"appliance {command}: not available in this build ({exc})", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(args_list)
    if unknown:
        _reject_unknown(parser, args, unknown)
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(args) or 0)


def _reject_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> None:
    """Exit 2; for commands taking config flags, each unknown flag gets a 'did you mean' from the schema."""
    from appliance.config.flags import OVERRIDES_DEST

    if not hasattr(args, OVERRIDES_DEST):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from appliance.config.flags import unknown_flag_problems

    for problem in unknown_flag_problems(unknown):
        print(f"appliance {args.command}: {problem.format()}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
