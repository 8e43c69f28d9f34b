"""A draft tree (executor/draft_tree.py) and what is built from it, without a model: its order, masks, pruning and
walk; the tree search with a scripted drafter (tree_drafting.py: each frontier node is fed its own ancestors); a
step's inputs with a tree verification (input_batch.py); and a verification's random rows, whose emitted tokens
have the target's distribution (tree_verification.py)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from appliance.executor.draft_tree import DraftTree, select_tree
from appliance.executor.tree_verification import walk


def test_a_tree_orders_parents_first_and_masks_each_row_to_its_ancestors() -> None:
    # candidates: root children a (-0.1), b (-0.5); a's children c (-0.3), d (-0.9); b's child e (-0.6)
    scores = np.array([-0.1, -0.5, -0.3, -0.9, -0.6])
    tree = select_tree(scores, np.array([10, 11, 12, 13, 14]), np.array([-1, -1, 0, 0, 1]), np.array([1, 1, 2, 2, 2]),
                       4)
    assert tree == DraftTree((10, 12, 11, 14), (-1, 0, -1, 2))
    offsets, bits = tree.chunk_rows()
    assert offsets.tolist() == [0, 1, 2, 1, 2]
    assert bits.tolist() == [0b1, 0b11, 0b111, 0b1001, 0b11001]
    assert tree.pruned(2) == DraftTree((10, 12), (-1, 0)) and tree.children() == [[1, 3], [2], [], [4], []]
    assert tree.heights() == [2, 1, 0, 1, 0]
    assert tree.longest_path(5) == [0, 1, 2] and tree.longest_path(1) == [0, 1]
    deeper = DraftTree((10, 11, 12), (-1, -1, 1))  # the root's best child is a leaf: the path goes via the other
    assert deeper.longest_path(3) == [0, 2, 3]
    # the walk follows the samples: root samples 11 (node 2 = row 3), which samples 14 (row 4), which ends it
    assert walk(tree, [11, 0, 0, 14, 99]) == [0, 3, 4]
    assert walk(tree, [99, 0, 0, 0, 0]) == [0]


def test_equal_scores_keep_a_parent_before_its_child() -> None:
    tree = select_tree(np.array([0.0, 0.0, -1.0]), np.array([5, 6, 7]), np.array([-1, 0, 1]), np.array([1, 2, 3]), 2)
    assert tree == DraftTree((5, 6), (-1, 0))


def test_a_search_feeds_each_frontier_node_its_own_ancestors() -> None:
    """The drafter's tree steps, with a scripted drafter: token 3's two children beat every other candidate, so
    both nodes of the last frontier descend from the first frontier's node 0 (not one from each): their masks name
    that node and themselves, they take its hidden row, sit at depth 2's position and in the next scratch slots."""
    from appliance.engine.sampling_params import SamplingParams as Params
    from appliance.executor.request_table import RequestState
    from appliance.executor.tree_drafting import TreeDrafter

    v = 8
    prefs = {3: {1: 0.0, 2: -0.5}, 5: {6: -3.0, 7: -3.5}, 1: {4: -0.2, 0: -0.3}, 2: {4: -0.1, 7: -0.4}}
    seen: list[tuple[list[int], list[int], Any, list[float]]] = []

    def logits_of(tokens: list[int]) -> torch.Tensor:
        out = torch.full((len(tokens), v), -20.0)
        for r, t in enumerate(tokens):
            for c, lp in prefs[t].items():
                out[r, c] = lp
        return out

    def step(tokens: torch.Tensor, positions: torch.Tensor, meta: Any, hidden: torch.Tensor) -> Any:
        seen.append((tokens.tolist(), positions.tolist(), meta, hidden[:, 0].tolist()))
        return logits_of(tokens.tolist()), tokens[:, None].float().expand(-1, 4) + 100.0  # pre row: its token

    state = RequestState("r", list(range(10)), 5, 9, [7, 3, 8, 2, 6], Params())
    first = torch.full((1, v), -20.0)
    first[0, 3], first[0, 5] = 0.0, -1.0
    drafter = TreeDrafter(2, 3, 6, 4, torch.device("cpu"))
    tree, = drafter.draft(step, [state], first, [9], torch.full((1, 4), 7.0), None)
    (t2, p2, m2, h2), (t3, p3, m3, h3) = seen
    assert t2 == [3, 5] and p2 == [9, 9] and h2 == [7.0, 7.0]  # depth 1, the catch-up's hidden row
    assert m2.tree.tree_mask.tolist() == [0b01, 0b10] and m2.tree.tree_width.tolist() == [2]
    assert t3 == [1, 2] and p3 == [10, 10] and h3 == [103.0, 103.0]  # both under token 3: its pre row
    assert m3.tree.tree_mask.tolist() == [0b0101, 0b1001] and m3.tree.tree_width.tolist() == [4]
    assert m3.prefill_seq_lens.tolist() == [13]
    bs, blocks = 4, state.block_ids
    assert m3.slot_mapping.tolist() == [blocks[k // bs] * bs + k % bs for k in (11, 12)]
    # cumulative log-probabilities: 3 -0.31, 1 -0.79, 2 -1.29, 5 -1.31, 4 under 1 -1.43, 0 under 1 -1.53, 6 under 5
    # -1.79, 4 under 2 -1.84: the best 6
    assert tree == DraftTree((3, 1, 2, 5, 4, 0), (-1, 0, 0, -1, 1, 1))


def test_a_tree_chunk_runs_at_depths_in_its_own_slots_under_its_mask() -> None:
    """A step's inputs with a decode, a plain chunk and a tree verification (the root and three nodes, one of them
    a grandchild): the tree's rows take positions start + depth and slots start + row, the prefill rows their
    masks (none for the plain chunk)."""
    from appliance.engine.sampling_params import SamplingParams as Params
    from appliance.executor.input_batch import Chunk, build_inputs
    from appliance.executor.request_table import RequestState

    def state(rid: str, n: int, blocks: list[int]) -> RequestState:
        return RequestState(rid, list(range(100, 100 + n)), 2, 0, blocks, Params())

    tree = DraftTree((7, 8, 9), (-1, 0, -1))
    chunks = [Chunk(state("d", 6, [4, 5]), 5, 1, True), Chunk(state("p", 3, [9]), 0, 3, False),
              Chunk(state("t", 10, [1, 3, 2]), 6, 4, True, tree)]
    inputs = build_inputs(chunks, 4, torch.device("cpu"))
    assert inputs.positions.tolist() == [5, 0, 1, 2, 6, 7, 8, 7]
    assert inputs.meta.slot_mapping.tolist() == [5 * 4 + 1, 36, 37, 38, 3 * 4 + 2, 3 * 4 + 3, 2 * 4, 2 * 4 + 1]
    assert inputs.meta.tree.tree_width.tolist() == [0, 4]
    assert inputs.meta.tree.tree_mask.tolist()[3:] == [0b1, 0b11, 0b111, 0b1001]
    padded = build_inputs(chunks + [Chunk(state("q", 4, [11]), 0, 2, False)], 4, torch.device("cpu"),
                          pad_prefills=True)  # a GPU runner's: three prefills padded to four sequences
    assert padded.meta.tree.tree_width.tolist() == [0, 4, 0, 0]
    assert padded.meta.tree.tree_mask.shape[0] == 3 + 4 + 2  # one per prefill row
    with pytest.raises(ValueError, match="cannot verify a tree of 3 nodes"):
        build_inputs([Chunk(state("t", 10, [1, 3, 2]), 5, 5, True, tree)], 4, torch.device("cpu"))


def test_random_rows_emit_the_targets_distribution() -> None:
    """Random rows: every emitted token is a sample of the target's distribution given the tokens before it, so a
    verification's emitted sequence has the probability of sampling it token by token (synthetic distributions
    per path; the tree holds tokens 0 and 1 under the root and 2 under 0)."""
    from appliance.engine.sampling_params import SamplingParams as Params
    from appliance.executor.request_table import RequestState
    from appliance.executor.sampler import SampleResult
    from appliance.executor.tree_verification import verify_trees

    gen = torch.Generator().manual_seed(0)
    table = {(): [0.4, 0.3, 0.2, 0.1], (0,): [0.1, 0.2, 0.5, 0.2], (1,): [0.25, 0.25, 0.25, 0.25],
             (0, 2): [0.7, 0.1, 0.1, 0.1]}

    def sample(logits: torch.Tensor, rows: list[Any]) -> list[SampleResult]:
        return [SampleResult(int(torch.multinomial(torch.tensor(table[tuple(r.path)]), 1, generator=gen)))
                for r in rows]

    tree = DraftTree((0, 1, 2), (-1, -1, 0))
    counts: dict[tuple[int, ...], int] = {}
    n = 20000
    for _ in range(n):
        state = RequestState("r", [9, 9, 0, 1, 2], 2, 1, [0], Params(temperature=1.0))
        (kept, _), = verify_trees(sample, torch.zeros(4, 4), [(state, tree)])
        key = tuple(x.token_id for x in kept)
        counts[key] = counts.get(key, 0) + 1

    def exact(seq: tuple[int, ...]) -> float:
        prob, path = 1.0, ()
        for t in seq:
            prob *= table[path][t]
            path = path + (t,)
        return prob

    assert sum(exact(k) for k in counts) == pytest.approx(1.0)  # only reachable sequences were emitted
    for key, c in counts.items():
        assert abs(c / n - exact(key)) < 4 * (exact(key) * (1 - exact(key)) / n) ** 0.5 + 1e-3, key


def test_an_accepted_path_moves_down_even_where_a_destination_is_another_source() -> None:
    """Path rows [0, 2, 3] of a chunk from position 6: row 2 moves to 1 across a block boundary while row 3 moves to
    2, the first move's source (an fp8 cache, moved as bytes; the hidden rows from the chunk's first row 10)."""
    from appliance.engine.sampling_params import SamplingParams as Params
    from appliance.executor.request_table import RequestState
    from appliance.executor.tree_verification import compact, path_moves

    state = RequestState("r", list(range(12)), 2, 6, [5, 2, 9], Params())
    moves, rows = path_moves(state, 6, 10, [0, 2, 3], 4)
    assert moves == [(9 * 4 + 0, 2 * 4 + 3), (9 * 4 + 1, 9 * 4 + 0)] and rows == [(12, 11), (13, 12)]
    cache = torch.randn(10, 4, 2, 3).to(torch.float8_e4m3fn)
    before = cache.view(torch.uint8).clone()
    hidden = torch.arange(20.0)[:, None].expand(20, 2).contiguous()
    compact(moves, [cache], rows, [hidden])
    after = cache.view(torch.uint8)
    assert torch.equal(after[2, 3], before[9, 0]) and torch.equal(after[9, 0], before[9, 1])
    assert torch.equal(after[9, 1:], before[9, 1:]) and torch.equal(after[:2], before[:2])
    assert torch.equal(after[2, :3], before[2, :3]) and not torch.equal(before[2, 3], before[9, 0])
    assert hidden[:, 0].tolist()[10:14] == [10.0, 12.0, 13.0, 13.0]
