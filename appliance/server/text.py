"""The text side of one choice: tokenization.Detokenizer (multi-byte safe, stop strings across tokens),
wrapped to the (text, stop string) shape generation.py uses."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from appliance.engine.sampling_params import SamplingParams
from appliance.tokenization import Detokenizer, decode_token


class TextStream:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._detok = Detokenizer(
            tokenizer, prompt_token_ids, stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens, min_tokens=params.min_tokens)

    def add(self, token_ids: Sequence[int]) -> tuple[str, str | None, int]:
        """New visible text, the stop string when one just matched (the choice then ends), and how many of
        `token_ids` belong to the output: all of them, or with a stop string those up to the one that completed
        it (a speculative step's output can carry tokens past it)."""
        was_finished = self._detok.finished
        before = self._detok.num_output_tokens
        text = self._detok.update(token_ids)
        stop = self._detok.stop_reason if self._detok.finished and not was_finished else None
        return text, stop, self._detok.num_output_tokens - before

    def flush(self) -> str:
        return self._detok.flush()


class NoTokenizer:
    """The server's tokenizer under model.skip_tokenizer_init: token ids in, token ids out. Text has no meaning
    (decoded text is empty, a token's own text is vLLM's `token_id:N`); encoding text is a 400 that says so."""

    chat_template = None
    bos_token = eos_token = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        from appliance.server.errors import bad_request

        raise bad_request("this server runs without a tokenizer (model.skip_tokenizer_init): send prompts as "
                          "token ids to /v1/completions", "prompt")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        return ""


def tokenizer_free(tokenizer: Any) -> bool:
    return isinstance(tokenizer, NoTokenizer)


def token_text(tokenizer: Any, token_id: int) -> str:
    if isinstance(tokenizer, NoTokenizer):
        return f"token_id:{token_id}"
    return decode_token(tokenizer, token_id)
