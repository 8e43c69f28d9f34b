"""Measured per-GPU tables: JSON data files named `<arch>_<table>.json` (arch = "sm90" for compute capability
9.0), one loader. Each file names the command that regenerates it ("generator") and the machine it was measured
on ("measured_on"); "entries" is the table. An architecture without a file has an empty table: nothing measured
there, so the callers keep their defaults (cuBLAS's own pick, the untuned configs).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

TUNED_DIR = Path(__file__).resolve().parent
HEADER = ("generator", "measured_on", "entries")


def arch_name(capability: tuple[int, int]) -> str:
    return f"sm{capability[0]}{capability[1]}"


def shape_key(n: int, k: int) -> str:
    """A weight shape [N, K] as the files spell it: "NxK"."""
    return f"{n}x{k}"


def parse_shape(key: str) -> tuple[int, int]:
    n, k = key.split("x")
    return int(n), int(k)


def path_for(table: str, arch: str) -> Path:
    return TUNED_DIR / f"{arch}_{table}.json"


@functools.cache
def load(table: str, arch: str) -> dict[str, Any]:
    """The entries of `table` measured on `arch` ({} when no file exists); a file lacking its header is an error
    naming the file."""
    path = path_for(table, arch)
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    missing = [key for key in HEADER if key not in doc]
    if missing:
        raise ValueError(f"{path}: missing {missing}; a tuned table names its generator, machine and entries")
    entries: dict[str, Any] = doc["entries"]
    return entries


def write(table: str, arch: str, generator: str, measured_on: str, entries: dict[str, Any]) -> Path:
    """Write a table (the labs' --emit): the header, then the entries."""
    path = path_for(table, arch)
    path.write_text(dumps({"generator": generator, "measured_on": measured_on, "entries": entries}))
    return path


def dumps(doc: dict[str, Any]) -> str:
    """JSON with one line per entry of a shape (diffs of a re-measured table stay readable)."""
    lines = [f" {json.dumps(key)}: {json.dumps(doc[key])}," for key in HEADER[:-1]]
    shapes = []
    for shape, rows in doc["entries"].items():
        if isinstance(rows, dict):
            inner = [f"   {json.dumps(r)}: {json.dumps(v)}" for r, v in rows.items()]
            shapes.append(f"  {json.dumps(shape)}: {{\n" + ",\n".join(inner) + "\n  }")
        else:
            inner = [f"   {json.dumps(v)}" for v in rows]
            shapes.append(f"  {json.dumps(shape)}: [\n" + ",\n".join(inner) + "\n  ]")
    return "{\n" + "\n".join(lines) + '\n "entries": {\n' + ",\n".join(shapes) + "\n }\n}\n"
