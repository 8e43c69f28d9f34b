"""A deterministic, pure-Python stand-in for the model workers, for tests of the engine and the runtime.

It keeps per-request state exactly as a real worker must (token ids, num_computed, block table) and applies
each StepPlan delta, asserting that the plan is consistent with that state: new requests are new, block
tables are exactly as long as the computed tokens need, sampling happens only at the end of the known tokens,
and nothing writes into a block another live request reads. It also simulates the KV cache: each slot holds
(token id, position) of the token written there, and before "attention" every position a request reads is
checked, which catches wrong prefix-cache hits, lost blocks and blocks shared while being written. The host
tier's copies (StepPlan.host_copies) move those slot contents between blocks and host slots, so a wrong load is
caught the same way.

The "model" is `next_token(history) -> token id`, a pure function of the request's tokens, so a request's
output must not depend on batching, chunking, preemption or prefix caching.

With num_speculative_tokens = k > 0 it also plays an MTP worker (engine/speculation.py): after every sample it
holds drafts (the first `draft_quality(request_id, num_tokens)` of them right, the rest wrong; fewer than k
when the draft chain would write past the block table or max_model_len, as the real worker), checks that a
plan verifies no more than it holds, writes the drafts' KV, and returns the accepted drafts plus one token.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from appliance.engine.disk_tier import FETCH, SPILL
from appliance.engine.host_tier import STORE
from appliance.engine.kv_groups import first_live_block
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.speculation import drafts_allowed
from appliance.engine.step import Executor, SampledToken, StepPlan, StepResult


class PlanViolation(AssertionError):
    """The plan contradicts what a worker holding per-request state knows."""


def default_next_token(vocab_size: int) -> Callable[[Sequence[int]], int]:
    def next_token(history: Sequence[int]) -> int:
        acc = len(history)
        for i, t in enumerate(history[-8:]):
            acc = (acc * 1_000_003 + (i + 1) * (t + 7)) % (1 << 61)
        return (acc * 2_654_435_761 >> 7) % vocab_size

    return next_token


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_table: list[int]
    sampling: dict
    prompt_logprobs: list = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    num_confirmed: int = 0  # len(token_ids) before this step's provisional drafts
    num_tokens: int = 0  # this step's chunk: the plan's, less the drafts it asked for beyond those held
    window_tables: list[list[int]] = field(default_factory=list)  # one per sliding-window group


class FakeExecutor(Executor):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        next_token: Callable[[Sequence[int]], int] | None = None,
        verify_kv: bool = True,
        num_speculative_tokens: int = 0,
        max_model_len: int = 1 << 62,
        draft_quality: Callable[[str, int], int] | None = None,
        window_sizes: Sequence[int] = (),
        window_blocks: Sequence[int] = (),
        overlap: bool = False,
        draft_count: Callable[[str, int], int] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.next_token = next_token or default_next_token(vocab_size)
        self.verify_kv = verify_kv
        self.vocab_size = vocab_size
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        # the engine plans a step before the previous one's result (overlap mode): a plan may ask for more
        # drafts than are held, and the worker verifies those it holds
        self.overlap = overlap
        # how many drafts it proposes at most, given (request id, its token count), as an n-gram lookup that
        # finds a shorter match (None: k)
        self.draft_count = draft_count
        self._clamped: dict[str, int] = {}  # this step's StepResult.verified
        # how many of a request's drafts are right, given (request id, its token count): by default a mix
        self.draft_quality = draft_quality or (lambda rid, n: (n * 7 + len(rid)) % (num_speculative_tokens + 1))
        self.state: dict[str, _WorkerRequest] = {}
        self.kv: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        # sliding-window groups (engine/kv_groups.py): each its window, and its own blocks' slots; window_blocks
        # all 0: the groups share the full group's blocks, so one table's block in another's shows as lost KV
        self.windows = tuple(window_sizes)
        shared = bool(window_blocks) and not any(window_blocks)
        self.window_kv = ([self.kv] * len(self.windows) if shared
                          else [[[None] * block_size for _ in range(n)] for n in window_blocks])
        self.host: dict[int, list[tuple[int, int] | None]] = {}  # host slot -> a block's slots (host tier)
        self.disk: dict[int, list[tuple[int, int] | None]] = {}  # disk slot -> a block's slots (disk tier)
        self.plans: list[StepPlan] = []
        self.shut_down = False

    def _fail(self, msg: str) -> None:
        raise PlanViolation(msg)

    def _held(self, tier: dict[int, list[tuple[int, int] | None]], slot: int, step: int,
              what: str) -> list[tuple[int, int] | None]:
        if slot not in tier:
            self._fail(f"step {step}: {what} {slot}, which holds nothing")
        return list(tier[slot])

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        split = len(plan.host_copies) - plan.host_writes
        writes = plan.host_copies[split:]
        if split < 0 or any(c[0] not in (STORE, SPILL) for c in writes):
            self._fail(f"step {plan.step_id}: {plan.host_writes} write-through copies of {plan.host_copies}")
        self._copy(plan.step_id, plan.host_copies[:split])
        result = self._step(plan)
        self._copy(plan.step_id, writes)  # after the step's KV writes: a store of a block it rewrote is caught
        return result

    def _copy(self, step: int, copies: list[tuple[int, int, int]]) -> None:
        for direction, block, slot in copies:
            if direction == SPILL:  # (SPILL, disk slot, host slot), (FETCH, disk slot, host slot): the disk tier
                self.disk[block] = self._held(self.host, slot, step, "spills host slot")
            elif direction == FETCH:
                self.host[slot] = self._held(self.disk, block, step, "fetches disk slot")
            elif direction == STORE:
                self.host[slot] = list(self.kv[block])
            else:
                self.kv[block] = self._held(self.host, slot, step, "loads host slot")

    def _step(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_ids:
            if self.state.pop(rid, None) is None:
                self._fail(f"step {plan.step_id}: told to forget unknown request {rid!r}")
        for nr in plan.new_requests:
            if nr.request_id in self.state:
                self._fail(f"step {plan.step_id}: new request {nr.request_id!r} is already known")
            if not 0 <= nr.num_computed_tokens < len(nr.token_ids):
                self._fail(f"{nr.request_id!r}: num_computed {nr.num_computed_tokens} of {len(nr.token_ids)}")
            # a prefix hit is whole blocks, a swapped request's restore (engine/swap.py) may end inside one: either
            # way every position read is checked against the request's own tokens below
            if len(nr.window_block_ids) != len(self.windows):
                self._fail(f"{nr.request_id!r}: {len(nr.window_block_ids)} window tables, {len(self.windows)} groups")
            self.state[nr.request_id] = _WorkerRequest(
                list(nr.token_ids), nr.num_prompt_tokens, nr.num_computed_tokens, list(nr.block_ids), nr.sampling,
                window_tables=[list(t) for t in nr.window_block_ids]
            )
        new_ids = {nr.request_id for nr in plan.new_requests}
        seen: set[str] = set()
        for s in plan.scheduled:
            w = self.state.get(s.request_id)
            if w is None:
                self._fail(f"step {plan.step_id}: scheduled unknown request {s.request_id!r}")
            if s.request_id in seen:
                self._fail(f"step {plan.step_id}: {s.request_id!r} scheduled twice")
            seen.add(s.request_id)
            if s.request_id in new_ids and s.new_block_ids:
                self._fail(f"{s.request_id!r}: a new request carries its blocks in NewRequestData")
            new = s.new_block_ids  # the full table's, then as many for each sliding-window group
            n, rest = divmod(len(new), 1 + len(self.windows))
            if rest:
                self._fail(f"{s.request_id!r}: {len(new)} new block ids for {1 + len(self.windows)} tables")
            w.block_table.extend(new[:n])
            for g, table in enumerate(w.window_tables, 1):
                table.extend(new[g * n:(g + 1) * n])
            if any(len(t) != len(w.block_table) for t in w.window_tables):
                self._fail(f"{s.request_id!r}: window tables {[len(t) for t in w.window_tables]} long, "
                           f"the full table {len(w.block_table)}")
            end = w.num_computed + s.num_tokens
            w.num_confirmed = len(w.token_ids)
            drafts = end - len(w.token_ids) if s.sample else 0
            if drafts > 0:  # a verification: the drafts become provisional tokens of this step
                if drafts > len(w.drafts):
                    if not self.overlap:
                        self._fail(f"{s.request_id!r}: verifies {drafts} drafts, the worker holds {len(w.drafts)}")
                    end, drafts = end - drafts + len(w.drafts), len(w.drafts)
                    self._clamped[s.request_id] = drafts
                w.token_ids.extend(w.drafts[:drafts])
            if s.num_tokens < 1 or end > len(w.token_ids):
                self._fail(f"{s.request_id!r}: computes {s.num_tokens} tokens from {w.num_computed}, "
                           f"knows {len(w.token_ids)}")
            blocks, least = len(w.block_table), -(-end // self.block_size)
            # the lookahead past the chunk, rejected drafts' blocks, and in overlap mode the plan's optimism
            slack = (3 if self.overlap else 2) * self.k
            if blocks < least or blocks > (-(-(end + slack) // self.block_size) if self.k else least):
                self._fail(f"{s.request_id!r}: {len(w.block_table)} blocks for {end} tokens")
            if s.sample != (end == len(w.token_ids)):
                self._fail(f"{s.request_id!r}: sample={s.sample} with {end} of {len(w.token_ids)} tokens")
            w.num_tokens = end - w.num_computed
        self._check_tables(plan)
        return self._run(plan)

    def _check_tables(self, plan: StepPlan) -> None:
        owner: dict[int, str] = {}
        for rid, w in self.state.items():
            if len(set(w.block_table)) != len(w.block_table):
                self._fail(f"{rid!r}: block table repeats a block: {w.block_table}")
            for b in w.block_table:
                if not 0 <= b < self.num_blocks:
                    self._fail(f"{rid!r}: block id {b} out of range")
        # A block written in this step must belong to the writer alone.
        for s in plan.scheduled:
            w = self.state[s.request_id]
            first = w.num_computed // self.block_size
            last = (w.num_computed + w.num_tokens - 1) // self.block_size
            for b in w.block_table[first : last + 1]:
                if b in owner:
                    self._fail(f"block {b} written by {owner[b]!r} and {s.request_id!r} in one step")
                owner[b] = s.request_id
        for rid, w in self.state.items():
            shared = [b for b in w.block_table if b in owner and owner[b] != rid]
            if shared:
                self._fail(f"{rid!r} holds block(s) {shared} that another request writes this step")
        for g in range(len(self.windows)):
            self._check_window_tables(plan, g)

    def _check_window_tables(self, plan: StepPlan, g: int) -> None:
        """A sliding group's live entries (from the oldest key the request's next query reads on; the engine
        released the ones before, which other requests may own now): no null entry where a key is, and a block
        written in this step belongs to its writer alone."""
        bs, window = self.block_size, self.windows[g]
        live = {rid: w.window_tables[g][first_live_block(w.num_computed, window, bs):]
                for rid, w in self.state.items()}
        owner: dict[int, str] = {}
        for s in plan.scheduled:
            w = self.state[s.request_id]
            first = w.num_computed // bs
            for b in w.window_tables[g][first:(w.num_computed + w.num_tokens - 1) // bs + 1]:
                if b in owner:
                    self._fail(f"window {window}: block {b} written by {owner[b]!r} and {s.request_id!r}")
                owner[b] = s.request_id
        for rid, blocks in live.items():
            if not all(0 < b < len(self.window_kv[g]) for b in blocks):
                self._fail(f"{rid!r}: window {window} table's live entries {blocks} hold a null or unknown block")
            shared = [b for b in blocks if b in owner and owner[b] != rid]
            if shared:
                self._fail(f"{rid!r} reads window {window} block(s) {shared} that another request writes")

    def _run(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        sampled: list[SampledToken] = []
        prompt_lps: dict[str, list] = {}
        for s in plan.scheduled:  # all KV writes of the step happen before any read, like store_kv per layer
            w = self.state[s.request_id]
            for p in range(w.num_computed, w.num_computed + w.num_tokens):
                self.kv[w.block_table[p // bs]][p % bs] = (w.token_ids[p], p)
                for kv, table in zip(self.window_kv, w.window_tables):
                    kv[table[p // bs]][p % bs] = (w.token_ids[p], p)
        for s in plan.scheduled:
            w = self.state[s.request_id]
            end = w.num_computed + w.num_tokens
            if self.verify_kv:
                for p in range(end):
                    got = self.kv[w.block_table[p // bs]][p % bs]
                    if got != (w.token_ids[p], p):
                        self._fail(f"{s.request_id!r}: KV at position {p} holds {got}, "
                                   f"expected {(w.token_ids[p], p)}")
                self._verify_windows(s.request_id, w, end)
            if w.sampling.get("prompt_logprobs") is not None:
                lo, hi = w.num_computed, min(end, w.num_prompt_tokens)
                prompt_lps[s.request_id] = [
                    None if p == 0 else [(w.token_ids[p], self._logprob(w.token_ids[p]))] for p in range(lo, hi)
                ]
            w.num_computed = end
            if s.sample:
                for tok in self._verify(w):
                    k = w.sampling.get("logprobs")
                    top = [(tok + i, self._logprob(tok + i)) for i in range(k)] if k else None
                    sampled.append(SampledToken(s.request_id, tok, self._logprob(tok) if k is not None else None,
                                                top))
                if self.k:
                    self._draft(s.request_id, w)
        drafts = {s.request_id: len(self.state[s.request_id].drafts) for s in plan.scheduled
                  if s.sample and self.k and self.state[s.request_id].drafts}
        clamped, self._clamped = self._clamped, {}
        return StepResult(plan.step_id, sampled, prompt_lps, drafts, clamped)

    def _verify_windows(self, rid: str, w: _WorkerRequest, end: int) -> None:
        """Every key a query of the chunk reads in a sliding group (the last W positions) holds its token."""
        bs = self.block_size
        for window, kv, table in zip(self.windows, self.window_kv, w.window_tables):
            for k in range(max(0, w.num_computed - window + 1), end):
                got = kv[table[k // bs]][k % bs]
                if got != (w.token_ids[k], k):
                    self._fail(f"{rid!r}: window {window} KV at position {k} holds {got}, "
                               f"expected {(w.token_ids[k], k)}")

    def _verify(self, w: _WorkerRequest) -> list[int]:
        """Tokens after a sampling chunk: the provisional drafts the model agrees with, then its own token."""
        drafts = w.token_ids[w.num_confirmed :]
        del w.token_ids[w.num_confirmed :]
        out: list[int] = []
        for d in drafts + [None]:
            tok = self.next_token(w.token_ids)
            w.token_ids.append(tok)
            out.append(tok)
            if tok != d:
                break
        w.num_computed -= len(drafts) + 1 - len(out)  # the rejected drafts' KV is stale
        return out

    def _draft(self, rid: str, w: _WorkerRequest) -> None:
        w.drafts = []
        if not drafts_allowed(SamplingParams.from_dict(dict(w.sampling))):
            return
        # draft j >= 2 writes the drafter's KV at num_computed + j - 2: it must fit the table and the model
        limit = min(len(w.block_table) * self.block_size, self.max_model_len)
        held = 1 + sum(1 for j in range(2, self.k + 1) if w.num_computed + j - 2 < limit)
        if self.draft_count is not None:
            held = min(held, self.draft_count(rid, len(w.token_ids)))
        good = self.draft_quality(rid, len(w.token_ids))
        history = list(w.token_ids)
        for i in range(held):
            tok = self.next_token(history)
            history.append(tok)
            w.drafts.append(tok if i < good else (tok + 1) % self.vocab_size)

    @staticmethod
    def _logprob(token_id: int) -> float:
        return -0.125 * (token_id % 13)

    def shutdown(self) -> None:
        self.shut_down = True


def reference_generation(
    next_token: Callable[[Sequence[int]], int],
    prompt: Sequence[int],
    max_tokens: int | None,
    max_model_len: int,
    eos_token_ids: frozenset[int] = frozenset(),
    stop_token_ids: Sequence[int] = (),
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> tuple[list[int], str]:
    """What one request generates when run alone, token by token: the oracle for engine tests.

    Written from the spec (vLLM's stop rules), independently of Request.append_output.
    """
    history = list(prompt)
    out: list[int] = []
    room = max_model_len - len(prompt)
    cap = max(1, room if max_tokens is None else min(max_tokens, room))
    while True:
        tok = next_token(history)
        history.append(tok)
        out.append(tok)
        stoppable = len(out) >= min_tokens
        if stoppable and (tok in stop_token_ids or (not ignore_eos and tok in eos_token_ids)):
            return out, "stop"
        if len(out) >= cap:
            return out, "length"
