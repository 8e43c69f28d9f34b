"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the (padded) vocabulary."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from appliance.layers.linear import Gemv, matmul
from appliance.layers.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tp_all_gather,
    tp_all_reduce,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PAD_TO = 64  # vocab padded to a multiple of PAD_TO * tp so every shard has the same size


def _pad_vocab(vocab: int, tp_size: int) -> int:
    step = PAD_TO * tp_size
    return (vocab + step - 1) // step * step


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_padded = _pad_vocab(num_embeddings, self.tp_size)
        self.shard_size = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding of shape {tuple(loaded.shape)} does not match vocab {self.num_embeddings} "
                             f"x {param.shape[1]}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projection to vocabulary logits; shares its weight with the embedding when embeddings are tied."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.gemv: Gemv | None = None  # linear.use_gemv_kernel binds one
        self.skinny: Gemv | None = None  # and this, where the backend has a skinny GEMM
        self.tied = False  # shares the embedding's weight (of_model)

    @classmethod
    def of_model(cls, hf_config: PretrainedConfig, embedding: VocabParallelEmbedding,
                 tie_default: bool = False) -> ParallelLMHead:
        """A model's head, tied to its embedding where hf_config.tie_word_embeddings says so (tie_default where
        the config is silent); `tied` tells the weight loader there is no lm_head.weight to read."""
        head = cls(hf_config.vocab_size, hf_config.hidden_size)
        head.tied = bool(getattr(hf_config, "tie_word_embeddings", tie_default))
        if head.tied:
            head.tie_to(embedding)
        return head

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [N, vocab] (gathered across ranks, padding cut off)."""
        logits = tp_all_gather(matmul(hidden, self.weight, None, self.gemv, self.skinny), dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.compute_logits(hidden)
