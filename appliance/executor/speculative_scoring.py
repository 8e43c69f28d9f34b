"""A speculative step's scoring on the host (the base of executor/speculative.py `Speculator`, beside
speculative_drafts.py's drafting): plain sampling rows, and verifications decided on the device
(device_verification.py), by the host verifier (speculative_verification.py, speculative_rejection.py) or, for
draft trees, by the walk down the tree (tree_verification.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from appliance.engine.step import SampledToken
from appliance.executor import logits_processors
from appliance.executor.device_verification import verify_on_device
from appliance.executor.input_batch import Chunk, Stager
from appliance.executor.sampler import SampleResult, prompt_logprobs
from appliance.executor.speculative_verification import verification_rows, verify
from appliance.executor.tree_verification import verify_trees

if TYPE_CHECKING:
    from appliance.executor.model_runner import ModelRunner
    from appliance.executor.request_table import RequestState
    from appliance.executor.speculative_forced import ForcedAcceptance
    from appliance.executor.tree_drafting import TreeDrafter


@dataclass
class Scored:
    """A step's scoring: its sampled tokens and the tokens each sampling chunk emitted."""

    sampled: list[SampledToken]
    emitted: dict[str, int]  # tokens emitted per sampling chunk
    prompt_logprobs: dict[str, list[list[tuple[int, float]] | None]] = field(default_factory=dict)
    paths: dict[str, list[int]] = field(default_factory=dict)  # a tree verification's accepted rows


class Scoring:
    """The scoring half of a Speculator (its constructor sets these)."""

    runner: ModelRunner
    num_steps: int
    forced: ForcedAcceptance | None
    draft_probs: dict[str, torch.Tensor]
    tree: TreeDrafter | None
    _index_stager: Stager
    _verdict_stager: Stager

    # ---- scoring: plain samples and verifications ------------------------------------------------------
    def _score(self, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
               verifying: dict[str, int]) -> Scored:
        r = self.runner
        rows: list[int] = []
        prompt_at: list[tuple[Chunk, int, int]] = []
        plain_at: list[tuple[Chunk, int]] = []
        verify_at: list[tuple[Chunk, int, int]] = []  # chunk, first index into rows, drafts
        for c, first in zip(chunks, row_starts):
            if c.wants_prompt_logprobs:  # row of position p scores prompt token p + 1
                count = max(min(c.start + c.num_tokens, c.state.num_prompt_tokens - 1) - c.start, 0)
                prompt_at.append((c, len(rows), count))
                rows.extend(range(first, first + count))
            if not c.sample:
                continue
            d = verifying.get(c.state.request_id, 0)
            last = first + c.num_tokens - 1
            if d:
                verify_at.append((c, len(rows), d))
            else:
                plain_at.append((c, len(rows)))
            rows.extend(range(last - d, last + 1))
        out = Scored([], {})
        if not rows:
            return out
        logits = r.logits(hidden, rows)
        out.prompt_logprobs = {c.state.request_id: prompt_logprobs(c, logits[i : i + n].float())
                               for c, i, n in prompt_at}
        if plain_at:
            results = logits_processors.sample(r, self._rows_of(logits, [i for _, i in plain_at]),
                                               [c.state for c, _ in plain_at])
            for (c, _), res in zip(plain_at, results):
                c.state.token_ids.append(res.token_id)
                out.sampled.append(SampledToken(c.state.request_id, res.token_id, res.logprob, res.top_logprobs,
                                                res.rank, res.error))
                out.emitted[c.state.request_id] = 1
        if verify_at and self.tree is not None:
            self._verify_trees(logits, verify_at, out)
        elif verify_at:
            self._verify(logits, verify_at, out)
        return out

    def _rows_of(self, logits: torch.Tensor, index: list[int]) -> torch.Tensor:
        """These rows of logits: all of them in order without a gather (a step of verifications only), else a
        gather through a staged upload (a plain torch.tensor(..., device) waits for the GPU to catch up)."""
        if index == list(range(logits.shape[0])):
            return logits
        return logits[self._index_stager.send(np.asarray(index, dtype=np.int64))]

    def _verify(self, logits: torch.Tensor, verify_at: list[tuple[Chunk, int, int]], out: Scored) -> None:
        """Requests whose rows all sample on the device are decided there (device_verification.py); the others
        (logits processors, host-sampled rows, drafts drawn from the drafter's q) by the host verifier."""
        rows = self._rows_of(logits, [i + j for _, i, d in verify_at for j in range(d + 1)])
        firsts = np.cumsum([0] + [d + 1 for _, _, d in verify_at]).tolist()
        on_device = [k for k, (c, _, d) in enumerate(verify_at) if self._decided_on_device(c.state, d)]
        host = [k for k in range(len(verify_at)) if k not in set(on_device)]

        def rows_of(group: list[int]) -> torch.Tensor:
            if len(group) == len(verify_at):
                return rows
            index = [firsts[k] + j for k in group for j in range(verify_at[k][2] + 1)]
            return rows[self._index_stager.send(np.asarray(index, dtype=np.int64))]

        if on_device:
            chosen = [verify_at[k] for k in on_device]
            emitted = verify_on_device(self.runner.batch_sampler, rows_of(on_device), [(c, d) for c, _, d in chosen],
                                       self.num_steps, self.forced, self._verdict_stager, self.runner.block_table.lens)
            for (c, _, _), tokens in zip(chosen, emitted):
                out.sampled += [SampledToken(c.state.request_id, t) for t in tokens]
                out.emitted[c.state.request_id] = len(tokens)
        if host:
            self._verify_on_host(rows_of(host), [verify_at[k] for k in host], out)

    def _decided_on_device(self, state: RequestState, d: int) -> bool:
        if logits_processors.wants_processors(state.params.extra):
            return False
        if self.forced is None and self.draft_probs.get(state.request_id) is not None:
            return False  # drafts drawn from q: rejection sampling against p (speculative_rejection.py)
        return self.runner.batch_sampler.on_device(verification_rows(state, d))

    def _verify_on_host(self, rows: torch.Tensor, verify_at: list[tuple[Chunk, int, int]], out: Scored) -> None:
        first = 0
        for c, _, d in verify_at:  # structured outputs: each row masked as after the drafts before it
            if logits_processors.wants_processors(c.state.params.extra):
                logits_processors.processors_for(self.runner).mask_drafts(rows[first : first + d + 1], c.state, d)
            first += d + 1
        sampler = self.runner.batch_sampler

        def sample(lg: torch.Tensor, states: list[Any]) -> list[SampleResult]:
            masked = [i for i, s in enumerate(states) if logits_processors.wants_processors(s.params.extra)]
            return logits_processors.draw(sampler, lg, states, masked)

        probs = [self.draft_probs.get(c.state.request_id) for c, _, _ in verify_at]
        emitted = verify(sample, rows, [(c.state, d) for c, _, d in verify_at], self.forced, probs, sampler.sampler)
        for (c, _, _), results in zip(verify_at, emitted):
            rid = c.state.request_id
            out.sampled += [SampledToken(rid, x.token_id, x.logprob, x.top_logprobs, x.rank) for x in results]
            out.emitted[rid] = len(results)

    def _verify_trees(self, logits: torch.Tensor, verify_at: list[tuple[Chunk, int, int]], out: Scored) -> None:
        rows = self._rows_of(logits, [i + j for _, i, d in verify_at for j in range(d + 1)])
        sampler = self.runner.batch_sampler
        trees = [(c.state, c.tree) for c, _, _ in verify_at]
        assert all(t is not None for _, t in trees), "a tree speculator verified a chunk without its tree"
        for (c, _, _), (results, path) in zip(verify_at, verify_trees(sampler, rows, trees, self.forced)):
            rid = c.state.request_id
            out.sampled += [SampledToken(rid, x.token_id, x.logprob, x.top_logprobs, x.rank) for x in results]
            out.emitted[rid] = len(results)
            out.paths[rid] = path
