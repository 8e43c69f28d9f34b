"""Model definitions; `registry.model_class(hf_config)` picks one from config.architectures."""
from __future__ import annotations
