"""MTP speculative decoding on a worker: drafting with the model's multi-token-prediction layer, verification,
and the per-request drafts (engine/speculation.py has the scheduler's side of the protocol).

One step, for a plan whose decodes verify drafts (a decode of 1 + d tokens: the last confirmed token and d of
the drafts this worker holds for the request):
1. target forward over every chunk (decodes with drafts are multi-token chunks: prefill attention, eager);
2. scoring: plain sampling rows as in ModelRunner; a verification samples all of its d + 1 rows with the
   normal sampler, row j as if the first j drafts were confirmed, and keeps the longest prefix of rows whose
   sample equals their draft, plus the first sample that differs (or the bonus sample after the last draft).
   With a one-hot (greedy) draft x this is exactly rejection sampling: x is accepted with probability p(x),
   and a rejection emits a sample of p with x removed, renormalised. So every emitted token is distributed as
   the target's; greedy rows, seeded rows (their noise is keyed on the tokens generated so far) and the GPU
   fast path (keyed on the same count) emit exactly what they emit without drafts, and logprobs are the
   target's for each emitted token. Rows with logits processors never verify drafts (the scheduler sees to it);
3. MTP catch-up: the MTP layer runs over the chunk's positions whose tokens are now confirmed (row i: the
   target's final hidden state at i and the token at i + 1), so its own KV cache holds every computed
   position (prefix-cached blocks included); its last row drafts the first token;
4. draft chain: num_steps - 1 more one-token steps of the same MTP layer, each on the previous step's draft and
   hidden state (before the MTP head's norm, as vLLM chains it),
   at the next position (the scheduler allocates blocks for them; a chain stops early at the block table's
   end or max_model_len, and the scheduler never asks for more drafts than that leaves).
Drafts are greedy (argmax of the MTP head). No CUDA graphs: every step here runs eager.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from appliance.engine.speculation import drafts_allowed
from appliance.engine.step import SampledToken, ScheduledRequest, StepPlan, StepResult
from appliance.executor import logits_processors
from appliance.executor.input_batch import Chunk
from appliance.executor.request_table import RequestState
from appliance.executor.sampler import SampleResult
from appliance.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig
    from appliance.executor.model_runner import ModelRunner

SUPPORTED_ALGORITHMS = ("MTP",)


def check_settings(config: ApplianceConfig) -> None:
    """Start-up refusals for speculative settings this worker cannot honour (config only; the model is
    checked by draft_attention_layers)."""
    s = config.speculative
    if s.algorithm is None:
        return
    if s.algorithm not in SUPPORTED_ALGORITHMS:
        raise ValueError(f"speculative.algorithm={s.algorithm!r} is not supported by this build (supported: "
                         f"{', '.join(SUPPORTED_ALGORITHMS)})")
    if s.eagle_topk != 1:
        raise ValueError(f"speculative.eagle_topk={s.eagle_topk}: MTP drafts one chain (eagle_topk = 1); draft "
                         "trees are not supported")
    if s.effective_num_draft_tokens != s.num_steps + 1:
        raise ValueError(f"speculative.num_draft_tokens={s.num_draft_tokens}: an MTP chain of num_steps="
                         f"{s.num_steps} verifies num_steps + 1 = {s.num_steps + 1} tokens; set that or leave it unset")
    if config.scheduler.enable_overlap:
        raise ValueError("speculative decoding runs with the synchronous engine loop; turn scheduler.enable_overlap "
                         "off")


def draft_attention_layers(config: ApplianceConfig, model: Any) -> list[Any]:
    """The drafter's attention layers, whose KV caches the runner allocates beside the model's (same block
    table, same budget); [] without speculative decoding. Raises for a model without MTP layers."""
    if config.speculative.algorithm is None:
        return []
    check_settings(config)
    layers = model.mtp_attention_layers() if hasattr(model, "mtp_attention_layers") else []
    if not layers:
        raise ValueError(f"speculative.algorithm=MTP needs multi-token-prediction layers; {type(model).__name__} "
                         "has none (DeepSeek-V3 family with num_nextn_predict_layers >= 1, from a checkpoint that "
                         "keeps them: transformers' save_pretrained drops them)")
    return layers


class _VerifyRow:
    """A verification row as the sampler sees a request: its history is the confirmed tokens plus the first
    `j` drafts (token lists are built only when a sampling path reads them)."""

    def __init__(self, state: RequestState, end: int) -> None:
        self.state, self.end = state, end
        self.request_id, self.params, self.noise_seed = state.request_id, state.params, state.noise_seed
        self.num_prompt_tokens = state.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids[: self.end]

    @property
    def output_ids(self) -> list[int]:
        return self.state.token_ids[self.num_prompt_tokens : self.end]

    @property
    def num_generated(self) -> int:
        return self.end - self.num_prompt_tokens


def accepted_length(samples: list[int], drafts: list[int]) -> int:
    """Tokens a verification emits: the samples up to and including the first that differs from its draft
    (all d + 1 when every draft matches)."""
    for j, d in enumerate(drafts):
        if samples[j] != d:
            return j + 1
    return len(drafts) + 1


def verify(sample: Callable[[torch.Tensor, list[Any]], list[SampleResult]], logits: torch.Tensor,
           requests: list[tuple[RequestState, int]]) -> list[list[SampleResult]]:
    """Verify drafts. Each request's token_ids end with its d provisional drafts and it owns d + 1 consecutive
    rows of `logits` (row j: the distribution after the first j drafts). Every row is sampled by `sample` (a
    BatchSampler) with the drafts before it as history; a request keeps the samples up to the first that differs
    from its draft (all d + 1 when none does). token_ids end with the kept samples afterwards."""
    rows = [_VerifyRow(state, len(state.token_ids) - d + j) for state, d in requests for j in range(d + 1)]
    results = sample(logits, rows)
    out: list[list[SampleResult]] = []
    pos = 0
    for state, d in requests:
        confirmed = len(state.token_ids) - d
        mine = results[pos : pos + d + 1]
        pos += d + 1
        n = accepted_length([x.token_id for x in mine], state.token_ids[confirmed:])
        del state.token_ids[confirmed:]
        state.token_ids.extend(x.token_id for x in mine[:n])
        out.append(mine[:n])
    return out


@dataclass
class _Scored:
    sampled: list[SampledToken]
    prompt_logprobs: dict[str, list[list[tuple[int, float]] | None]]
    emitted: dict[str, int]  # tokens emitted per sampling chunk


class MtpSpeculator:
    """Runs StepPlans for a ModelRunner whose model has MTP layers (ModelRunner.execute hands them here)."""

    def __init__(self, runner: ModelRunner) -> None:
        # a proxy, not a reference: runner.spec -> self -> runner would be a cycle, which only the collector frees,
        # and under a process-wide gc.freeze (runtime/gc_heap.py) never: the engine's GPU memory would leak
        self.runner = weakref.proxy(runner)
        self.model = runner.model
        self.num_steps = int(runner.config.speculative.num_steps)
        self.drafts: dict[str, list[int]] = {}

    # ---- the step ----------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        r = self.runner
        for rid in plan.finished_ids:
            r.requests.pop(rid, None)
            self.drafts.pop(rid, None)
        for new in plan.new_requests:
            r.requests[new.request_id] = r._new_state(new)
            self.drafts.pop(new.request_id, None)
        verifying: dict[str, int] = {}  # request id -> drafts its chunk verifies
        chunks = [self._chunk(s, verifying) for s in plan.scheduled]
        if not chunks:
            return StepResult(plan.step_id)
        with torch.inference_mode():
            ordered, row_starts, hidden = r._forward(chunks)
            scored = self._score(ordered, row_starts, hidden, verifying)
            for c in ordered:  # a verification keeps the KV of its confirmed positions only
                rid = c.state.request_id
                c.state.num_computed += scored.emitted[rid] if rid in verifying else c.num_tokens
            self._propose(ordered, row_starts, hidden, scored.emitted, verifying)
        order = {s.request_id: i for i, s in enumerate(plan.scheduled)}
        scored.sampled.sort(key=lambda t: order[t.request_id])  # stable: a request's tokens stay in order
        return StepResult(plan.step_id, scored.sampled, scored.prompt_logprobs)

    def _chunk(self, s: ScheduledRequest, verifying: dict[str, int]) -> Chunk:
        state = self.runner.requests.get(s.request_id)
        if state is None:
            raise KeyError(f"step schedules request {s.request_id!r}, which the worker does not know")
        state.block_ids.extend(s.new_block_ids)
        end = state.num_computed + s.num_tokens
        d = end - len(state.token_ids) if s.sample else 0
        if d > 0:  # a verification: the drafts become provisional tokens until scored
            held = self.drafts.get(s.request_id, [])
            if d > len(held) or not drafts_allowed(state.params):
                raise ValueError(f"request {s.request_id!r}: asked to verify {d} drafts, the worker holds "
                                 f"{len(held) if drafts_allowed(state.params) else 0}")
            state.token_ids.extend(held[:d])
            verifying[s.request_id] = d
        if s.num_tokens < 1 or end > len(state.token_ids):
            raise ValueError(f"request {s.request_id!r}: cannot compute {s.num_tokens} tokens from "
                             f"{state.num_computed}; it has {len(state.token_ids)}")
        if s.sample and end != len(state.token_ids):
            raise ValueError(f"request {s.request_id!r}: asked to sample after token {end} of {len(state.token_ids)}")
        return Chunk(state, state.num_computed, s.num_tokens, s.sample)

    # ---- scoring: plain samples and verifications ------------------------------------------------------
    def _score(self, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
               verifying: dict[str, int]) -> _Scored:
        r = self.runner
        rows: list[int] = []
        prompt_at: list[tuple[Chunk, int, int]] = []
        plain_at: list[tuple[Chunk, int]] = []
        verify_at: list[tuple[Chunk, int, int]] = []  # chunk, first index into rows, drafts
        for c, first in zip(chunks, row_starts):
            if c.wants_prompt_logprobs:  # row of position p scores prompt token p + 1
                count = max(min(c.start + c.num_tokens, c.state.num_prompt_tokens - 1) - c.start, 0)
                prompt_at.append((c, len(rows), count))
                rows.extend(range(first, first + count))
            if not c.sample:
                continue
            d = verifying.get(c.state.request_id, 0)
            last = first + c.num_tokens - 1
            if d:
                verify_at.append((c, len(rows), d))
            else:
                plain_at.append((c, len(rows)))
            rows.extend(range(last - d, last + 1))
        out = _Scored([], {}, {})
        if not rows:
            return out
        logits = r.logits(hidden, rows)
        out.prompt_logprobs = {c.state.request_id: r._prompt_logprobs(c, logits[i : i + n].float())
                               for c, i, n in prompt_at}
        if plain_at:
            at = torch.tensor([i for _, i in plain_at], device=logits.device)
            results = logits_processors.sample(r, logits[at], [c.state for c, _ in plain_at])
            for (c, _), res in zip(plain_at, results):
                c.state.token_ids.append(res.token_id)
                out.sampled.append(SampledToken(c.state.request_id, res.token_id, res.logprob, res.top_logprobs,
                                                res.rank))
                out.emitted[c.state.request_id] = 1
        if verify_at:
            self._verify(logits, verify_at, out)
        return out

    def _verify(self, logits: torch.Tensor, verify_at: list[tuple[Chunk, int, int]], out: _Scored) -> None:
        at = torch.tensor([i + j for _, i, d in verify_at for j in range(d + 1)], device=logits.device)
        # no logits processors here: requests that have them never verify drafts (engine/speculation.py)
        emitted = verify(self.runner.batch_sampler, logits[at], [(c.state, d) for c, _, d in verify_at])
        for (c, _, _), results in zip(verify_at, emitted):
            rid = c.state.request_id
            out.sampled += [SampledToken(rid, x.token_id, x.logprob, x.top_logprobs, x.rank) for x in results]
            out.emitted[rid] = len(results)

    # ---- drafting ----------------------------------------------------------------------------------------
    def _propose(self, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
                 emitted: dict[str, int], verifying: dict[str, int]) -> None:
        """MTP catch-up over every chunk's confirmed positions, then the draft chain for sampled requests."""
        r = self.runner
        mtp_chunks: list[Chunk] = []
        target_first: dict[str, int] = {}
        for c, first in zip(chunks, row_starts):
            rid = c.state.request_id
            # rows whose next token is confirmed: a verification's emitted count, every row of other chunks
            n = emitted[rid] if rid in verifying else c.num_tokens
            mtp_chunks.append(Chunk(c.state, c.start, n, c.sample))
            target_first[rid] = first
            self.drafts.pop(rid, None)
        inputs = r.host_inputs(mtp_chunks)
        ids: list[int] = []
        take: list[int] = []
        for c in inputs.chunks:
            ids += c.state.token_ids[c.start + 1 : c.start + c.num_tokens + 1]
            first = target_first[c.state.request_id]
            take += range(first, first + c.num_tokens)
        device = hidden.device
        input_ids = torch.from_numpy(np.asarray(ids, dtype=np.int64)).to(device)
        previous = hidden[torch.tensor(take, device=device)]
        h = self.model.mtp_forward(input_ids, inputs.positions, previous, inputs.meta)
        drafting = [(c, s + c.num_tokens - 1) for c, s in zip(inputs.chunks, inputs.row_starts)
                    if c.sample and drafts_allowed(c.state.params)]
        if not drafting:
            return
        last = torch.tensor([row for _, row in drafting], device=device)
        h = h[last]
        tokens = self.model.mtp_logits(h).argmax(dim=-1)
        states = [c.state for c, _ in drafting]
        steps = [tokens]
        alive = list(range(len(states)))  # indices into states still drafting
        for step in range(1, self.num_steps):
            pos = [states[i].num_computed + step - 1 for i in alive]
            keep = [j for j, i in enumerate(alive) if pos[j] < self._draft_limit(states[i])]
            if not keep:
                break
            if len(keep) < len(alive):
                sel = torch.tensor(keep, device=device)
                h, tokens = h[sel], tokens[sel]
                alive, pos = [alive[j] for j in keep], [pos[j] for j in keep]
            meta, positions = self._decode_meta([states[i] for i in alive], pos, device)
            h = self.model.mtp_forward(tokens, positions, h, meta)
            tokens = self.model.mtp_logits(h).argmax(dim=-1)
            steps.append(torch.full((len(states),), -1, dtype=torch.int64, device=device).index_copy_(
                0, torch.tensor(alive, device=device), tokens))
        table = torch.stack(steps, dim=1).tolist()  # the step's one read-back of drafts
        for state, row in zip(states, table):
            self.drafts[state.request_id] = [t for t in row if t >= 0]

    def _draft_limit(self, state: RequestState) -> int:
        """First position the chain may not write: past the block table or the model's length."""
        return min(len(state.block_ids) * self.runner.block_size, self.runner.max_model_len)

    def _decode_meta(self, states: list[RequestState], positions: list[int],
                     device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
        """Attention metadata of one-token rows at `positions` (the chain's drafts are not in token_ids)."""
        bs = self.runner.block_size
        width = max(len(s.block_ids) for s in states)
        tables = np.zeros((len(states), width), dtype=np.int32)
        for i, s in enumerate(states):
            tables[i, : len(s.block_ids)] = s.block_ids
        pos = np.asarray(positions, dtype=np.int64)
        slots = tables[np.arange(len(states)), pos // bs].astype(np.int64) * bs + pos % bs
        i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device), num_decode_tokens=len(states),
            decode_block_tables=i32(tables), decode_seq_lens=i32(pos + 1),
            prefill_cu_seqlens=torch.zeros(1, dtype=torch.int32, device=device),
            prefill_seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
            prefill_block_tables=torch.zeros((0, width), dtype=torch.int32, device=device))
        return meta, torch.from_numpy(pos).to(device)
