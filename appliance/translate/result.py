"""What translating one command produces: settings with their provenance, values left for the user to fill in,
and findings (warnings: something was not carried over; notes: something changed meaning or needs no setting)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Setting:
    path: str  # "section.key" (dotted deeper for nested keys)
    value: Any
    source: str  # the flag as written, e.g. "--tensor-parallel-size 8"
    note: str = ""  # what changed against the source engine (near-equivalents)


@dataclass(frozen=True)
class Pending:
    """A value that could not be decided here: an unresolved `$VAR` or a placeholder. Emitted commented out."""

    path: str
    raw: str
    source: str
    reason: str


@dataclass(frozen=True)
class Use:
    """One setting the source command made (a flag, a config-file key, an engine environment variable)."""

    written: str  # the option as written: "--tp"
    display: str  # with its value: "--tp 8"
    implied: bool  # needs no setting here: the appliance behaves that way (or the value is its default)


@dataclass(frozen=True)
class Finding:
    level: Literal["warning", "note"]
    subject: str  # the flag / variable / wrapper it is about
    message: str
    unmapped: bool = False  # counts for --strict: a setting that has no equivalent here


@dataclass
class Translation:
    engine: str
    title: str
    line: int
    command: list[str]
    settings: dict[str, Setting] = field(default_factory=dict)
    pending: list[Pending] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    context: list[str] = field(default_factory=list)  # docker / environment facts worth keeping as comments
    problems: list[str] = field(default_factory=list)  # validation problems of the result
    unsupported: list[str] = field(default_factory=list)  # valid, but not honoured by this build yet
    uses: list[Use] = field(default_factory=list)  # every setting the source command made, for coverage
    implied_sources: set[str] = field(default_factory=set)  # uses a rule found to need no setting here

    def set(self, path: str, value: Any, source: str, note: str = "") -> None:
        self.settings.pop(path, None)  # re-insert: a later source (command line over --config) wins
        self.settings[path] = Setting(path, value, source, note)
        self.pending = [p for p in self.pending if p.path != path]

    def get(self, path: str, default: Any = None) -> Any:
        s = self.settings.get(path)
        return default if s is None else s.value

    def warn(self, subject: str, message: str, unmapped: bool = False) -> None:
        self.findings.append(Finding("warning", subject, message, unmapped))

    def note(self, subject: str, message: str) -> None:
        self.findings.append(Finding("note", subject, message))

    def implied(self, subject: str, message: str) -> None:
        """A note about a use that needs no setting: the appliance behaves that way already."""
        self.note(subject, message)
        self.implied_sources.add(subject)

    @property
    def unmapped(self) -> list[Finding]:
        return [f for f in self.findings if f.unmapped]

    def document(self) -> dict[str, Any]:
        """The settings as the nested dict a TOML file would hold."""
        out: dict[str, Any] = {}
        for s in self.settings.values():
            node = out
            *parents, leaf = s.path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = s.value
        return out
