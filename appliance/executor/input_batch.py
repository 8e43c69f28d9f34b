"""Worker-side request state and the flat varlen inputs of one step.

Rows of one step: every one-token request first (decode attention), then the multi-token chunks (prefill
attention over the paged cache, including any cached prefix). Token t of a request lives in cache slot
block_ids[t // block_size] * block_size + t % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.layers.attention import AttentionMetadata


@dataclass
class RequestState:
    """What a worker remembers about a request between steps (mutable: it grows every step)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_ids: list[int]
    params: SamplingParams
    prompt_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(frozen=True)
class Chunk:
    """One request's share of a step: tokens [start, start + num_tokens) and whether to sample after it."""

    state: RequestState
    start: int
    num_tokens: int
    sample: bool

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.state.params.prompt_logprobs is not None and self.start < self.state.num_prompt_tokens


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    chunks: list[Chunk]  # in row order
    row_starts: list[int]  # first row of each chunk


def _block_table(chunks: list[Chunk], device: torch.device) -> torch.Tensor:
    width = max((len(c.state.block_ids) for c in chunks), default=0) or 1
    table = torch.zeros(len(chunks), width, dtype=torch.int32)
    for i, c in enumerate(chunks):
        if c.state.block_ids:
            table[i, : len(c.state.block_ids)] = torch.tensor(c.state.block_ids, dtype=torch.int32)
    return table.to(device)


def build_inputs(chunks: list[Chunk], block_size: int, device: torch.device) -> StepInputs:
    """Order chunks decode-first and flatten them into one batch of rows."""
    decodes = [c for c in chunks if c.num_tokens == 1]
    prefills = [c for c in chunks if c.num_tokens > 1]
    ordered = decodes + prefills
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    row_starts: list[int] = []
    for c in ordered:
        end = c.start + c.num_tokens
        need = (end + block_size - 1) // block_size
        if len(c.state.block_ids) < need:
            raise RuntimeError(f"request {c.state.request_id!r}: {end} tokens need {need} blocks, its table has "
                               f"{len(c.state.block_ids)}")
        row_starts.append(len(ids))
        ids.extend(c.state.token_ids[c.start : end])
        positions = range(c.start, end)
        pos.extend(positions)
        slots.extend(c.state.block_ids[p // block_size] * block_size + p % block_size for p in positions)
    cu = [0]
    for c in prefills:
        cu.append(cu[-1] + c.num_tokens)
    i32 = {"dtype": torch.int32, "device": device}
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decode_tokens=len(decodes),
        decode_block_tables=_block_table(decodes, device),
        decode_seq_lens=torch.tensor([c.start + 1 for c in decodes], **i32),
        prefill_cu_seqlens=torch.tensor(cu, **i32),
        prefill_seq_lens=torch.tensor([c.start + c.num_tokens for c in prefills], **i32),
        prefill_block_tables=_block_table(prefills, device),
    )
    return StepInputs(torch.tensor(ids, dtype=torch.int64, device=device),
                      torch.tensor(pos, dtype=torch.int64, device=device), meta, ordered, row_starts)
