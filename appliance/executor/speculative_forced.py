"""The benchmark-only forced accept decision (speculative.synthetic_acceptance_length / _rates, refused unless
speculative.enable_synthetic_acceptance): with dummy weights drafts are never right, so a benchmark forces how
many drafts a verification keeps, as vLLM's synthetic rejection mode, SGLang's SGLANG_SIMULATE_ACC_LEN and
TensorRT-LLM's forced accepted tokens do. The drafter and the verify forward still run; only the decision is
replaced, so the step costs what it costs with real drafts of that acceptance."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForcedAcceptance:
    length: float | None  # mean tokens kept per verification (accepted drafts + 1)
    rates: tuple[float, ...] | None  # per-position acceptance probabilities, given the drafts before were kept
    rng: random.Random = field(repr=False, default_factory=random.Random)

    @classmethod
    def from_section(cls, s: Any, seed: int) -> ForcedAcceptance | None:
        length, rates = s.synthetic_acceptance_length, s.synthetic_acceptance_rates
        if length is None and rates is None:
            return None
        if not s.enable_synthetic_acceptance:  # the config check refuses this too; never force by accident
            raise ValueError("speculative.synthetic_acceptance_* needs speculative.enable_synthetic_acceptance")
        return cls(length, tuple(rates) if rates is not None else None, random.Random(seed))

    def accepted(self, num_drafts: int) -> int:
        """Drafts to keep of a verification of num_drafts drafts."""
        if self.rates is not None:
            n = 0
            while n < num_drafts and self.rng.random() < self.rates[n]:
                n += 1
            return n
        assert self.length is not None
        mean = self.length - 1.0  # accepted drafts per verification: floor or ceil, mixed to this mean
        whole = math.floor(mean)
        return min(num_drafts, whole + (1 if self.rng.random() < mean - whole else 0))
