"""N-gram prompt lookup (speculative.algorithm = NGRAM): drafts copied from the request's own history, on the host.

After a step samples a request, the longest suffix of its tokens of prompt_lookup_max down to prompt_lookup_min
tokens that occurred earlier proposes the up to num_steps tokens that followed its latest earlier occurrence
(vLLM's ngram proposer, SGLang's NGRAM with one branch). No match: no drafts, and the next step is a plain
decode. There is no drafter model and no cache. speculative.ngram_proposer chooses where the lookup runs: host
(numpy, one request at a time) or device (speculative_ngram_device.py: torch ops batched over the requests,
the same drafts). Unset, the lengths are 1 and 3 (prompt_lookup_max at least prompt_lookup_min).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from appliance.executor.input_batch import Chunk
from appliance.executor.speculative import Speculator
from appliance.executor.speculative_ngram_device import DeviceHistory

DEFAULT_MIN, DEFAULT_MAX = 1, 3


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` with
    min_n <= length <= max_n; [] when no such suffix recurs."""
    size = tokens.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # window s = tokens[s : s + n]; the suffix itself excluded
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramSpeculator(Speculator):
    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        s = runner.config.speculative
        self.min_n = s.prompt_lookup_min or DEFAULT_MIN
        self.max_n = s.prompt_lookup_max or max(DEFAULT_MAX, self.min_n)
        self.history: DeviceHistory | None = None  # speculative.ngram_proposer = device
        if s.ngram_proposer == "device":
            self.history = DeviceHistory(runner.config.scheduler.max_num_seqs + 1, runner.max_model_len,
                                         runner.device)

    def _forget(self, rid: str) -> None:
        super()._forget(rid)
        if self.history is not None:
            self.history.forget(rid)

    def _propose(self, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
                 emitted: dict[str, int], verifying: dict[str, int]) -> None:
        states = [c.state for c in chunks if self.wants_drafts(c)]
        if not states:
            return
        if self.history is not None:
            self.history.update(states)
            proposed = self.history.propose(states, self.min_n, self.max_n, self.num_steps)
        else:
            proposed = [ngram_propose(np.asarray(s.token_ids, dtype=np.int64), self.min_n, self.max_n,
                                      self.num_steps) for s in states]
        for state, drafts in zip(states, proposed):
            if drafts:
                self.drafts[state.request_id] = drafts
