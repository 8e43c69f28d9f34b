"""Incremental detokenization with stop strings, independent of the engine (used by LLM and the server).

Text grows by decoding a short window of recent tokens (prefix window vs. window plus the new tokens), so each
step costs O(window), and a multi-byte character split across tokens is held until it is complete (no U+FFFD
halves). Stop strings are matched on the text, so they may span tokens; while the tail of the text could still
be the start of a stop string it is held back (unless the stop string would be returned anyway).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_CONTEXT = 5  # prompt tokens kept as left context, so the first output token decodes with its leading space
_REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), *, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, min_tokens: int = 0) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.min_tokens = min_tokens
        self._backend = backend_decode(tokenizer, skip_special_tokens)
        self._ids: list[int] = list(prompt_token_ids)[-_CONTEXT:]
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens before this are already in the text
        self._num_output = 0
        self.text = ""  # output text so far (cut at the stop string when one matched)
        self._emitted = 0  # characters of self.text already returned
        self.stop_reason: str | None = None
        self._hold = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens consumed so far. update() stops consuming at the token that completes a stop string,
        so after a stop this counts the tokens that belong to the output: the caller keeps that many token ids
        (and logprobs) when one update carried several tokens (speculative decoding) and drops the rest."""
        return self._num_output

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend(ids)
        kwargs: dict[str, Any] = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False  # only slow tokenizers honour it
        return self.tokenizer.decode(list(ids), **kwargs)

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Feed generated tokens; returns the text that may now be shown. After a stop string, returns ''.
        Tokens after the one that completes a stop string are not consumed (see num_output_tokens)."""
        if self.finished:
            return ""
        before = len(self.text)
        for token in new_token_ids:
            self._ids.append(int(token))
            self._num_output += 1
            self._advance()
            if self.stop and self._num_output >= self.min_tokens and self._match_stop(before):
                break
        return self._take(final=self.finished)

    def flush(self) -> str:
        """The held-back tail, when the request ends for another reason (EOS, length, abort); tokens of an
        incomplete character are decoded as they are, since nothing will complete them now."""
        if not self.finished and self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            self.text += self._decode(self._ids[self._prefix :])[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        return self._take(final=True)

    def _advance(self) -> None:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) > len(prefix_text) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            if self._prefix > 4 * _CONTEXT:  # forget tokens that no window will read again
                drop = self._prefix - _CONTEXT
                self._ids = self._ids[drop:]
                self._prefix -= drop
                self._read -= drop

    def _match_stop(self, before: int) -> bool:
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        idx, s = min(hits)
        self.stop_reason = s
        self.text = self.text[: idx + (len(s) if self.include_stop else 0)]
        return True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out


def backend_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[Sequence[int]], str] | None:
    """The tokenizers library's own decode where transformers' decode of a fast tokenizer returns exactly its
    text (its generic class, and no clean-up pass: clean_up_tokenization_spaces off, or a BPE model, which
    transformers leaves uncleaned); else None. Two decodes per token through transformers' argument handling
    cost ~10x the decode itself, and the HTTP process runs them for every token of every stream."""
    from_class = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if backend is None or from_class.decode is not PreTrainedTokenizerFast.decode or \
            from_class._decode is not PreTrainedTokenizerFast._decode:
        return None
    # transformers' decode skips its clean-up for BPE models only where it knows this flag (5.x)
    bpe_kept = type(backend.model).__name__ == "BPE" and getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True) is False
    if tokenizer.clean_up_tokenization_spaces and not bpe_kept:
        return None
    decode = backend.decode
    return lambda ids: decode(ids if type(ids) is list else list(ids), skip_special_tokens=skip_special_tokens)
