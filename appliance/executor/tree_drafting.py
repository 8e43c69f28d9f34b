"""Draft trees from a drafter with a model (EAGLE, EAGLE-3, a standalone draft model), as EAGLE and SGLang build
them (speculative.eagle_topk = k > 1, num_steps, num_draft_tokens).

The catch-up's last row gives each request's first logits: the root's top k children are the first frontier.
Each further step feeds the frontier's k nodes to the drafter (`draft_step`, all requests in one forward) and
takes the top k children of each, k * k candidates, of which the k best by cumulative log-probability are the
next frontier. Every candidate of every step may join the tree: the num_draft_tokens - 1 best of them form it
(draft_tree.select_tree). The drafter's tree steps run eagerly (no CUDA graphs), as prefill rows under a tree
mask: the nodes fed so far sit in scratch slots after the request's confirmed positions (key index first_pos +
fed index), each at position first_pos + depth - 1, and a fed node sees the drafter's cached prefix, its fed
ancestors and itself. The scratch slots are overwritten by the next catch-up, which recomputes the confirmed
positions, so the drafter's cache after a verification is the one a chain leaves. The whole search stays on the
device; the candidates come back in one copy at the end.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from appliance.executor.draft_tree import DraftTree, select_tree
from appliance.executor.input_batch import padded_count
from appliance.executor.request_table import RequestState
from appliance.layers.attention import AttentionMetadata, TreeMask

# (tokens [R], positions [R], metadata, the drafter's hidden rows or None) -> (its logits [R, V'], hidden rows)
DraftStep = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, Any], tuple[torch.Tensor, Any]]


class TreeDrafter:
    """The tree search of a speculator's drafter (its `draft_step`): eagle_topk, num_steps and the nodes a tree
    keeps (num_draft_tokens - 1)."""

    def __init__(self, topk: int, num_steps: int, num_nodes: int, block_size: int, device: torch.device,
                 pad_sequences: bool = False) -> None:
        self.topk, self.num_steps, self.num_nodes = topk, num_steps, num_nodes
        self.block_size, self.device = block_size, device
        # pad a tree step's sequence count as a step's prefills are (input_batch.padded_count: empty sequences),
        # so the prefill kernel's variants recur (the runner's pad_prefills)
        self.pad_sequences = pad_sequences

    def scratch(self) -> int:
        """Slots the tree steps write past a request's first tree position (the fed nodes)."""
        return self.topk * (self.num_steps - 1)

    def draft(self, step: DraftStep, states: list[RequestState], logits: torch.Tensor, first_pos: list[int],
              hidden: Any, id_map: torch.Tensor | None) -> list[DraftTree]:
        """Each state's tree after `logits` (the drafter's first row per state, its own vocabulary; `id_map`: to
        the target's); `hidden` the drafter's rows its first tree step takes (None: token ids only)."""
        k, b = self.topk, len(states)
        top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        scores, tokens = top.values, self._ids(top.indices, id_map)  # [B, k]
        cand = [(scores, tokens, torch.full((b, k), -1, dtype=torch.int64, device=logits.device), 1)]
        front_ids = torch.arange(k, device=logits.device).expand(b, k)
        fed_bits = (torch.ones(1, dtype=torch.int64, device=logits.device) << torch.arange(k, device=logits.device)
                    ).expand(b, k)
        rows = None if hidden is None else hidden[:, None].expand(b, k, hidden.shape[-1])
        offset = k
        for i in range(2, self.num_steps + 1):
            meta, positions = self._meta(states, first_pos, i, fed_bits)
            out, pre = step(tokens.reshape(-1), positions, meta, None if rows is None else rows.reshape(b * k, -1))
            child = torch.log_softmax(out.float(), dim=-1).topk(k, dim=-1)
            child_scores = (scores[:, :, None] + child.values.view(b, k, k)).view(b, k * k)
            child_tokens = self._ids(child.indices, id_map).view(b, k * k)
            parents = front_ids[:, :, None].expand(b, k, k).reshape(b, k * k)
            cand.append((child_scores, child_tokens, parents, i))
            if i == self.num_steps:
                break
            best = child_scores.topk(k, dim=-1).indices  # [B, k]: the next frontier among the k * k
            via = torch.div(best, k, rounding_mode="floor")  # each one's parent in this frontier
            scores, tokens = child_scores.gather(1, best), child_tokens.gather(1, best)
            front_ids = offset + best
            own = torch.ones(1, dtype=torch.int64, device=logits.device) << ((i - 1) * k + torch.arange(
                k, device=logits.device))
            fed_bits = fed_bits.gather(1, via) | own
            if pre is not None:
                rows = pre.view(b, k, -1).gather(1, via[:, :, None].expand(b, k, pre.shape[-1]))
            offset += k * k
        return self._select(cand)

    @staticmethod
    def _ids(index: torch.Tensor, id_map: torch.Tensor | None) -> torch.Tensor:
        return index if id_map is None else id_map[index]

    def _meta(self, states: list[RequestState], first_pos: list[int], i: int, fed_bits: torch.Tensor
              ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Step i's inputs: each request's k frontier rows at position first_pos + i - 2, stored in the scratch
        slots first_pos + (i - 2) * k + j, seeing its prefix and the fed nodes its mask names."""
        k, bs, n = self.topk, self.block_size, len(states)
        width = (i - 1) * k  # nodes fed so far, these rows included
        first = np.asarray(first_pos, dtype=np.int64)
        keys = first[:, None] + (i - 2) * k + np.arange(k)[None, :]  # [B, k] key index of each row
        lens = first + width
        cols = int(-(-lens.max() // bs))
        table = np.zeros((n, cols), dtype=np.int64)
        for r, s in enumerate(states):
            blocks = s.block_array()[:cols]
            table[r, : blocks.shape[0]] = blocks
        slots = table[np.arange(n)[:, None], keys // bs] * bs + keys % bs
        host = np.concatenate([np.repeat(first + i - 2, k), slots.reshape(-1)])
        head = torch.from_numpy(host).to(self.device)
        m = padded_count(n) if self.pad_sequences else n
        pad = np.zeros(m - n, dtype=np.int64)
        cu = np.concatenate([np.arange(n + 1) * k, np.full(m - n, n * k)])
        table = np.concatenate([table, np.zeros((m - n, cols), dtype=np.int64)])
        small = torch.from_numpy(np.concatenate([cu, lens, pad, [width] * n, pad, table.reshape(-1)]
                                                ).astype(np.int32)).to(self.device)
        meta = AttentionMetadata(
            slot_mapping=head[n * k :], num_decode_tokens=0,
            decode_block_tables=small[:0].view(0, 1), decode_seq_lens=small[:0],
            prefill_cu_seqlens=small[: m + 1], prefill_seq_lens=small[m + 1 : 2 * m + 1],
            prefill_block_tables=small[3 * m + 1 :].view(m, cols),
            tree=TreeMask(fed_bits.reshape(-1).contiguous(), small[2 * m + 1 : 3 * m + 1]))
        return meta, head[: n * k]

    def _select(self, cand: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]) -> list[DraftTree]:
        """The best num_nodes candidates of each request (one copy of every candidate to the host)."""
        scores = torch.cat([c[0] for c in cand], dim=1).cpu().numpy()
        tokens = torch.cat([c[1] for c in cand], dim=1).cpu().numpy()
        parents = torch.cat([c[2] for c in cand], dim=1).cpu().numpy()
        depths = np.concatenate([np.full(c[0].shape[1], c[3]) for c in cand])
        n = min(self.num_nodes, scores.shape[1])
        return [select_tree(scores[r], tokens[r], parents[r], depths, n) for r in range(scores.shape[0])]


TREE_BACKENDS = ("torch", "triton")  # attention backends whose prefill kernel takes a tree mask


def make_tree_drafter(runner: Any) -> TreeDrafter | None:
    """The runner's tree drafter (None for chains: eagle_topk 1). Raises for a model whose attention cannot
    verify a tree: recurrent-state (hybrid) layers, sliding windows, MLA or a backend without the tree mask."""
    from appliance.layers.attention import Attention

    s = runner.config.speculative
    if s.eagle_topk == 1:
        return None
    why = None
    drafter = (runner.model.mtp_attention_layers() if s.algorithm == "MTP"
               else runner.draft_model.attention_layers() if runner.draft_model is not None else [])
    layers = runner.model.attention_layers() + drafter
    if runner.state_cache is not None:
        why = "its recurrent-state (linear attention) layers advance along one sequence, not a tree"
    elif not all(isinstance(x, Attention) for x in layers):
        why = "its attention (MLA) has no tree-mask kernel"
    elif any(x.sliding_window is not None for x in layers):
        why = "its sliding-window layers are not verified under a tree mask"
    elif any(x.backend not in TREE_BACKENDS for x in layers):
        why = f"its attention backend has no tree-mask kernel (backends.attention: {', '.join(TREE_BACKENDS)})"
    if why is not None:
        raise ValueError(f"speculative.eagle_topk={s.eagle_topk}: draft trees cannot run on "
                         f"{type(runner.model).__name__}: {why}; use eagle_topk = 1 (a chain)")
    return TreeDrafter(s.eagle_topk, s.num_steps, s.effective_num_draft_tokens - 1, runner.block_size, runner.device,
                       runner._pad_prefills)
