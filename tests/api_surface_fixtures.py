"""The server the API-surface tests share (not a conftest: imported by tests/test_api_surface_*.py only).

One real pipeline on the CPU (supervisor -> tokenizer, scheduler, worker processes) serving a tiny random llama
with single-token reasoning tags, the agentic chat template, the deepseek_r1 reasoning parser, the hermes tool
parser, a server-wide thinking budget and an API key (the openai client sends it as a bearer token, the
anthropic client as x-api-key).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agentic_fixtures import TEMPLATE, build_think_model, served
from pipeline_server import free_port

API_KEY = "sk-surface"
SERVER_BUDGET = 6
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                             "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}


@contextmanager
def surface_server(root: Path) -> Iterator[tuple[str, Path]]:
    """Yields (base URL, model directory)."""
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
api_key = "{API_KEY}"
chat_template = {TEMPLATE!r}
reasoning_parser = "deepseek_r1"
tool_call_parser = "hermes"
thinking_budget = {SERVER_BUDGET}
responses_store_size = 4
[observability]
log_level = "warning"
'''
    with served(config, root / "serve.toml", port) as url:
        yield url, model
