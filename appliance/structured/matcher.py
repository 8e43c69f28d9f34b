"""Per-request grammar state: which tokens may come next, and advancing on the sampled token."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from appliance.structured.backend import require_xgrammar
from appliance.structured.compiler import CompiledGrammar

if TYPE_CHECKING:  # torch is imported by xgrammar anyway; kept out of import time for the server process
    import torch


class GrammarMatcher:
    """Use per step: `apply_to_logits(row)` before sampling, then `accept_token(sampled_id)`.

    When `is_terminated()` the grammar is complete and a stop token was accepted: the request is finished.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        self._xgr = require_xgrammar()
        self.compiled = compiled
        self.vocab_size = compiled.vocab_size
        self._matcher: Any = self._xgr.GrammarMatcher(compiled.handle)
        self._bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)

    def allowed_token_bitmask(self) -> torch.Tensor:
        """int32 [ceil(vocab/32)]: bit j of word i set means token 32*i+j is allowed next."""
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask[0]

    def allowed_token_ids(self) -> list[int]:
        import torch

        mask = self.allowed_token_bitmask()
        bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return [i for i in torch.nonzero(bits.reshape(-1)[: self.vocab_size]).flatten().tolist()]

    def apply_to_logits(self, logits_row: torch.Tensor) -> torch.Tensor:
        """Set disallowed logits to -inf in place (also every column past the grammar's vocab) and return the row."""
        if logits_row.dim() != 1:
            raise ValueError(f"expected one row of logits, got shape {tuple(logits_row.shape)}")
        width = logits_row.shape[0]
        if width < self.vocab_size:
            raise ValueError(f"logits have {width} columns but the tokenizer has {self.vocab_size} tokens")
        mask = self.allowed_token_bitmask().to(logits_row.device)
        head = logits_row[: self.vocab_size]
        self._xgr.apply_token_bitmask_inplace(head.unsqueeze(0), mask.unsqueeze(0), vocab_size=self.vocab_size)
        if width > self.vocab_size:
            logits_row[self.vocab_size :] = float("-inf")
        return logits_row

    def accept_token(self, token_id: int) -> bool:
        """Advance; False when the grammar does not allow the token (the state is then unchanged)."""
        if not 0 <= token_id < self.vocab_size:
            return False
        return bool(self._matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (speculative decoding: rejected draft tokens)."""
        self._matcher.rollback(num_tokens)


def apply_batch(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
    """Mask a [batch, vocab] logits tensor in place: row i follows matchers[i]; rows with None are untouched.

    One bitmask for the whole batch and one masking call, which is what a sampler wants per step.
    """
    if logits.dim() != 2 or logits.shape[0] != len(matchers):
        raise ValueError(f"expected logits [{len(matchers)}, vocab], got {tuple(logits.shape)}")
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    xgr = require_xgrammar()
    vocab = {matchers[i].vocab_size for i in rows}  # type: ignore[union-attr]
    if len(vocab) != 1:
        raise ValueError("all matchers of one batch must share a tokenizer")
    vocab_size = vocab.pop()
    if logits.shape[1] < vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} columns but the tokenizer has {vocab_size} tokens")
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i in rows:
        matchers[i]._matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
    xgr.apply_token_bitmask_inplace(
        logits[:, :vocab_size], bitmask.to(logits.device), vocab_size=vocab_size, indices=rows
    )
    if logits.shape[1] > vocab_size:
        logits[rows, vocab_size:] = float("-inf")
