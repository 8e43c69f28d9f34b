"""N-gram prompt lookup on the device (speculative.ngram_proposer = device; vLLM's ngram_gpu): the same drafts as
the host proposer (speculative_ngram.py ngram_propose), found by torch ops batched over the requests.

Each request's tokens live on the device in one int32 tensor of rows (the request's row of the runner's block
table), and a step sends only the tokens a row lacks, as (flat index, id) pairs in one staged upload; the
buffer's width grows in powers of two to the longest history seen (at most max_model_len), so an idle engine
holds little. The lookup compares every window of every row with its suffix, one n-gram length at a time (a
handful of lengths, longest first), and the drafts come back in one read.
"""
from __future__ import annotations

import numpy as np
import torch

from appliance.executor.input_batch import Stager
from appliance.executor.request_table import RequestState


def ngram_propose_batch(tokens: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int, k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched ngram_propose: tokens [B, W] (row b's history in its first lengths[b] columns). Returns drafts
    [B, k] (-1 past a row's count) and counts [B]: up to k tokens after the latest earlier occurrence of the
    longest suffix of min_n..max_n tokens that recurs, 0 where none does."""
    b, width = tokens.shape
    dev = tokens.device
    start = torch.full((b,), -1, dtype=torch.int64, device=dev)
    for n in range(min(max_n, width - 1), min_n - 1, -1):
        span = width - n  # window starts 0..span-1; a start s covers tokens[s : s + n]
        s = torch.arange(span, device=dev)
        # an earlier occurrence ends before the last token (the suffix itself is excluded), as on the host
        match = (s[None] <= (lengths - n - 1)[:, None]) & (lengths > n)[:, None]
        for j in range(n):
            suffix_j = tokens.gather(1, (lengths - n + j).clamp(min=0)[:, None])
            match &= tokens[:, j : j + span] == suffix_j
        latest = torch.where(match, s[None], -1).max(dim=-1).values
        start = torch.where((start < 0) & (latest >= 0), latest + n, start)
    counts = torch.where(start >= 0, torch.clamp(lengths - start, max=k), 0)
    at = (start.clamp(min=0)[:, None] + torch.arange(k, device=dev)[None]).clamp(max=width - 1)
    drafts = tokens.gather(1, at).to(torch.int64)
    return torch.where(torch.arange(k, device=dev)[None] < counts[:, None], drafts, -1), counts


class DeviceHistory:
    """Every live request's tokens on the device, indexed by its block-table row."""

    def __init__(self, rows: int, max_len: int, device: torch.device) -> None:
        self.max_len, self.device = max_len, device
        self.tokens = torch.zeros((rows, min(256, max_len)), dtype=torch.int32, device=device)
        self.written: dict[str, int] = {}  # request id -> tokens of it on the device
        self._deltas, self._rows = Stager(device), Stager(device)

    def forget(self, request_id: str) -> None:
        self.written.pop(request_id, None)

    def update(self, states: list[RequestState]) -> None:
        """Send the tokens these requests gained since the last update (all of them for a new one)."""
        longest = max(len(s.token_ids) for s in states)
        if longest > self.tokens.shape[1]:
            self._grow(longest)
        width = self.tokens.shape[1]
        index: list[np.ndarray] = []
        values: list[list[int]] = []
        for s in states:
            have = self.written.get(s.request_id, 0)
            if have < len(s.token_ids):
                index.append(s.table_row * width + np.arange(have, len(s.token_ids)))
                values.append(s.token_ids[have:])
            self.written[s.request_id] = len(s.token_ids)
        if not index:
            return
        flat_index = np.concatenate(index)
        flat = np.concatenate([flat_index, np.concatenate([np.asarray(v, dtype=np.int64) for v in values])])
        sent = self._deltas.send(flat)
        n = flat_index.shape[0]
        self.tokens.view(-1).index_copy_(0, sent[:n], sent[n:].to(torch.int32))

    def _grow(self, needed: int) -> None:
        width = min(self.max_len, 1 << (needed - 1).bit_length())
        grown = torch.zeros((self.tokens.shape[0], width), dtype=torch.int32, device=self.device)
        grown[:, : self.tokens.shape[1]] = self.tokens
        self.tokens = grown

    def propose(self, states: list[RequestState], min_n: int, max_n: int, k: int) -> list[list[int]]:
        """Drafts of each state (after update()), read back once."""
        lens = np.asarray([len(s.token_ids) for s in states], dtype=np.int64)
        rows = np.asarray([s.table_row for s in states], dtype=np.int64)
        sent = self._rows.send(np.concatenate([rows, lens]))
        width = int(lens.max())
        tokens = self.tokens[:, :width].index_select(0, sent[: len(states)])
        drafts, _ = ngram_propose_batch(tokens, sent[len(states) :], min_n, max_n, k)
        return [[t for t in row if t >= 0] for row in drafts.tolist()]
