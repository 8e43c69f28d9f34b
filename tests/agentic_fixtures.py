"""Helpers of the agentic tests (not a conftest: imported by tests/test_agentic_*.py only).

- a tiny tokenizer with `<think>` / `</think>` as added (not special) tokens, like Qwen3's and DeepSeek R1's,
  and a tiny random llama using it;
- a chat template that renders `tools`, assistant `tool_calls`, `tool` results and opens a thinking block
  unless enable_thinking is false;
- a served pipeline (supervisor -> tokenizer, scheduler, worker processes) on the CPU for one test module.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

THINK_TAGS = ["<think>", "</think>"]

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(config_toml: str, cfg_path: Path, port: int, timeout_s: float = 120.0) -> Iterator[str]:
    """Run `appliance run` on this config until the block ends; yields the base URL."""
    cfg_path.write_text(config_toml)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli.main", "run", str(cfg_path)], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, "the supervisor exited during start-up"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready in {timeout_s:.0f} s"
            time.sleep(0.2)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
