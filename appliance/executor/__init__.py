"""Torch side of the engine: weight loading, KV cache, input building, the model runner and the sampler."""
from __future__ import annotations
