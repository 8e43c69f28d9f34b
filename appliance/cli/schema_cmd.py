"""`appliance schema`: regenerate schemas/appliance.schema.json and docs/parameters.md from the models."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("schema", help="write the JSON schema and docs/parameters.md")
    p.add_argument("--root", type=Path, default=None, help="repository root (default: this checkout)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is out of date")
    p.add_argument("--stdout", action="store_true", help="print the JSON schema instead of writing files")


def main(args: argparse.Namespace) -> int:
    from appliance.config.docs import REPO_ROOT, generated_files, json_schema_text, write_generated

    root = args.root or REPO_ROOT
    if args.stdout:
        print(json_schema_text(), end="")
        return 0
    if args.check:
        stale = [rel for rel, text in generated_files(root).items()
                 if not (root / rel).exists() or (root / rel).read_text() != text]
        for rel in stale:
            print(f"{rel} is out of date; run `appliance schema`")
        return 1 if stale else 0
    for path in write_generated(root):
        print(f"wrote {path}")
    return 0
