"""The declared layer order of the packages, checked on every import in the tree (lazy imports inside functions
included; imports under `if TYPE_CHECKING:` are type-only and exempt): a package imports only packages of its own
tier or below, config imports none of them, no two packages import each other, no modules import each other at
import time, and the kernel registry imports no backend. Every package of appliance/ must be placed here, so a new
one is placed on purpose.

    python -m pytest -q tests/test_layering.py
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import appliance

ROOT = Path(appliance.__file__).parent

# top to bottom (docs/architecture.md); a package may import its own tier and the tiers below it
TIERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "cli", "entrypoints", "bench"),  # the CLI, the offline LLM, `appliance bench`, the package exports
    ("runtime", "translate"),  # processes and sockets; launch-command translation (cli only)
    ("server", "observability"),  # HTTP front end; metrics, KV events, request log
    ("executor",),  # the model runner (torch): runs the engine's step plans
    ("engine",),  # the scheduler, pure Python: never the executor
    ("models", "structured", "tokenization"),
    ("layers",),
    ("kernels", "fault_injection"),  # fault_injection: APPLIANCE_FAULT_INJECTION, imports nothing of the package
)
CONFIG = "config"  # read by every tier, imports none of them
DATA = ("assets", "recipes")  # files, not code

Graph = dict[str, set[str]]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("appliance",) + path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str, modules: set[str], lazy: bool = True) -> Iterator[str]:
    """The appliance modules `path` imports at run time (lazy: also inside functions). `from pkg import sub` names
    the submodule (Python imports pkg first, but a package importing its own submodules is no cycle of interest)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def walk(node: ast.AST) -> Iterator[ast.AST]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    yield stmt
                    yield from walk(stmt)
                continue
            if not lazy and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            yield child
            yield from walk(child)

    for node in walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("appliance"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("appliance"):
                continue
            subs = [f"{base}.{a.name}" for a in node.names]
            if all(s in modules for s in subs):
                yield from subs
            else:
                yield base
                yield from (s for s in subs if s in modules)


def import_graph(lazy: bool = True) -> Graph:
    """Module -> the modules it imports; lazy: with the imports inside functions (run when called)."""
    modules = _modules()
    names = set(modules)
    return {name: {m for m in _imports(path, name, names, lazy) if m in names and m != name}
            for name, path in modules.items()}


def package_graph(graph: Graph) -> Graph:
    out: Graph = {}
    for module, targets in graph.items():
        out.setdefault(package_of(module), set()).update(package_of(t) for t in targets)
    return {p: targets - {p} for p, targets in out.items()}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def tier_of(package: str) -> int | None:
    return next((i for i, tier in enumerate(TIERS) if package in tier), None)


def layer_violations(graph: Graph) -> list[str]:
    bad = []
    for module, targets in graph.items():
        src = package_of(module)
        for target in sorted(targets):
            dst = package_of(target)
            if dst == src:
                continue
            if src == CONFIG:
                bad.append(f"{module} -> {target}: config imports none of the other packages")
            elif dst != CONFIG and (tier_of(dst) is None or tier_of(src) is None or tier_of(dst) < tier_of(src)):
                bad.append(f"{module} ({src}) -> {target} ({dst}): an import up the declared order")
    return bad


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_package_is_placed() -> None:
    placed = {p for tier in TIERS for p in tier} | {CONFIG, *DATA}
    present = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("__")}
    present |= {p.stem for p in ROOT.glob("*.py")}
    assert present - placed == set(), "place the new package in TIERS"
    assert {"cli", "runtime", "server", "engine", "executor", "models", "layers", "kernels", "config"} <= present


def test_the_tree_follows_the_layer_order() -> None:
    graph = import_graph()
    assert len(graph) > 200 and sum(map(len, graph.values())) > 500  # the scan really sees the tree
    assert layer_violations(graph) == []


def test_no_import_cycles() -> None:
    """No two packages import each other, lazily or not; no modules import each other at import time (a cycle
    through an import inside a function, within one package, is how a module reaches its own helper lazily)."""
    assert cycles(package_graph(import_graph())) == []
    assert cycles(import_graph(lazy=False)) == []


def test_the_kernel_registry_is_a_leaf() -> None:
    """kernels/registry.py imports no backend (it names their modules): backends import it, never the reverse."""
    assert import_graph()["appliance.kernels.registry"] == set()


@pytest.mark.parametrize(("module", "target"), [
    ("appliance.kernels.registry", "appliance.layers.linear"),  # kernels reaching up into layers
    ("appliance.engine.scheduler", "appliance.executor.model_runner"),  # the pure-Python engine importing torch code
    ("appliance.config.schema", "appliance.engine.config"),  # config imports none of them
    ("appliance.executor.warmup", "appliance.server.app"),  # the workers never import the HTTP layer
])
def test_a_planted_import_is_caught(module: str, target: str) -> None:
    graph = import_graph()
    planted = layer_violations({**graph, module: graph[module] | {target}})
    assert len(planted) == 1 and planted[0].startswith(f"{module} ") and target in planted[0]


def test_a_planted_cycle_is_caught() -> None:
    graph = import_graph(lazy=False)
    assert "appliance.kernels.tuned" in graph["appliance.kernels.cublaslt"]
    planted = {**graph, "appliance.kernels.tuned": graph["appliance.kernels.tuned"] | {"appliance.kernels.cublaslt"}}
    assert ["appliance.kernels.cublaslt", "appliance.kernels.tuned"] in cycles(planted)
    # engine and executor are adjacent tiers: an engine module importing the executor is caught as a cycle too
    full = import_graph()
    planted = {**full, "appliance.engine.step": full["appliance.engine.step"] | {"appliance.executor.inflight"}}
    assert ["engine", "executor"] in cycles(package_graph(planted))


def test_type_checking_imports_are_exempt_and_lazy_ones_count(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from appliance.server import app\n"
                   "def f():\n    from appliance.layers import linear\n")
    names = {"appliance.server.app", "appliance.layers.linear", "appliance.layers", "appliance.server"}
    assert list(_imports(src, "appliance.kernels.mod", names)) == ["appliance.layers.linear"]
    assert list(_imports(src, "appliance.kernels.mod", names, lazy=False)) == []


def test_the_thinking_budget_is_one_class_for_both_layers() -> None:
    from appliance.executor.logits_processors import thinking_budget_from_dict
    from appliance.server.parsers import ThinkingBudget as ServerSide
    from appliance.structured.thinking_budget import ThinkingBudget

    assert ServerSide is ThinkingBudget
    budget = thinking_budget_from_dict({"budget": 1, "end_token_ids": [9], "start_tag_ids": [7]}, [1, 7])
    assert isinstance(budget, ThinkingBudget) and budget.in_reasoning
