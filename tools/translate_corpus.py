"""Measure `appliance translate` on a corpus of launch commands (default: tests/fixtures/translate/corpus).

For every script: does it translate (no exit-2 error), does each resulting config validate (`appliance validate`:
warnings allowed, errors not), and how many of the settings the source commands make are carried exactly
(appliance/translate/coverage.py: landed in the config, or need none here) versus left pending or only noted.

    python -m tools.translate_corpus [DIR] [--list]     # --list: every setting that is not exact
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from appliance.config.errors import ConfigError
from appliance.config.loader import resolve
from appliance.translate.coverage import outcome
from appliance.translate.emit import to_toml
from appliance.translate.translator import TranslateError, translate_text

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "translate" / "corpus"


@dataclass
class Report:
    scripts: int = 0
    translated: int = 0
    commands: int = 0
    valid: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # scripts that do not translate, configs that do not validate
    inexact: list[str] = field(default_factory=list)  # "file: --flag value: pending|noted"

    @property
    def exact_share(self) -> float:
        total = sum(self.outcomes.values())
        return self.outcomes["exact"] / total if total else 1.0

    def summary(self) -> str:
        total = sum(self.outcomes.values())
        return (f"{self.translated}/{self.scripts} scripts translate; {self.valid}/{self.commands} commands "
                f"validate; {self.outcomes['exact']}/{total} settings exact ({100 * self.exact_share:.1f}%), "
                f"{self.outcomes['pending']} pending, {self.outcomes['noted']} noted")


def measure(directory: Path = CORPUS) -> Report:
    report = Report()
    for path in sorted(directory.glob("*.sh")):
        report.scripts += 1
        try:
            result = translate_text(path.read_text(), path.parent)
        except TranslateError as exc:
            report.failures.append(f"{path.name}: does not translate: {exc}")
            continue
        report.translated += 1
        for tr in result.translations:
            report.commands += 1
            try:
                resolve(f"{path.stem}.toml", text=to_toml(tr, path.name), env={}, run_env=False)
                report.valid += 1
            except ConfigError as exc:
                report.failures.append(f"{path.name}:{tr.line}: does not validate: "
                                       + "; ".join(p.format() for p in exc.problems))
            for use in tr.uses:
                how = outcome(tr, use)
                report.outcomes[how] += 1
                if how != "exact":
                    report.inexact.append(f"{path.name}:{tr.line}: {use.display}: {how}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path, default=CORPUS)
    parser.add_argument("--list", action="store_true", help="print every setting that is not carried exactly")
    args = parser.parse_args(argv)
    report = measure(args.directory)
    for line in report.failures + (report.inexact if args.list else []):
        print(line)
    print(report.summary())
    return 0 if report.translated == report.scripts and report.valid == report.commands else 1


if __name__ == "__main__":
    sys.exit(main())
