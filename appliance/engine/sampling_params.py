"""Per-request sampling parameters: vLLM's names and meanings, pure Python (no torch)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# A top_k this large keeps every token of any vocabulary, like top_k disabled; larger values are stored as it, so
# the samplers' int64 / int32 tensors hold every request's value (a top_k of 2**63 once crashed a worker).
TOP_K_ALL = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how. Field names follow vLLM's SamplingParams so user code can switch."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    top_n_sigma: float = 0.0  # 0: disabled; keep logits >= max - n * std
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token; 0 = only the sampled token's
    prompt_logprobs: int | None = None  # top logprobs per prompt position (the prompt token's own comes first)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit before sampling)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's request priority (lower is served first); vLLM passes it beside the params, here it travels with them.
    # Honoured by scheduler.policy = "slo"; the other policies refuse a non-zero one (scheduler.py add).
    priority: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # structured-output and parser settings travel here

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        # from_dict gets lists of pairs back from JSON / msgpack; keep one canonical, hashable form
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias or ()))
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.top_k > TOP_K_ALL:
            object.__setattr__(self, "top_k", TOP_K_ALL)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_n_sigma < 0:
            raise ValueError(f"top_n_sigma must be >= 0, got {self.top_n_sigma}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if any(t < 0 for t, _ in self.logit_bias):
            raise ValueError("logit_bias token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**d)
