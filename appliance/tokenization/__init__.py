"""Tokenizer loading and incremental detokenization with stop strings (shared by the server and LLM)."""
from __future__ import annotations

from appliance.tokenization.detokenizer import Detokenizer
from appliance.tokenization.tokenizer import decode_token, load_tokenizer

__all__ = ["Detokenizer", "decode_token", "load_tokenizer"]
