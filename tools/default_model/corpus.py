"""The training corpus: the stdlib's .py sources and pydoc topics, plus chats derived from them. The validation
split is by a hash of each file's path, so it never depends on ordering or on the machine."""
from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tools.default_model.chat_format import render_chat

MAX_FILE_BYTES = 400_000  # larger stdlib files are generated tables (unicode data, encodings), not prose or code
VAL_PER_MILLE = 40


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    val: list[str]
    stats: dict[str, int | str]


def is_validation(key: str) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < VAL_PER_MILLE


def chat_examples_from_source(module: str, source: str) -> list[str]:
    """Function-writing requests and docstring questions from a module's top-level functions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out: list[str] = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        segment = ast.get_source_segment(source, node)
        if not doc or not segment or segment.count("\n") > 40:
            continue
        summary = inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ").strip()
        args = ast.unparse(node.args)
        out.append(render_chat(f"Write a Python function `{node.name}({args})`: {summary}",
                               f"```python\n{textwrap.dedent(segment)}\n```"))
        out.append(render_chat(f"What does `{module}.{node.name}` do?", inspect.cleandoc(doc)))
    return out


def stdlib_files(root: Path, max_files: int | None) -> list[tuple[Path, str]]:
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts)
                   and p.name != "topics.py" and p.stat().st_size <= MAX_FILE_BYTES)
    return [(p, p.relative_to(root).as_posix()) for p in files[:max_files]]


def collect_corpus(max_files: int | None, extra_roots: list[Path]) -> Corpus:
    """The running Python's stdlib, then any extra stdlib trees (other versions); exact duplicates once."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), *extra_roots]
    files = [f for root in roots for f in stdlib_files(root, max_files)]
    train: list[str] = []
    val: list[str] = []
    seen: set[bytes] = set()
    n_chat = n_bytes = n_skipped = n_dup = 0
    for path, rel in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            n_skipped += 1
            continue
        digest = hashlib.sha256(source.encode()).digest()
        if digest in seen:
            n_dup += 1
            continue
        seen.add(digest)
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        chats = chat_examples_from_source(module, source)
        bucket = val if is_validation(rel) else train
        bucket.append(source)
        bucket.extend(chats)
        n_chat += len(chats)
        n_bytes += len(source.encode())
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        bucket = val if is_validation("topic:" + name) else train
        bucket.append(text)
        bucket.append(render_chat(f"Explain the Python topic '{name}'.", text[:3000]))
        n_chat += 1
    stats = {"stdlib": " ".join(map(str, roots)), "python": sys.version.split()[0],
             "files": len(files) - n_skipped - n_dup, "skipped_undecodable": n_skipped, "duplicates": n_dup, "source_bytes": n_bytes, "pydoc_topics": len(topics),
             "chat_examples": n_chat, "train_docs": len(train), "val_docs": len(val)}
    return Corpus(train, val, stats)
