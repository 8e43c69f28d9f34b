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

from agentic_fixtures import agentic_server

API_KEY = "sk-surface"


@contextmanager
def surface_server(root: Path) -> Iterator[tuple[str, Path]]:
    """The agentic server with an API key and a store of 4 responses; yields (base URL, model directory)."""
    with agentic_server(root, f'api_key = "{API_KEY}"\nresponses_store_size = 4') as got:
        yield got
