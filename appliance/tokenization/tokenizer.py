"""Loading a Hugging Face tokenizer from local files (a directory or the local HF cache; never the network)."""
from __future__ import annotations

from typing import Any

from appliance.config.hf_cache import resolve_model_dir


def load_tokenizer(path: str, *, mode: str = "auto", trust_remote_code: bool = False, revision: str | None = None,
                   download_dir: str | None = None) -> Any:
    """transformers.AutoTokenizer for `path`; mode `slow` forces the Python tokenizer."""
    from transformers import AutoTokenizer

    if mode not in ("auto", "slow"):
        raise ValueError(f"tokenizer_mode {mode!r} is not one of auto, slow")
    local = resolve_model_dir(path, revision, download_dir)
    try:
        return AutoTokenizer.from_pretrained(str(local), use_fast=mode != "slow", trust_remote_code=trust_remote_code,
                                             local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {local}: {exc}") from exc


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's text on its own (may be a partial character for byte-level tokenizers)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
