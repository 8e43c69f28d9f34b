"""`appliance validate FILE... | -`: schema and cross-field checks; exit 0 when every file is valid.

One line per problem (`file:line: [warning: ]key.path: message`), or a JSON report with --json. Settings this
build cannot honour yet are warnings (errors with --strict). The environment is not read: a file is judged alone
(`APPLIANCE_*` overrides are ignored, and a `${oc.env:VAR}` value whose variable is unset is a warning: it is
resolved when the deployment starts).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from appliance.config.errors import ConfigError, Problem


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("validate", help="check config files (exit 0 when all are valid)",
                              description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", metavar="FILE", help="TOML or YAML config files; '-' reads standard input")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of lines")
    p.add_argument("--strict", action="store_true", help="treat warnings (unsupported settings) as errors")


def validate_one(name: str) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) of one file; '-' reads standard input."""
    from appliance.config.loader import resolve

    try:
        if name == "-":
            resolved = resolve("<stdin>", text=sys.stdin.read(), env={}, run_env=False)
        else:
            resolved = resolve(name, env={}, run_env=False)
    except ConfigError as exc:
        return [_located(p, name) for p in exc.problems], []
    return [], [_located(p, name) for p in resolved.warnings]


def _located(problem: Problem, name: str) -> Problem:
    if problem.where:
        return problem
    return Problem(problem.path, problem.message, problem.severity, "<stdin>" if name == "-" else name)


def main(args: argparse.Namespace) -> int:
    report: list[dict[str, Any]] = []
    failed = False
    for name in args.files:
        errors, warnings = validate_one(name)
        if args.strict:
            errors, warnings = errors + [Problem(w.path, w.message, "error", w.where) for w in warnings], []
        failed |= bool(errors)
        report.append({"file": name, "valid": not errors,
                       "problems": [p.to_json() for p in errors + warnings]})
        if not args.json:
            for p in errors + warnings:
                print(p.format())
            print(f"{name}: {'INVALID' if errors else 'ok'} ({len(errors)} errors, {len(warnings)} warnings)",
                  file=sys.stderr)
    if args.json:
        print(json.dumps({"valid": not failed, "files": report}, indent=2))
    return 1 if failed else 0
