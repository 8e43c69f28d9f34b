"""User-facing entry points: the offline LLM class."""
from __future__ import annotations
