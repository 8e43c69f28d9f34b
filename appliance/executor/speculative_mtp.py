"""MTP drafting (DeepSeek-V3 family, GLM-4.5, Qwen3-Next / Qwen3.5): the model's own multi-token-prediction layer, its own latent cache on the
same block table (executor/speculative.py runs the step and verification).

1. catch-up: the MTP layer runs over the chunk's positions whose tokens are now confirmed (row i: the target's
   final hidden state at i and the token at i + 1), so its own KV cache holds every computed position
   (prefix-cached blocks included); its last row drafts the first token;
2. chain: num_steps - 1 more one-token steps of the same MTP layer, each on the previous step's draft and hidden
   state (before the MTP head's norm, as vLLM chains it), at the next position.
Drafts are the MTP head's argmax, or draws of its distribution for random unseeded requests
(speculative_rejection.py); with eagle_topk > 1, trees of the same steps (tree_drafting.py) where the model's
attention takes a tree mask (not MLA, not linear attention).
"""
from __future__ import annotations

from typing import Any

import torch

from appliance.executor.catch_up_graphs import make_catch_up_graphs
from appliance.executor.draft_graphs import make_chain_graphs
from appliance.executor.input_batch import Chunk
from appliance.executor.speculative import Speculator


def mtp_attention_layers(model: Any) -> list[Any]:
    """The MTP layers' attention, whose caches the runner allocates beside the model's. Raises for a model
    without MTP layers."""
    layers = model.mtp_attention_layers() if hasattr(model, "mtp_attention_layers") else []
    if not layers:
        raise ValueError(f"speculative.algorithm=MTP needs multi-token-prediction layers; {type(model).__name__} "
                         "has none (DeepSeek-V3 / GLM-4.5 with num_nextn_predict_layers >= 1, Qwen3-Next / Qwen3.5 "
                         "whose config declares one, from a checkpoint that keeps them: transformers' "
                         "save_pretrained drops them)")
    return layers


class MtpSpeculator(Speculator):
    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.model = runner.model
        if self.tree is None:  # trees draft eagerly (tree_drafting.py)
            self.chains = make_chain_graphs(self, int(runner.hf_config.hidden_size), self.model, runner.backend)
        self.catch_up_graphs = make_catch_up_graphs(self, self.catch_up_source(), int(runner.hf_config.hidden_size), 1)

    def catch_up_source(self) -> torch.Tensor | None:
        """The verify graphs' output: the target's final hidden states."""
        return self.verify_graphs.hidden if self.verify_graphs is not None else None

    def draft_step(self, tokens: torch.Tensor, positions: torch.Tensor, meta: Any, hidden: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.model.mtp_forward(tokens, positions, hidden, meta)
        return self.model.mtp_logits(h), h

    def _propose(self, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
                 emitted: dict[str, int], verifying: dict[str, int]) -> None:
        """MTP catch-up over every chunk's confirmed positions, then the draft chain for sampled requests."""
        if self.propose_on_graphs(chunks, row_starts, emitted, verifying):
            return
        device = hidden.device
        inputs, input_ids, take = self.shifted_inputs(chunks, row_starts, emitted, verifying, device)
        h = self.model.mtp_forward(input_ids, inputs.positions, hidden[take], inputs.meta)
        states, rows = self.last_rows(inputs)
        if not states:
            return
        h = h[rows]
        self.chain(states, self.model.mtp_logits(h), [s.num_computed for s in states], h)
