"""A verification step launched before the step in flight is read (overlap mode, device path).

A step decided and drafted on the device (device_proposal.py) leaves everything the next verification of the same
requests needs on the device: the verdict's last emitted token of each request (the correction or the bonus), the
chain's drafts (its static output, until the next chain launches) and each request's device length, which the
verdict set to the confirmed end, where the next chunk starts. So when plan N+1 verifies exactly the requests of
step N, the runner launches N+1 (verify graph, verdict, catch-up, chain) before it reads N: row j of a request
reads token j of [last emitted | drafts] on the device (the way decode rows read ids still in flight), the verify
graph places it at lens + j (no length correction is sent), the verdict takes the drafts from the device and each
chunk's start from the lengths, and the catch-up takes the verify graph's positions and slots. The host reads N
afterwards, as plain overlap's one-step lag does, and only then gives N+1's chunks their real starts (`settle`:
the drafts N+1 verified appended to each request's tokens, the chunk from its confirmed length), before N+1 is read.

Taken only where nothing of N+1 depends on N's outcome on the host: no request joins or leaves, every request of N
verifies again (1 + d tokens, d <= num_steps), greedy rows (a GPU sampler's noise is keyed on the count generated,
which N's read gives), no logits processors, no host-tier copies, every request of N drafted, and its chain kept
num_steps drafts wherever N ended (its limit past N's furthest end), so the d the plan asks for are held. Anything
else reads N first. A request N finishes still verifies in N+1 on the device; the engine drops those tokens.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.engine.speculation import drafts_allowed
from appliance.engine.step import StepPlan
from appliance.executor.batch_sampler import GREEDY, route
from appliance.executor.cuda_graph import padded_batch
from appliance.executor.device_proposal import Proposal, catch_up_and_chain, queued
from appliance.executor.device_verification import launch_verdict_ahead
from appliance.executor.input_batch import Chunk
from appliance.executor.logits_processors import wants_processors

if TYPE_CHECKING:
    from appliance.executor.speculative import LaunchedStep, Speculator


def launches_ahead(spec: Speculator, plan: StepPlan, previous: LaunchedStep | None) -> bool:
    """Whether `plan` runs ahead of `previous`, the step in flight (its proposal unread): see the module
    docstring. `previous` must be settled (its chunks' starts real)."""
    p = previous.proposal if previous is not None else None
    if (p is None or p.chain is None or previous.after is not None or plan.new_requests or plan.finished_ids
            or plan.host_copies or not plan.scheduled or spec.verify_graphs is None):
        return False
    rows, chain = p.chain
    verified = {c.state.request_id: c for c, _ in p.verifications}
    if len(plan.scheduled) != len(verified) or len(rows) != len(verified):
        return False
    if spec.disable_above is not None and len(plan.scheduled) > spec.disable_above:
        return False
    for s in plan.scheduled:
        c = verified.get(s.request_id)
        if c is None or s.request_id not in rows or not s.sample or not 2 <= s.num_tokens <= spec.num_steps + 1:
            return False
        if s.save_snapshot >= 0 or not _greedy_chain(spec, c, chain.limits[rows[s.request_id]]):
            return False
    return padded_batch(spec.verify_graphs.sizes, plan.num_tokens) is not None


def _greedy_chain(spec: Speculator, c: Chunk, limit: int) -> bool:
    """A request of the step in flight whose next verification needs nothing from its read: greedy from its
    first row on, no processors, drafting, and num_steps drafts kept wherever the step ends (at its chunk's end
    at the furthest)."""
    st = c.state
    return (route(st.params, c.start + 1 - st.num_prompt_tokens) == GREEDY and not wants_processors(st.params.extra)
            and drafts_allowed(st.params) and limit - (c.start + c.num_tokens) >= spec.num_steps - 1)


def launch_ahead(spec: Speculator, plan: StepPlan, previous: LaunchedStep) -> Proposal:
    """Queue plan's verification (verify graph, verdict, catch-up, chain) behind `previous`, nothing read. The
    proposal's chunks start where `previous` ends at the furthest (provisional: `settle` gives the real ones)."""
    r, p, vg = spec.runner, previous.proposal, spec.verify_graphs
    assert p is not None and p.chain is not None and vg is not None
    k1 = spec.num_steps + 1
    before = {c.state.request_id: (b, c) for b, (c, _) in enumerate(p.verifications)}
    chunks: list[Chunk] = []
    for s in plan.scheduled:
        c = before[s.request_id][1]
        c.state.block_ids.extend(s.new_block_ids)
        chunks.append(Chunk(c.state, c.start + c.num_tokens, s.num_tokens, True))
    held = [c.num_tokens - 1 for c in chunks]
    # each request's next tokens on the device: its last emitted one, then its chain's drafts (a copy: the chain
    # below overwrites the chain's output)
    rows, chain = p.chain
    assert chain.out is not None
    v = p.verdict
    ahead = torch.cat([v.tokens.gather(1, (v.counts - 1).view(-1, 1)), chain.out[: len(rows)]], dim=1)
    order = [rows[c.state.request_id] for c, _ in p.verifications]
    if order != list(range(len(order))):
        raise RuntimeError("the chain's rows are not the verdict's (every request of the step drafts, in order)")
    n = plan.num_tokens
    index = [before[c.state.request_id][0] * k1 + j for c in chunks for j in range(c.num_tokens)]
    sent = spec._index_stager.send(np.asarray(index + [before[c.state.request_id][0] for c in chunks],
                                              dtype=np.int64))
    ids = ahead.reshape(-1)[sent[:n]]
    got = vg.run_step(chunks, lambda key: vg.buf[:n].copy_(ids), ahead=True)
    if got is None:
        raise RuntimeError("a verification launched ahead found no verify graph (launches_ahead checked its rows)")
    row_starts, hidden = got
    spec._verified_on_graphs = True
    top = vg.seq_lens.shape[0]
    placed = (vg.computed[:n], vg.computed[top : top + n])  # the verify rows' positions and slots: the catch-up's
    logits = r.logits(hidden, list(range(n)))
    samples = r.batch_sampler.sample_on_device(logits, [c.state for c in chunks for _ in range(c.num_tokens)],
                                               [GREEDY] * n)
    firsts = np.cumsum([0] + [c.num_tokens for c in chunks]).tolist()[:-1]
    forced = [spec.forced.accepted(d) for d in held] if spec.forced is not None else None
    verdict = launch_verdict_ahead(samples, firsts, held, [c.state.table_row for c in chunks],
                                   ahead[sent[n:], 1:], forced, spec.num_steps, spec._verdict_stager,
                                   r.block_table.lens)
    drafting = catch_up_and_chain(spec, chunks, row_starts, verdict, placed)
    return queued(spec, list(zip(chunks, held)), verdict, drafting)


def settle(spec: Speculator, p: Proposal) -> Proposal:
    """A proposal launched ahead, once the step before it was read: each request's tokens end with the drafts it
    verifies (the previous chain's, read with that step) and its chunk starts at its confirmed length."""
    pairs: list[tuple[Chunk, int]] = []
    for c, d in p.verifications:
        st = c.state
        drafts = spec.drafts.get(st.request_id, [])
        if len(drafts) < d:
            raise RuntimeError(f"request {st.request_id!r}: verified {d} drafts ahead, the chain kept {len(drafts)}")
        spec._forget(st.request_id)
        st.token_ids.extend(drafts[:d])
        pairs.append((Chunk(st, st.num_computed, 1 + d, True), d))
    return replace(p, verifications=pairs)
