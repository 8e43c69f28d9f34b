"""Preemption by swap (scheduler.preemption_mode): what a preempted request's KV costs to keep or to rebuild.

A swapped request's computed blocks are copied to slots of the host tier (engine/host_tier.py) that it owns
until it resumes or ends; on resume the blocks a device prefix hit does not cover are copied back and its
computed tokens are restored, so nothing is prefilled twice. `recompute` frees the blocks and prefills the
request again (vLLM V1's only mode); `swap` always swaps while host slots are free; `auto` swaps when the copy
out and back is cheaper than the prefill it saves, both priced with rates the workers measured at start-up
(executor/swap_cost.py), never guessed.
"""
from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap", "auto")


@dataclass(frozen=True)
class SwapCosts:
    """Rates measured by the workers: host <-> device copy bandwidth and prefill throughput."""

    copy_gbps: float  # bytes per second / 1e9, a round trip of blocks device -> host -> device
    prefill_tok_s: float  # tokens per second of one prefill chunk of `prefill_tokens`
    prefill_tokens: int
    bytes_per_block: int  # KV bytes of one block over every layer (drafter's included), one rank
    context_s_per_token2: float = 0.0  # seconds more per token for each token of context before it (attention)

    def __post_init__(self) -> None:
        if not (self.copy_gbps > 0 and self.prefill_tok_s > 0 and self.bytes_per_block > 0
                and self.context_s_per_token2 >= 0):
            raise ValueError(f"swap costs must be positive measurements, got {self}")

    def swap_seconds(self, num_blocks: int) -> float:
        """Copying num_blocks out and back."""
        return 2 * num_blocks * self.bytes_per_block / (self.copy_gbps * 1e9)

    def recompute_seconds(self, num_tokens: int) -> float:
        """Prefilling num_tokens again from position 0: a per-token term and attention's, which grows with the
        context each token sees (n^2 / 2 token-context pairs)."""
        return num_tokens / self.prefill_tok_s + self.context_s_per_token2 * num_tokens * num_tokens / 2

    def break_even_tokens(self, block_size: int) -> float | None:
        """The computed tokens above which a swap costs less than a recompute (whole blocks; 0: always, None:
        never): per token, copying costs 2 x bytes / block_size / bandwidth, recomputing 1 / rate plus attention's
        share, which grows with n."""
        copy = 2 * self.bytes_per_block / block_size / (self.copy_gbps * 1e9)
        if copy < 1 / self.prefill_tok_s:
            return 0.0
        if self.context_s_per_token2 == 0:
            return None
        return 2 * (copy - 1 / self.prefill_tok_s) / self.context_s_per_token2

    def to_dict(self) -> dict[str, float | int]:
        return {"copy_gbps": self.copy_gbps, "prefill_tok_s": self.prefill_tok_s,
                "prefill_tokens": self.prefill_tokens, "bytes_per_block": self.bytes_per_block,
                "context_s_per_token2": self.context_s_per_token2}

    @classmethod
    def from_dict(cls, d: dict[str, float | int] | None) -> SwapCosts | None:
        if not d:
            return None
        return cls(float(d["copy_gbps"]), float(d["prefill_tok_s"]), int(d["prefill_tokens"]),
                   int(d["bytes_per_block"]), float(d.get("context_s_per_token2", 0.0)))


@dataclass(frozen=True)
class SwapPolicy:
    """Whether a preempted request is swapped, per request."""

    mode: str
    costs: SwapCosts | None  # required by auto

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode {self.mode!r} is not one of {PREEMPTION_MODES}")
        if self.mode == "auto" and self.costs is None:
            raise ValueError("preemption mode auto needs the workers' measured copy and prefill rates")

    def swaps(self, num_computed_tokens: int, num_blocks: int) -> bool:
        if self.mode == "recompute" or num_computed_tokens == 0:
            return False
        if self.mode == "swap":
            return True
        assert self.costs is not None
        return self.costs.swap_seconds(num_blocks) < self.costs.recompute_seconds(num_computed_tokens)
