"""Speculative decoding, the engine's side (pure Python): which requests verify drafts, and the counters.

Drafts live on the workers (a chain per request, or with eagle_topk > 1 a tree of num_draft_tokens - 1 nodes: k
counts its nodes, a verification's chunk is its root and nodes, and the tokens emitted follow one accepted path, so
at most num_steps + 1; executor/tree_verification.py). After every step that samples a request, a worker proposes
up to `num_speculative_tokens` (k) draft tokens for it (executor/speculative.py: MTP, EAGLE, a draft model, n-gram
lookup), keeps them and reports how many it holds (StepResult.drafts, kept in Request.num_drafts_held); the next
step verifies d <= that many: the scheduler schedules the decode with num_tokens = 1 + d (and KV blocks for that
lookahead plus the positions the worker's next draft chain writes: lookahead_tokens), and the worker answers with 1
to d + 1 SampledTokens of the request, in order (the accepted drafts, then the target's own token at the first
mismatch or after the last draft). The scheduler applies them one by one under every stop rule and moves
num_computed by the count.

Overlap mode (scheduler.enable_overlap): step N+1 is planned before step N's count is known. A verification in
flight counts as 1 + d pending tokens (all accepted), so N+1's chunk starts after them, asks for up to k drafts
and takes blocks for that end; the worker, which finishes N before it runs N+1, verifies the drafts it holds
(fewer: StepResult.verified) from where N really ended, and update() rewinds num_computed by N+1's planned d.
Greedy and seeded outputs are what the synchronous loop gives; only how many drafts a step verifies differs.

A request with structured outputs verifies drafts under its grammar (executor/logits_processors.py
mask_drafts: row j masked as after the first j drafts, the matcher rolled back afterwards). One with a thinking
budget (a processor without rollback) gets no drafts: it decodes one token per step, as without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from appliance.engine.request import Request, RequestStatus
from appliance.engine.sampling_params import SamplingParams

# SamplingParams.extra keys of logits processors that cannot follow drafts that may be rejected (no rollback)
PROCESSOR_KEYS = ("thinking_budget",)


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether workers draft for this request and the scheduler lets it verify drafts."""
    extra = params.extra
    return not (extra and any(k in extra for k in PROCESSOR_KEYS))


def num_drafts(req: Request, k: int) -> int:
    """Drafts the workers hold for a decoding request that it may verify now (0 without speculation, k = 0)."""
    pending = req.num_pending
    # with a step in flight (overlap mode) the drafts held after it are not known yet: plan for k, and the
    # workers verify the drafts they hold, at most these (executor/speculative.py)
    held = (k if drafts_allowed(req.sampling_params) else 0) if pending else req.num_drafts_held
    # (a request whose last prompt chunk is in flight decodes next: the workers draft after that chunk)
    if not k or not held or (req.status is not RequestStatus.DECODING and not pending):
        return 0
    # every accepted draft and the bonus token must fit max_tokens and max_model_len, after the optimistic
    # pending tokens (every draft in flight accepted)
    room = min(req.max_output_tokens - req.num_output_tokens, req.max_model_len - req.num_tokens) - pending - 1
    return max(0, min(k, held, room))


def table_tokens(req: Request, start: int, n: int, lookahead: int) -> int:
    """Tokens the block table must cover for a chunk of n tokens from start: the chunk, plus the `lookahead`
    positions past it that the workers' drafter writes after a chunk that samples (EngineConfig.spec_lookahead)."""
    end = start + n
    if lookahead > 0 and end >= req.num_tokens + req.num_pending and drafts_allowed(req.sampling_params):
        return max(end, min(end + lookahead, req.max_model_len))
    return end


def drafter_reads_next_token(algorithm: str | None) -> bool:
    """Whether the drafter's cache at a position depends on the token after it (MTP and EAGLE heads: row i reads
    the token at i + 1), so a prefix hit cannot reuse the drafter's cache at the hit's last position; a draft
    model's cache (row i reads the token at i) and n-gram lookup (no cache) have no such position."""
    return algorithm in ("MTP", "EAGLE", "EAGLE3")


def lookahead_tokens(algorithm: str | None, k: int) -> int:
    """Positions past a sampling chunk that a chain of k drafts writes into the drafter's cache: k - 1 for MTP
    and EAGLE (row i reads the token at i + 1), k for a draft model (row i reads the token at i: the sampled
    token's own row comes first), none for n-gram lookup (no cache) or without speculation."""
    if algorithm is None or algorithm == "NGRAM" or k == 0:
        return 0
    return k - 1 if drafter_reads_next_token(algorithm) else k


def tree_scratch_tokens(algorithm: str, topk: int, num_steps: int) -> int:
    """Positions past a sampling chunk a draft tree's search writes into the drafter's cache (eagle_topk > 1;
    executor/tree_drafting.py): topk per step after the first, from the first draft's position (one further for
    a draft model, as for its chain)."""
    return topk * (num_steps - 1) + (0 if drafter_reads_next_token(algorithm) else 1)


@dataclass
class SpecCounters:
    """Cumulative over the engine's life (vLLM's spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens
    / _num_accepted_tokens_per_pos). Emitted tokens of verifications = accepted + one per verification."""

    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: verifications that accepted draft j

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if num_accepted > len(self.accepted_per_pos):
            self.accepted_per_pos += [0] * (num_accepted - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def as_tuple(self) -> tuple[int, int, int]:
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
