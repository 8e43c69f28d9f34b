"""Config problems and the error that carries them: every problem names its key path and, when it came from
a file, the file and line."""
from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong (or not honoured yet) in a config."""

    path: str  # dotted key path, "" for the whole document
    message: str
    severity: Severity = "error"
    where: str | None = None  # "file:line", "env APPLIANCE_X__Y", "flag --tp" ...

    def format(self) -> str:
        loc = f"{self.where}: " if self.where else ""
        key = f"{self.path}: " if self.path else ""
        tag = "warning: " if self.severity == "warning" else ""
        return f"{loc}{tag}{key}{self.message}"

    def to_json(self) -> dict[str, str | None]:
        return {"severity": self.severity, "path": self.path, "where": self.where, "message": self.message}


class ConfigError(ValueError):
    """Raised when a config cannot be built; holds every problem found, not just the first."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = tuple(problems)
        super().__init__("invalid configuration:\n" + "\n".join("  " + p.format() for p in self.problems))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
