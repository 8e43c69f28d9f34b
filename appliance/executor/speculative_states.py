"""Speculative verification on targets with a recurrent state (hybrid linear-attention models).

A verification runs the request's last token and its d drafts as one chunk, and every linear-attention layer
leaves the request's state slot at the chunk's end: past the drafts that verification then rejects. KV blocks need
no repair (positions past num_computed are overwritten later), a recurrent state does. So the rows' states are
copied before the forward, and where drafts were rejected they are put back and the kept tokens recomputed (one
more target forward over them, which rewrites their KV with the same values). Steps whose drafts are all accepted
pay the copy only. Keeping a state per draft position instead would skip the recompute, at the price of
per-position state outputs from the prefill kernels.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from appliance.executor.input_batch import Chunk

if TYPE_CHECKING:
    from appliance.executor.state_cache import StateCache


class StateRollback:
    """The states of one step's verifying rows, from before its forward."""

    def __init__(self, cache: StateCache, chunks: list[Chunk], verifying: dict[str, int]) -> None:
        self.cache = cache
        self.rows = [c.state.table_row for c in chunks if c.state.request_id in verifying]
        self.saved = cache.save(self.rows) if self.rows else None

    @classmethod
    def of(cls, cache: StateCache | None, chunks: list[Chunk], verifying: dict[str, int]) -> StateRollback | None:
        """None where nothing can need it (no recurrent state, no verification this step)."""
        return cls(cache, chunks, verifying) if cache is not None and verifying else None

    def roll_back(self, chunks: list[Chunk], emitted: dict[str, int], verifying: dict[str, int],
                  forward: Callable[[list[Chunk]], object]) -> int:
        """Put back the states of verifications that rejected drafts and recompute their kept tokens (chunks as
        verified: start and 1 + d tokens; emitted: the tokens kept). Returns how many requests were recomputed."""
        kept = [Chunk(c.state, c.start, emitted[c.state.request_id], False) for c in chunks
                if c.state.request_id in verifying and emitted[c.state.request_id] < c.num_tokens]
        if not kept or self.saved is None:
            return 0
        rows = [c.state.table_row for c in kept]
        self.cache.restore(rows, self.saved, [self.rows.index(r) for r in rows])
        with torch.inference_mode():
            forward(kept)
        return len(kept)
