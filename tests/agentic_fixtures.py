"""Helpers of the agentic tests (not a conftest: imported by tests/test_agentic_*.py only).

- a tiny tokenizer with `<think>` / `</think>` as added (not special) tokens, like Qwen3's and DeepSeek R1's,
  and a tiny random llama using it;
- a chat template that renders `tools`, assistant `tool_calls`, `tool` results and opens a thinking block
  unless enable_thinking is false;
- a served pipeline (supervisor -> tokenizer, scheduler, worker processes) on the CPU for one test module, and
  the agentic server on it: that model and template, the deepseek_r1 reasoning parser, the hermes tool parser
  and a server-wide thinking budget.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline_server import free_port, start_run, terminate, wait_healthy

THINK_TAGS = ["<think>", "</think>"]
SERVER_BUDGET = 6  # the agentic server's thinking budget
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                             "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}

TEMPLATE = (
    "{% if tools %}<s>system: tools {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
    "</s>{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}[call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}]{% endfor %}"
    "{% if m['role'] == 'tool' %} (id {{ m['tool_call_id'] }}){% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:"
    "{% if enable_thinking is not defined or enable_thinking %}<think>{% endif %}{% endif %}"
)


def build_think_model(root: Path) -> Path:
    """A tiny llama whose tokenizer has single-token reasoning tags."""
    from conftest import build_tiny_model, build_tiny_tokenizer
    from transformers import AutoTokenizer

    tok_dir = build_tiny_tokenizer(root / "tokenizer")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.add_tokens(THINK_TAGS)  # not special: skip_special_tokens keeps them, as in Qwen3 / DeepSeek R1
    tok.save_pretrained(str(tok_dir))
    return build_tiny_model("llama", root / "model", tok_dir)


@contextmanager
def served(config_toml: str, cfg_path: Path, port: int, timeout_s: float = 120.0) -> Iterator[str]:
    """Run `appliance run` on this config until the block ends; yields the base URL."""
    cfg_path.write_text(config_toml)
    proc = start_run(cfg_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, timeout_s)
        yield base
    finally:
        terminate(proc)


@contextmanager
def agentic_server(root: Path, api_extra: str = "") -> Iterator[tuple[str, Path]]:
    """The agentic server on a think model built under root, `api_extra` (TOML lines) added to its [api] table;
    yields (base URL, model directory)."""
    model = build_think_model(root)
    port = free_port()
    config = f'''
[model]
path = "{model}"
device = "cpu"
[cache]
max_total_tokens = 4096
[api]
port = {port}
served_model_name = "tiny"
chat_template = {TEMPLATE!r}
reasoning_parser = "deepseek_r1"
tool_call_parser = "hermes"
thinking_budget = {SERVER_BUDGET}
{api_extra}
[observability]
log_level = "warning"
'''
    with served(config, root / "serve.toml", port) as url:
        yield url, model
