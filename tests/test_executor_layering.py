"""The executor runs in the workers and must not depend on the HTTP layer (appliance.server)."""
from __future__ import annotations

import ast
from pathlib import Path

import appliance.executor

EXECUTOR = Path(appliance.executor.__file__).parent


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_no_executor_module_imports_the_server_layer() -> None:
    files = sorted(EXECUTOR.rglob("*.py"))
    assert len(files) > 5  # the scan really sees the package
    offenders = [f"{p.relative_to(EXECUTOR)}: {m}" for p in files for m in imported_modules(p)
                 if m == "appliance.server" or m.startswith("appliance.server.")]
    assert offenders == []


def test_the_thinking_budget_is_one_class_for_both_layers() -> None:
    from appliance.executor.logits_processors import thinking_budget_from_dict
    from appliance.server.parsers import ThinkingBudget as ServerSide
    from appliance.structured.thinking_budget import ThinkingBudget

    assert ServerSide is ThinkingBudget
    budget = thinking_budget_from_dict({"budget": 1, "end_token_ids": [9], "start_tag_ids": [7]}, [1, 7])
    assert isinstance(budget, ThinkingBudget) and budget.in_reasoning
