"""tools/train_default_model.py: the pieces whose contracts the shipped model relies on, and a CPU smoke run."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOOL_PATH = Path(__file__).resolve().parents[1] / "tools" / "train_default_model.py"


@pytest.fixture(scope="module")
def tool() -> Any:
    spec = importlib.util.spec_from_file_location("train_default_model", TOOL_PATH)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up there
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_training_chats_match_the_shipped_chat_template(tool: Any) -> None:
    """The model learnt chat from render_chat(); the server renders tokenizer_config's template: they must agree."""
    import jinja2

    import appliance

    config = json.loads((Path(appliance.__file__).resolve().parent / "assets" / "default_model" /
                         "tokenizer_config.json").read_text())
    assert config["chat_template"] == tool.CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Q?\nmore"}, {"role": "assistant", "content": "```python\nx = 1\n```"}]
    rendered = jinja2.Template(tool.CHAT_TEMPLATE).render(messages=messages, bos_token=tool.BOS,
                                                          add_generation_prompt=False)
    assert rendered == tool.BOS + tool.render_chat("Q?\nmore", "```python\nx = 1\n```")


def test_validation_split_is_a_stable_few_percent(tool: Any) -> None:
    keys = [f"pkg/module_{i}.py" for i in range(4000)]
    held = [k for k in keys if tool.is_validation(k)]
    assert 0.02 < len(held) / len(keys) < 0.06
    assert held == [k for k in keys if tool.is_validation(k)]


@pytest.mark.parametrize(("text", "expected"), [
    ("def f(n):\n    return n\n\nclass A:\n    pass", "def f(n):\n    return n\n"),
    ("def f(n):\n    x = 1\n\n    return x\ny = 2", "def f(n):\n    x = 1\n\n    return x"),
    ("def f(n):\n    return n\n    if n", "def f(n):\n    return n"),  # never dedents: drop the last line
])
def test_first_block_cuts_where_the_function_ends(tool: Any, text: str, expected: str) -> None:
    assert tool.first_block(text) == expected


def test_chat_examples_from_source(tool: Any) -> None:
    source = 'def add(a, b=1):\n    """Add two numbers.\n\n    More text."""\n    return a + b\n\n' \
             'def _private():\n    """Hidden."""\n'
    chats = tool.chat_examples_from_source("mod", source)
    assert len(chats) == 2
    assert "`add(a, b=1)`: Add two numbers." in chats[0] and "return a + b" in chats[0]
    assert "`mod.add`" in chats[1] and "More text." in chats[1]


def test_cpu_smoke_run_writes_a_loadable_hf_layout(tool: Any, tmp_path: Path) -> None:
    out = tmp_path / "dm"
    tool.main(["--out", str(out), "--device", "cpu", "--tiny", "--max-steps", "2", "--max-files", "3",
               "--parse-samples", "1", "--max-file-mb", "0.2"])
    assert (out / "model.safetensors.index.json").is_file()  # sharded: --max-file-mb
    tool.main(["--merge-shards", str(out)])
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 2 and report["parameters"] == sum(p.numel() for p in model.parameters())
    assert tok.decode(tok("x = 1\n", add_special_tokens=False).input_ids) == "x = 1\n"
