"""The tree speaks of the product alone: code, comments, schema text, docs, tests and tools state facts and the
commands that reproduce them, never how the project was built (work sessions, issue numbers, the nth run, the
machines it was measured on by their lending names, paths outside the repository)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ORDINALS = ("third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
             "fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\\w+|\\d+(?:st|nd|rd|th)")
PATTERNS: dict[str, re.Pattern[str]] = {
    "work session": re.compile(r"\bsessions? \d+|\b(?:this|next|device|that) session\b", re.I),
    "issue number": re.compile(r"\bissues? #?\d+", re.I),
    "the nth run": re.compile(rf"\b(?:{_ORDINALS}) (?:benchmark )?run\b", re.I),
    "the box": re.compile(r"\b(?:the|a|GPU|H100|H200|CI|fresh|this|that|development|2-core) box\b", re.I),
    "device call": re.compile(r"\bdevice (?:call|tool)s?\b", re.I),
    "machine kind": re.compile(r"\bnvidia-h\d00(?:-x\d)?\b", re.I),
    "seeds' format": re.compile(r"\bseeds'? (?:wire )?format\b", re.I),
    "path outside the repository": re.compile(r"\.\./shared\b|/work/(?:shared|main|wt)\b|\bshared/notes\b"),
}
SKIP_SUFFIXES = (".json", ".safetensors", ".png", ".jpg", ".whl", ".gz", ".xz")  # data, not prose


def findings(text: str, where: str) -> list[str]:
    """'where:line: what' for every line of text that matches a pattern."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in PATTERNS.items():
            if pattern.search(line):
                out.append(f"{where}:{n}: {what}: {line.strip()[:120]}")
    return out


def tracked_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / n for n in names.decode().split("\0") if n and not n.endswith(SKIP_SUFFIXES)]


def test_the_tree_holds_no_process_vocabulary() -> None:
    found = []
    for path in tracked_files():
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += findings(text, str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


def test_a_planted_line_is_found() -> None:
    planted = {
        "work session": "# measured in session 13 on the H100",
        "issue number": '"""The GPU-speed benchmark of issue 6."""',
        "the nth run": "(docs/benchmarks.md, the eighteenth run)",
        "the box": "no real tokenizer is on the GPU box",
        "device call": "each line one ~10-minute device call",
        "machine kind": "Device: NVIDIA H100 80GB HBM3 (nvidia-h100-x1)",
        "seeds' format": "published over ZMQ in the seeds' wire format",
        "path outside the repository": "see ../shared/notes/gpu-box.md",
    }
    for what, line in planted.items():
        assert [f for f in findings(line, "x") if f": {what}:" in f], (what, line)
    fine = ["the first run of a process pays its compiles", "a session-scoped pytest fixture",
            "start_new_session=True", "a text box", "issues a warning"]
    assert findings("\n".join(fine), "x") == []


_SCRIPT_PATH = re.compile(r"(?<![\w/.])((?:tools|benchmarks)/[\w/.-]*\w\.(?:py|sh))")


def test_scripts_named_in_the_tree_exist() -> None:
    """A tool or suite the tree points a reader at exists: deleted scripts leave no references."""
    missing = []
    for path in tracked_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in _SCRIPT_PATH.finditer(line):
                name = m.group(1)
                if not any(part.isupper() for part in re.split(r"[/.]", name)) and not (ROOT / name).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert not missing, "\n".join(missing)
