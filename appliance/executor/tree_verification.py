"""Verification of draft trees (speculative.eagle_topk > 1; the tree: draft_tree.py).

A request's chunk is the root and its n nodes (1 + n rows under the tree mask), each row scored with the normal
sampler with the row's root-to-node path as its history. From the root, the walk takes the child whose token equals
the row's sample and goes on from there; the first sample no child matches (or the sample at a leaf) ends it. The
emitted tokens are the samples along the path, so each is the target's own sample after the tokens before it: greedy
and seeded rows emit exactly what they emit without drafts, and a random row's tokens are distributed as the
target's (the drafts only decide how far one step gets). Drafts are never drawn from the drafter's distribution for
trees (speculative_rejection.py is for chains). `forced` (benchmarks) keeps that many nodes along the longest path.

Afterwards the accepted path's rows move to consecutive rows (`compact`): their KV to the slots start + 1 .. start
+ a in every target layer, their hidden rows (and an EAGLE-3 head's captured rows) to first + 1 .. first + a, so
the cache and the drafter's catch-up see what a chain of those tokens leaves; the rejected nodes' slots lie past
the confirmed positions and are overwritten later, as a chain's rejected drafts are.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from appliance.executor.draft_tree import DraftTree
from appliance.executor.request_table import RequestState
from appliance.executor.sampler import SampleResult
from appliance.executor.speculative_forced import ForcedAcceptance


class _TreeRow:
    """A tree row as the sampler sees a request: its history is the confirmed tokens plus the row's path."""

    def __init__(self, state: RequestState, confirmed: int, path: list[int]) -> None:
        self.state, self.confirmed, self.path = state, confirmed, path
        self.request_id, self.params, self.noise_seed = state.request_id, state.params, state.noise_seed
        self.num_prompt_tokens = state.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids[: self.confirmed] + self.path

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_generated(self) -> int:
        return self.confirmed + len(self.path) - self.num_prompt_tokens


def _paths(tree: DraftTree) -> list[list[int]]:
    """Each chunk row's tokens from the root (exclusive) to the row's node (inclusive); the root's is empty."""
    out: list[list[int]] = [[]]
    for token, p in zip(tree.tokens, tree.parents):
        out.append(out[p + 1] + [token])
    return out


def walk(tree: DraftTree, samples: list[int]) -> list[int]:
    """The accepted rows (the root's 0 first): from each row, on to the child whose token is the row's sample."""
    kids, rows = tree.children(), [0]
    while True:
        nxt = next((c for c in kids[rows[-1]] if tree.tokens[c - 1] == samples[rows[-1]]), None)
        if nxt is None:
            return rows
        rows.append(nxt)


def verify_trees(sample: Callable[[torch.Tensor, list[Any]], list[SampleResult]], logits: torch.Tensor,
                 requests: Sequence[tuple[RequestState, DraftTree]], forced: ForcedAcceptance | None = None
                 ) -> list[tuple[list[SampleResult], list[int]]]:
    """Verify trees: each request's token_ids end with its tree's n node tokens and it owns 1 + n consecutive rows
    of `logits` (the root's, then the nodes'). Returns per request the emitted samples and the accepted rows (the
    root first); token_ids end with the emitted tokens afterwards."""
    rows: list[_TreeRow] = []
    for state, tree in requests:
        confirmed = len(state.token_ids) - len(tree)
        rows += [_TreeRow(state, confirmed, path) for path in _paths(tree)]
    results = sample(logits, rows)
    out: list[tuple[list[SampleResult], list[int]]] = []
    at = 0
    for state, tree in requests:
        mine = results[at : at + len(tree) + 1]
        at += len(tree) + 1
        if forced is None:
            path = walk(tree, [x.token_id for x in mine])
            kept = [mine[r] for r in path]
        else:
            path = tree.longest_path(forced.accepted(tree.heights()[0]))
            kept = [SampleResult(tree.tokens[r - 1]) for r in path[1:]] + [mine[path[-1]]]
        del state.token_ids[len(state.token_ids) - len(tree) :]
        state.token_ids.extend(x.token_id for x in kept)
        out.append((kept, path))
    return out


def compact(moves: list[tuple[int, int]], caches: Sequence[torch.Tensor], rows: list[tuple[int, int]],
            row_tensors: Sequence[torch.Tensor]) -> None:
    """Copy accepted nodes down: `moves` (source slot, destination slot) in every cache ([blocks, block_size,
    ...]), `rows` (source row, destination row) in every row tensor. Every source is read before any destination
    is written (one gather, then one scatter per tensor): a destination may be another move's source."""
    if moves:
        device = caches[0].device if caches else torch.device("cpu")
        src, dst = (torch.tensor(x, dtype=torch.int64, device=device) for x in zip(*moves))
        for cache in caches:
            flat = _raw(cache.flatten(0, 1))
            flat.index_copy_(0, dst, flat.index_select(0, src))
    if rows:
        for t in row_tensors:
            src, dst = (torch.tensor(x, dtype=torch.int64, device=t.device) for x in zip(*rows))
            t.index_copy_(0, dst, t.index_select(0, src))


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its element size: index copies exist for every integer type, not for
    fp8 (an fp8 KV cache)."""
    return t.view(_RAW[t.element_size()])


def path_moves(state: RequestState, start: int, first_row: int, path: list[int], block_size: int
               ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The slot and row moves that bring an accepted path's nodes (chunk rows `path`, the root first) to
    consecutive positions after the root (start: the chunk's first position, first_row: its first hidden row)."""
    def slot(t: int) -> int:
        return state.block_ids[t // block_size] * block_size + t % block_size

    moved = [(r, j) for j, r in enumerate(path) if r != j]
    return ([(slot(start + r), slot(start + j)) for r, j in moved],
            [(first_row + r, first_row + j) for r, j in moved])
