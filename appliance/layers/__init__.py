"""Tensor-parallel-aware building blocks of the models (world size from layers.parallel_state)."""
from __future__ import annotations
