"""Speculative decoding on a worker: the step, verification and the per-request drafts; the drafters propose
(speculative_mtp.py: the model's MTP layers; speculative_ngram.py: prompt lookup; speculative_draft.py: a
standalone draft model, EAGLE and EAGLE-3 heads). engine/speculation.py has the scheduler's side.

One step, for a plan whose decodes verify drafts (a decode of 1 + d tokens: the last confirmed token and d of
the drafts this worker holds for the request):
1. target forward over every chunk (decodes with drafts are multi-token chunks: prefill attention);
2. scoring: plain sampling rows as in ModelRunner; a verification samples all of its d + 1 rows with the
   normal sampler, row j as if the first j drafts were confirmed, and keeps the longest prefix of rows whose
   sample equals their draft, plus the first sample that differs (or the bonus sample after the last draft;
   speculative_verification.py).
   A greedy draft is one token, not a distribution, and with a one-hot draft x this is exactly rejection
   sampling: x is accepted with probability p(x), and a rejection emits a sample of p with x removed,
   renormalised. So every emitted token is distributed as the target's; greedy rows, seeded rows (their noise
   is keyed on the tokens generated so far) and the GPU fast path (keyed on the same count) emit exactly what
   they emit without drafts, and logprobs are the target's for each emitted token. Structured-output rows are
   masked as after the drafts before them (a draft the grammar refuses is rejected); thinking-budget requests
   get no drafts. Random unseeded requests of a drafter with a distribution draw their drafts from it and are
   verified against it instead (min(1, p/q) acceptance; speculative_rejection.py);
3. proposal (the drafter's `_propose`): the drafter catches up over the chunk's confirmed positions and drafts up
   to num_steps tokens for each request that sampled; the result reports how many it holds (StepResult.drafts),
   and the next plan verifies at most that many. Above speculative.disable_by_batch_size sampling rows a step
   drafts nothing (a drafter with a cache still catches up, so its cache stays whole).
With speculative.synthetic_acceptance_* (benchmarks only) step 2's accept decision is forced (speculative_forced.py).
With eagle_topk > 1 the drafts of a request are a tree (draft_tree.py): drafted by tree_drafting.py, verified by
tree_verification.py (the walk down the tree, then the accepted path moved to consecutive slots and rows), eagerly.
On a GPU steps 1 and 3 replay CUDA graphs: verification steps as decode rows (verify_graphs.py), the drafter's
catch-up after them (catch_up_graphs.py) and the draft chain (draft_graphs.py); a step whose verifications are all
decided on the device queues steps 2 and 3 before the host reads anything (device_proposal.py: one wait per step),
and with overlap the next verification of the same requests is queued before that read (verify_ahead.py).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from appliance.engine.step import ScheduledRequest, StepPlan, StepResult
from appliance.executor import state_cache
from appliance.executor.device_proposal import (
    Proposal,
    launch_proposal,
    proposes_on_device,
    read_proposal,
)
from appliance.executor.inflight import StepHandle
from appliance.executor.input_batch import Chunk, Stager
from appliance.executor.speculative_drafts import Drafting
from appliance.executor.speculative_forced import ForcedAcceptance
from appliance.executor.speculative_scoring import Scored, Scoring
from appliance.executor.speculative_states import StateRollback
from appliance.executor.tree_drafting import make_tree_drafter
from appliance.executor.tree_verification import compact, path_moves
from appliance.executor.verify_ahead import launch_ahead, launches_ahead, settle
from appliance.executor.verify_graphs import make_verify_graphs

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig
    from appliance.executor.model_runner import ModelRunner

SUPPORTED_ALGORITHMS = ("MTP", "NGRAM", "STANDALONE", "EAGLE", "EAGLE3")


def check_settings(config: ApplianceConfig) -> None:
    """Start-up refusals for speculative settings this worker cannot honour (config only; the models are
    checked when they are built)."""
    s = config.speculative
    if s.algorithm is None:
        return
    if s.algorithm not in SUPPORTED_ALGORITHMS:
        raise ValueError(f"speculative.algorithm={s.algorithm!r} is not supported by this build (supported: "
                         f"{', '.join(SUPPORTED_ALGORITHMS)})")
    if s.eagle_topk > 1:
        check_tree_settings(config)
    elif s.effective_num_draft_tokens != s.num_steps + 1:
        raise ValueError(f"speculative.num_draft_tokens={s.num_draft_tokens}: a chain of num_steps="
                         f"{s.num_steps} verifies num_steps + 1 = {s.num_steps + 1} tokens; set that or leave it unset")


def check_tree_settings(config: ApplianceConfig) -> None:
    """Draft trees: drafters with a model, the synchronous loop, masks of at most MAX_TREE_ROWS rows."""
    from appliance.executor.draft_tree import MAX_TREE_ROWS, num_candidates

    s = config.speculative
    if s.algorithm not in ("EAGLE", "EAGLE3", "STANDALONE", "MTP"):
        raise ValueError(f"speculative.eagle_topk={s.eagle_topk}: draft trees are drafted by EAGLE, EAGLE3, "
                         f"STANDALONE and MTP; {s.algorithm} proposes one chain (set eagle_topk = 1)")
    if config.overlap_enabled():
        raise ValueError(f"speculative.eagle_topk={s.eagle_topk}: draft trees run the synchronous loop; set "
                         "scheduler.enable_overlap = false (or leave it unset) or use eagle_topk = 1")
    nodes = s.effective_num_draft_tokens - 1
    if not 1 <= nodes <= num_candidates(s.eagle_topk, s.num_steps):
        raise ValueError(f"speculative.num_draft_tokens={s.effective_num_draft_tokens}: a tree search of "
                         f"eagle_topk={s.eagle_topk}, num_steps={s.num_steps} offers 1 to "
                         f"{num_candidates(s.eagle_topk, s.num_steps)} nodes besides the root")
    if s.effective_num_draft_tokens > MAX_TREE_ROWS or s.eagle_topk * (s.num_steps - 1) > MAX_TREE_ROWS:
        raise ValueError(f"speculative.num_draft_tokens={s.effective_num_draft_tokens} and eagle_topk * "
                         f"(num_steps - 1) = {s.eagle_topk * (s.num_steps - 1)} must be at most {MAX_TREE_ROWS} "
                         "(a tree mask row is one 64-bit word)")


def load_drafter(config: ApplianceConfig, runner: ModelRunner) -> torch.nn.Module | None:
    """The separate draft model or head of STANDALONE / EAGLE / EAGLE3 (None otherwise), loaded beside the
    runner's model before the KV cache is sized."""
    check_settings(config)
    if config.speculative.algorithm not in ("STANDALONE", "EAGLE", "EAGLE3"):
        return None
    from appliance.executor.speculative_draft import load_draft_model

    return load_draft_model(config, runner)


def draft_attention_layers(config: ApplianceConfig, model: torch.nn.Module,
                           drafter: torch.nn.Module | None) -> list[Any]:
    """The drafter's attention layers, whose KV caches the runner allocates beside the model's (same block
    table, same budget; a layout unlike the target's gets caches of its own shape); [] without speculative
    decoding or for NGRAM. Raises for a model without MTP layers."""
    algorithm = config.speculative.algorithm
    if algorithm is None or algorithm == "NGRAM":
        return []
    if algorithm == "MTP":
        from appliance.executor.speculative_mtp import mtp_attention_layers

        return mtp_attention_layers(model)
    return drafter.attention_layers()


def make_speculator(runner: ModelRunner) -> Speculator | None:
    """The speculator of runner.config.speculative.algorithm (None without speculative decoding)."""
    algorithm = runner.config.speculative.algorithm
    if algorithm is None:
        return None
    if algorithm == "MTP":
        from appliance.executor.speculative_mtp import MtpSpeculator

        return MtpSpeculator(runner)
    if algorithm == "NGRAM":
        from appliance.executor.speculative_ngram import NgramSpeculator

        return NgramSpeculator(runner)
    from appliance.executor.speculative_draft import (
        DraftModelSpeculator,
        EagleSpeculator,
    )

    return DraftModelSpeculator(runner) if algorithm == "STANDALONE" else EagleSpeculator(runner)


@dataclass(frozen=True)
class LaunchedStep:
    """What a launched step's completion needs: decided on the host (scored) or in flight (proposal)."""

    plan: StepPlan
    chunks: list[Chunk]  # as the forward ran them
    clamped: dict[str, int]
    scored: Scored | None
    proposal: Proposal | None = None
    after: int | None = None  # launched ahead of this step's read (verify_ahead.py): its chunks are provisional


class Speculator(Scoring, Drafting):
    """Runs StepPlans for a ModelRunner with speculative decoding (ModelRunner.launch hands them here);
    subclasses implement `_propose`, which fills `self.drafts` for the requests that sampled."""

    def __init__(self, runner: ModelRunner) -> None:
        # a proxy, not a reference: runner.spec -> self -> runner would be a cycle, which only the collector frees,
        # and under a process-wide gc.freeze (runtime/gc_heap.py) never: the engine's GPU memory would leak
        self.runner = weakref.proxy(runner)
        s = runner.config.speculative
        self.num_steps = int(s.num_steps)
        self.disable_above: int | None = s.disable_by_batch_size
        self.forced = ForcedAcceptance.from_section(s, runner.config.model.seed)
        self._drafts, self._pending, self.draft_probs = {}, None, {}
        self.drafting = True
        # overlap mode: a plan may ask for more drafts than the previous step left (engine/speculation.py)
        self.overlapped = runner.config.overlap_enabled()
        self._chain_stager = Stager(runner.device)  # the rows a chain starts from
        self._index_stager = Stager(runner.device)  # the drafter's row indices
        self._verdict_stager = Stager(runner.device)  # device verification's layout (device_verification.py)
        self.tree = make_tree_drafter(runner)  # None: drafts are chains
        self.trees = {}
        # verification steps as decode rows, from CUDA graphs on a GPU (None: the multi-token path; trees)
        self.verify_graphs = make_verify_graphs(runner, self.num_steps) if self.tree is None else None
        self.chains, self.catch_up_graphs = None, None  # set by drafters with a model
        self._verified_on_graphs = False
        self.recomputed = 0  # hybrid targets: verifications recomputed after a rejection (speculative_states.py)
        self._launched: LaunchedStep | None = None  # the latest step launched, while its proposal is unread
        self._last_read = -1  # the step id of the latest step read
        self._settled_steps: dict[int, LaunchedStep] = {}  # steps launched ahead, settled, not read yet

    # ---- the step ----------------------------------------------------------------------------------------
    def launch(self, plan: StepPlan) -> StepHandle:
        """A step up to its first read: one decided and drafted on the device (device_proposal.py) comes back in
        flight, read by `complete_step` when the runner finishes it (before the next launch at the latest); any
        other step comes back complete."""
        r = self.runner
        for rid in plan.finished_ids:
            r.requests.pop(rid, None)
            self._forget(rid)
        for new in plan.new_requests:
            r.requests[new.request_id] = r._new_state(new)
            self._forget(new.request_id)
        state_cache.restore_snapshots(r.state_cache, plan, r.requests)
        verifying: dict[str, int] = {}  # request id -> drafts its chunk verifies
        clamped: dict[str, int] = {}  # the same, where fewer than the plan asked (StepResult.verified)
        chunks = [self._chunk(s, verifying, clamped) for s in plan.scheduled]
        if not chunks:
            return StepHandle(plan.step_id, StepResult(plan.step_id))
        sampling = sum(1 for c in chunks if c.sample)
        self.drafting = self.disable_above is None or sampling <= self.disable_above
        with torch.inference_mode():
            rollback = StateRollback.of(r.state_cache, chunks, verifying)  # hybrid targets (speculative_states.py)
            ordered, row_starts, hidden = self._forward(chunks)
            if rollback is None and proposes_on_device(self, ordered, verifying):
                proposal = launch_proposal(self, ordered, row_starts, hidden, verifying)
                return self._in_flight(LaunchedStep(plan, ordered, clamped, None, proposal))
            scored = self._score_and_propose(ordered, row_starts, hidden, verifying, rollback)
        return StepHandle(plan.step_id, self.complete_step(LaunchedStep(plan, ordered, clamped, scored)))

    def launch_ahead(self, plan: StepPlan) -> StepHandle | None:
        """`plan` launched before the step in flight is read, where nothing of it needs that read
        (verify_ahead.py); None: the caller finishes the step in flight and launches the plan as usual."""
        previous = self._launched
        if previous is not None and previous.after is not None and previous.after == self._last_read:
            previous = self._launched = self._settled(previous)  # the step before it was read: real chunks
        if not launches_ahead(self, plan, previous):
            return None
        assert previous is not None
        self.drafting = True
        copier = self.runner.host_copier  # the plan has no copies: the stream waits for earlier write-throughs
        copier.submit(plan.host_copies, plan.host_writes)
        copier.wait_all()
        with torch.inference_mode():
            proposal = launch_ahead(self, plan, previous)
        return self._in_flight(LaunchedStep(plan, [c for c, _ in proposal.verifications], {}, None, proposal,
                                            after=previous.plan.step_id))

    def _in_flight(self, step: LaunchedStep) -> StepHandle:
        self._launched = step
        return StepHandle(step.plan.step_id, event=step.proposal.event if step.proposal else None,
                          completion=lambda: self.complete_step(step))

    def _settled(self, step: LaunchedStep) -> LaunchedStep:
        """A step launched ahead with its real chunks, once the step before it was read (settled once)."""
        if step.after is None:
            return step
        done = self._settled_steps.get(step.plan.step_id)
        if done is None:
            if step.after != self._last_read:
                raise RuntimeError(f"step {step.plan.step_id} was launched ahead of step {step.after}, unread")
            assert step.proposal is not None
            proposal = settle(self, step.proposal)
            done = replace(step, chunks=[c for c, _ in proposal.verifications], proposal=proposal, after=None)
            self._settled_steps[step.plan.step_id] = done
        return done

    def complete_step(self, step: LaunchedStep) -> StepResult:
        """A launched step's result; a proposal on the device is read first (the step's one wait)."""
        step = self._settled(step)
        self._settled_steps.pop(step.plan.step_id, None)
        if self._launched is not None and self._launched.plan.step_id == step.plan.step_id:
            self._launched = None
        self._last_read = step.plan.step_id
        r, scored = self.runner, step.scored
        if step.proposal is not None:
            scored = Scored(*read_proposal(self, step.proposal))
            for c in step.chunks:
                c.state.num_computed += scored.emitted[c.state.request_id]
        assert scored is not None
        state_cache.save_snapshots(r.state_cache, step.plan, r.requests)
        order = {s.request_id: i for i, s in enumerate(step.plan.scheduled)}
        scored.sampled.sort(key=lambda t: order[t.request_id])  # stable: a request's tokens stay in order
        held: dict[str, int] = {}
        for c in step.chunks:
            n = self._held(c.state.request_id) if c.sample else 0
            if n:
                held[c.state.request_id] = n
        return StepResult(step.plan.step_id, scored.sampled, scored.prompt_logprobs, held, step.clamped)

    def _score_and_propose(self, ordered: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
                           verifying: dict[str, int], rollback: StateRollback | None) -> Scored:
        """Scoring read on the host, then the drafter's proposal from the emitted counts."""
        scored = self._score(ordered, row_starts, hidden, verifying)
        if scored.paths:
            self._compact(ordered, row_starts, hidden, scored.paths)
        verified = list(ordered)  # as the forward ran them (before num_computed moves)
        for c in ordered:  # a verification keeps the KV of its confirmed positions only
            rid = c.state.request_id
            c.state.num_computed += scored.emitted[rid] if rid in verifying else c.num_tokens
            self._forget(rid)
        self._propose(ordered, row_starts, hidden, scored.emitted, verifying)
        if rollback is not None:
            self.recomputed += rollback.roll_back(verified, scored.emitted, verifying, self.runner._forward)
        return scored

    def _forward(self, chunks: list[Chunk]) -> tuple[list[Chunk], list[int], torch.Tensor]:
        v = self.verify_graphs
        self._verified_on_graphs = False
        if v is not None and v.fits(chunks, self.num_steps + 1):
            got = v.run_step(chunks)
            if got is not None:
                self._verified_on_graphs = True
                return chunks, got[0], got[1]
        return self.runner._forward(chunks)

    def _propose(self, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
                 emitted: dict[str, int], verifying: dict[str, int]) -> None:
        raise NotImplementedError

    def _compact(self, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
                 paths: dict[str, list[int]]) -> None:
        """Accepted tree paths to consecutive slots (every target layer's KV) and rows (the hidden states, an
        EAGLE-3 target's captured rows), as a chain would have left them (tree_verification.py)."""
        r = self.runner
        moves: list[tuple[int, int]] = []
        rows: list[tuple[int, int]] = []
        for c, first in zip(chunks, row_starts):
            path = paths.get(c.state.request_id)
            if path is not None:
                m, w = path_moves(c.state, c.start, first, path, r.block_size)
                moves, rows = moves + m, rows + w
        caches = [t for layer in r.model.attention_layers() for t in layer.kv_cache()]
        aux = getattr(getattr(r.model, "model", None), "aux", None)
        compact(moves, caches, rows, [hidden] + ([aux.buffer] if aux is not None else []))

    def _chunk(self, s: ScheduledRequest, verifying: dict[str, int], clamped: dict[str, int]) -> Chunk:
        state = self.runner.requests.get(s.request_id)
        if state is None:
            raise KeyError(f"step schedules request {s.request_id!r}, which the worker does not know")
        state.block_ids.extend(s.new_block_ids)
        end = state.num_computed + s.num_tokens
        d = end - len(state.token_ids) if s.sample else 0
        if d > 0:  # a verification: the drafts become provisional tokens until scored
            held = self.drafts.get(s.request_id, [])
            if d > len(held):
                if not self.overlapped:
                    raise ValueError(f"request {s.request_id!r}: asked to verify {d} drafts, the worker holds "
                                     f"{len(held)}")
                # planned before the previous step's outcome: verify what is held (the engine rewinds by the plan)
                end, d = end - d + len(held), len(held)
                clamped[s.request_id] = d
            state.token_ids.extend(held[:d])
            if d:
                verifying[s.request_id] = d
        tree = self.trees[s.request_id].pruned(d) if d > 0 and s.request_id in self.trees else None
        if s.num_tokens < 1 or end > len(state.token_ids):
            raise ValueError(f"request {s.request_id!r}: cannot compute {s.num_tokens} tokens from "
                             f"{state.num_computed}; it has {len(state.token_ids)}")
        if s.sample and end != len(state.token_ids):
            raise ValueError(f"request {s.request_id!r}: asked to sample after token {end} of {len(state.token_ids)}")
        return Chunk(state, state.num_computed, end - state.num_computed, s.sample, tree)
