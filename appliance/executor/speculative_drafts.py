"""What a speculator's drafters share (the base of executor/speculative.py `Speculator`): the drafts held per
request, the catch-up inputs of drafters fed the target's states, and the draft chain, run from the graphs of
executor/draft_graphs.py and, after a verify-graph step, the catch-up graphs of executor/catch_up_graphs.py (or,
with eagle_topk > 1, the draft tree of executor/tree_drafting.py, eagerly). A
greedy chain's drafts come back through pinned memory and are read when `drafts` is next read (the next step's
start); after a step decided on the device, with the verdict (executor/device_proposal.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from appliance.engine.speculation import drafts_allowed
from appliance.executor.input_batch import Chunk, Stager
from appliance.executor.logits_processors import wants_processors
from appliance.executor.request_table import RequestState
from appliance.executor.speculative_rejection import DraftPicker, draws_drafts
from appliance.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from appliance.executor.catch_up_graphs import CatchUpGraphs
    from appliance.executor.draft_graphs import ChainGraphs, PendingChain
    from appliance.executor.draft_tree import DraftTree
    from appliance.executor.model_runner import ModelRunner
    from appliance.executor.tree_drafting import TreeDrafter
    from appliance.executor.verify_graphs import VerifyGraphs


class Drafting:
    """The drafting half of a Speculator (its constructor sets these); drafters implement `draft_step` and, for
    their own catch-up, override `catch_up_chunk` / `first_position` / `catch_up_source`."""

    runner: ModelRunner
    num_steps: int
    drafting: bool  # this step proposes (False above disable_by_batch_size sampling rows)
    verify_graphs: VerifyGraphs | None
    chains: ChainGraphs | None  # drafters with a model set it (draft_graphs.py)
    catch_up_graphs: CatchUpGraphs | None  # and their catch-up after verify graphs (catch_up_graphs.py)
    draft_probs: dict[str, torch.Tensor]  # q rows of drafts drawn from the drafter (speculative_rejection.py)
    tree: TreeDrafter | None  # eagle_topk > 1: drafts are trees (tree_drafting.py)
    trees: dict[str, DraftTree]  # each request's tree; its tokens are `drafts`, best first
    _drafts: dict[str, list[int]]
    _pending: tuple[dict[str, int], PendingChain] | None  # a chain launched, its drafts not read: each row
    _verified_on_graphs: bool  # this step's forward ran the verify graphs
    _chain_stager: Stager
    _index_stager: Stager

    @property
    def drafts(self) -> dict[str, list[int]]:
        """The drafts this worker holds per request; a chain still on its way is read first (its one wait)."""
        self._read_pending()
        return self._drafts

    def _read_pending(self, first_pos: list[int] | None = None) -> None:
        """A chain on its way to the held drafts (first_pos: its rows' first positions, for a chain placed on
        the device)."""
        if self._pending is not None:
            rows, pending = self._pending
            self._pending = None
            self._drafts.update(zip(rows, pending.drafts(first_pos)))

    def _held(self, request_id: str) -> int:
        """Drafts held for a request, without waiting for a chain on its way."""
        if self._pending is not None and request_id in self._pending[0]:
            return self._pending[1].counts[self._pending[0][request_id]]
        return len(self._drafts.get(request_id, ()))

    def _forget(self, rid: str) -> None:
        self.drafts.pop(rid, None)
        self.draft_probs.pop(rid, None)
        self.trees.pop(rid, None)

    def catch_up_chunk(self, c: Chunk, emitted: dict[str, int], verifying: dict[str, int]) -> Chunk:
        """The drafter's catch-up share of a chunk: its confirmed positions (a verification's emitted count, every
        token of other chunks), sampling where the chunk sampled. Drafters fed the next token (MTP, EAGLE)."""
        rid = c.state.request_id
        return Chunk(c.state, c.start, emitted[rid] if rid in verifying else c.num_tokens, c.sample)

    def first_position(self, state: RequestState) -> int:
        """Position of a request's first chain step (after its confirmed tokens; speculative_draft.py shifts it)."""
        return state.num_computed

    def catch_up_source(self) -> torch.Tensor | None:
        """The static tensor the catch-up graphs take the drafter's fed rows from (None: token ids only)."""
        return None

    def propose_on_graphs(self, chunks: list[Chunk], row_starts: list[int], emitted: dict[str, int],
                          verifying: dict[str, int]) -> bool:
        """The catch-up (catch_up_graphs.py) and the chain of a step the verify graphs ran, with no host round
        trip between them; False where it does not apply (the drafter's eager catch-up runs instead)."""
        cu = self.catch_up_graphs
        if cu is None or not self._verified_on_graphs or cu.source is not self.catch_up_source():
            return False
        if any(c.sample and draws_drafts(c.state.params) for c in chunks):
            return False  # drafts drawn from the drafter's q: its eager catch-up keeps the logits
        own = [self.catch_up_chunk(c, emitted, verifying) for c in chunks]
        take = [first + j for c, first in zip(own, row_starts) for j in range(c.num_tokens)]
        got = cu.run_catch_up(own, take if cu.source is not None else [])
        if got is None:
            return False
        starts, tokens, hidden = got
        drafting = [(c.state, s + c.num_tokens - 1) for c, s in zip(own, starts) if self.wants_drafts(c)]
        if drafting:
            at = self._chain_stager.send(np.asarray([row for _, row in drafting], dtype=np.int64))
            states = [st for st, _ in drafting]
            self.launch_chain(states, tokens[at], [self.first_position(st) for st in states],
                              hidden[at] if hidden is not None else None)
        return True

    def shifted_inputs(self, chunks: list[Chunk], row_starts: list[int], emitted: dict[str, int],
                       verifying: dict[str, int], device: torch.device) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Catch-up inputs of a drafter fed (token at i + 1, target's hidden state at i) (MTP, EAGLE): rows over
        every chunk's positions whose next token is confirmed (a verification's emitted count, every row of other
        chunks). Returns the inputs (positions, metadata, rows in their order), the shifted token ids and the
        target's row of each."""
        r = self.runner
        own = [self.catch_up_chunk(c, emitted, verifying) for c in chunks]
        target_first = {c.state.request_id: first for c, first in zip(chunks, row_starts)}
        inputs = r.host_inputs(own)
        ids: list[int] = []
        take: list[int] = []
        for c in inputs.chunks:
            ids += c.state.token_ids[c.start + 1 : c.start + c.num_tokens + 1]
            first = target_first[c.state.request_id]
            take += range(first, first + c.num_tokens)
        sent = self._index_stager.send(np.asarray(ids + take, dtype=np.int64))
        return inputs, sent[: len(ids)], sent[len(ids) :]

    def last_rows(self, inputs: Any) -> tuple[list[RequestState], torch.Tensor]:
        """The requests this step drafts for and their last catch-up rows (on the device, staged: a plain copy
        would wait for the catch-up forward)."""
        drafting = [(c.state, s + c.num_tokens - 1) for c, s in zip(inputs.chunks, inputs.row_starts)
                    if self.wants_drafts(c)]
        rows = self._chain_stager.send(np.asarray([row for _, row in drafting], dtype=np.int64)) if drafting else None
        return [s for s, _ in drafting], rows  # type: ignore[return-value]

    def wants_drafts(self, c: Chunk) -> bool:
        """Whether this step proposes for the chunk's request."""
        if self.tree is not None and wants_processors(c.state.params.extra):
            return False  # grammar masks follow one chain of drafts (logits_processors.mask_drafts), not a tree
        return self.drafting and c.sample and drafts_allowed(c.state.params)

    def draft_limit(self, state: RequestState) -> int:
        """First position a draft chain may not write: past the block table or the model's length."""
        return min(len(state.block_ids) * self.runner.block_size, self.runner.max_model_len)

    def chain(self, states: list[RequestState], logits: torch.Tensor, first_pos: list[int], hidden: Any,
              id_map: torch.Tensor | None = None) -> None:
        """Drafts 1..num_steps of each state (with a tree drafter, a tree each instead: _draft_trees): the first is
        picked from `logits` (the drafter's, one row per state), then chain step i feeds draft i (and the
        drafter's `hidden` rows, if it chains them) to `draft_step` at position first_pos + i - 1
        (draft_graphs.py). Drafts are argmax (`id_map`: the drafter's vocabulary ->
        the target's), from one graph per batch whose drafts are read when next needed; or, when a random
        unseeded request draws its drafts from the drafter's q (speculative_rejection.py DraftPicker), the same
        chain runs uncaptured with the picker and keeps the q rows. A chain stops early where that position is
        past the block table or max_model_len (the scheduler never asks for more drafts than the result
        reports)."""
        if self.tree is not None:
            self._draft_trees(states, logits, first_pos, hidden, id_map)
            return
        assert self.chains is not None, f"{type(self).__name__} drafts without a chain"
        if not any(draws_drafts(s.params) for s in states):
            self.launch_chain(states, self.chains.greedy(logits), first_pos, hidden)
            return
        limits = [self.draft_limit(s) for s in states]
        self._read_pending()
        picker = DraftPicker(states, self.runner.batch_sampler.sampler.generator(logits.device), self.chains.id_map,
                             int(self.runner.hf_config.vocab_size))
        rows = np.arange(len(states))
        drafts = self.chains.run_drawn(states, picker.pick(logits, rows), first_pos, hidden, limits,
                                       lambda lg: picker.pick(lg, rows))
        for i, (state, row) in enumerate(zip(states, drafts)):
            self._drafts[state.request_id] = row
            q = picker.probs(i, len(row))
            if q is not None:
                self.draft_probs[state.request_id] = q

    def _draft_trees(self, states: list[RequestState], logits: torch.Tensor, first_pos: list[int], hidden: Any,
                     id_map: torch.Tensor | None) -> None:
        """Trees for the states whose tree steps fit their block table and the model; the others get none."""
        assert self.tree is not None
        fits = [i for i, (s, p) in enumerate(zip(states, first_pos))
                if p + self.tree.scratch() <= self.draft_limit(s) and p + self.num_steps <= self.runner.max_model_len]
        if not fits:
            return
        if len(fits) < len(states):
            index = torch.tensor(fits, dtype=torch.int64, device=logits.device)
            logits, hidden = logits[index], hidden[index] if hidden is not None else None
        states, first_pos = [states[i] for i in fits], [first_pos[i] for i in fits]
        for state, tree in zip(states, self.tree.draft(self.draft_step, states, logits, first_pos, hidden, id_map)):
            self._drafts[state.request_id] = list(tree.tokens)
            self.trees[state.request_id] = tree

    def launch_chain(self, states: list[RequestState], first: torch.Tensor, first_pos: list[int] | None,
                     hidden: Any) -> None:
        """The greedy chain after these first drafts (target ids), from its graph; its drafts are read when
        `drafts` is next read. first_pos None: from the device lengths (device_proposal.py, which reads it)."""
        assert self.chains is not None
        limits = [self.draft_limit(s) for s in states]
        self._read_pending()  # (the step's verification read them already)
        self._pending = ({s.request_id: i for i, s in enumerate(states)},
                         self.chains.launch(states, first, first_pos, hidden, limits))

    def draft_step(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, hidden: Any
                   ) -> tuple[torch.Tensor, Any]:
        """One chain step of the drafter: its logits (its own vocabulary) after `tokens`, and the hidden rows it
        chains."""
        raise NotImplementedError
