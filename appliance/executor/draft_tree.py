"""A request's draft tree (speculative.eagle_topk > 1): the nodes a drafter proposes, verified in one target forward.

The root is the request's last confirmed token (the one the target has not computed yet); every node is a draft
token whose parent is the root or another node. Nodes are kept best first by cumulative log-probability (the sum of
the drafter's log-probabilities along the path from the root), ties broken by depth, so every parent comes before
its children and any prefix of the nodes is a tree itself (`pruned`): a child's cumulative log-probability never
exceeds its parent's.

A verification runs the root and the nodes as one chunk of 1 + n rows, row i + 1 for node i, each in its own
cache slot (start + row) at position start + depth, under a tree mask: a row sees the cached prefix, its
ancestors and itself (`chunk_rows`; layers/attention.py TreeMask).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# a row's mask is one int64: a tree of the root and at most 63 nodes (and a drafter's tree step over at most 64)
MAX_TREE_ROWS = 64


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # the nodes' tokens (target ids), best first
    parents: tuple[int, ...]  # each node's parent among the nodes, -1: the root

    def __len__(self) -> int:
        return len(self.tokens)

    def pruned(self, n: int) -> DraftTree:
        """The best n nodes (a tree: parents come first)."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def depths(self) -> list[int]:
        """Each node's depth (1: a child of the root)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def chunk_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The verification chunk's rows (the root, then the nodes): position offsets from the chunk's start
        (depths, the root's 0) and tree masks (int64: bit j set where row j is the row's ancestor or itself)."""
        if len(self) + 1 > MAX_TREE_ROWS:
            raise ValueError(f"a draft tree of {len(self)} nodes does not fit a {MAX_TREE_ROWS}-bit mask")
        bits = [1]
        for i, p in enumerate(self.parents):
            bits.append(bits[p + 1] | (1 << (i + 1)))
        signed = [b - (1 << 64) if b >= 1 << 63 else b for b in bits]
        return np.asarray([0] + self.depths(), dtype=np.int64), np.asarray(signed, dtype=np.int64)

    def children(self) -> list[list[int]]:
        """Per chunk row (0: the root, i + 1: node i), its children's rows, best first."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i + 1)
        return out

    def heights(self) -> list[int]:
        """Per chunk row, the nodes on the longest path down from it (0 at a leaf)."""
        out = [0] * (len(self) + 1)
        for i in range(len(self) - 1, -1, -1):  # children come after their parents
            p = self.parents[i] + 1
            out[p] = max(out[p], out[i + 1] + 1)
        return out

    def longest_path(self, length: int) -> list[int]:
        """Rows of the first `length` nodes (at most) down the tree's longest root-to-leaf path, the best child
        among equally deep ones (the root's row 0 first): where a benchmark forces the accept decision."""
        kids, heights, rows = self.children(), self.heights(), [0]
        while len(rows) <= length and kids[rows[-1]]:
            rows.append(max(kids[rows[-1]], key=lambda c: (heights[c], -c)))
        return rows


def select_tree(scores: np.ndarray, tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray,
                n: int) -> DraftTree:
    """The tree of the n best candidates of one request (cumulative log-probabilities `scores`; `parents`: each
    candidate's parent candidate, -1: the root; a parent always precedes its children in the arrays)."""
    order = np.lexsort((np.arange(scores.shape[0]), depths, -scores))[:n]
    index = {int(c): i for i, c in enumerate(order)}
    out_parents = []
    for c in order:
        p = int(parents[c])
        if p >= 0 and p not in index:  # cannot happen (a parent scores at least its child and sorts first)
            raise AssertionError(f"draft tree candidate {int(c)} selected without its parent {p}")
        out_parents.append(index[p] if p >= 0 else -1)
    return DraftTree(tuple(int(tokens[c]) for c in order), tuple(out_parents))


def num_candidates(topk: int, num_steps: int) -> int:
    """Candidates a tree search of num_steps steps offers: topk children of the root, then topk children of
    each of the topk frontier nodes per further step."""
    return topk + (num_steps - 1) * topk * topk
