"""Loading a Hugging Face tokenizer from local files (a directory or the local HF cache; never the network)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from appliance.config.hf_cache import resolve_model_dir

# tokenizer_config.json classes that name transformers' generic tokenizers.json tokenizer
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# model types for which AutoTokenizer loads such a tokenizer as that generic class (not on transformers' list of
# hubs that name the wrong class, so the named class is trusted; tests/test_tokenizer_loading.py holds this)
GENERIC_MODEL_TYPES = ("llama", "qwen3")


def load_tokenizer(path: str, *, mode: str = "auto", trust_remote_code: bool = False, revision: str | None = None,
                   download_dir: str | None = None) -> Any:
    """transformers.AutoTokenizer for `path`; mode `slow` forces the Python tokenizer. Where AutoTokenizer would
    pick the generic tokenizer.json class, that class is loaded directly: AutoTokenizer's import brings in
    transformers' model configs and torch (seconds of the HTTP process' start-up), the class alone does not."""
    if mode not in ("auto", "slow"):
        raise ValueError(f"tokenizer_mode {mode!r} is not one of auto, slow")
    local = resolve_model_dir(path, revision, download_dir)
    try:
        if mode == "auto" and loads_as_generic(Path(local)):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(local), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(local), use_fast=mode != "slow", trust_remote_code=trust_remote_code,
                                             local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {local}: {exc}") from exc


def loads_as_generic(model_dir: Path) -> bool:
    """Whether AutoTokenizer would load model_dir's tokenizer as the generic class: tokenizer_config.json names
    it, neither file names remote code, tokenizer.json is there and the model type is one of GENERIC_MODEL_TYPES."""
    tok, cfg = _json(model_dir / "tokenizer_config.json"), _json(model_dir / "config.json")
    return (tok.get("tokenizer_class") in GENERIC_CLASSES and "auto_map" not in tok and "auto_map" not in cfg
            and cfg.get("model_type") in GENERIC_MODEL_TYPES and (model_dir / "tokenizer.json").is_file())


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's text on its own (may be a partial character for byte-level tokenizers)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
