"""A speculative step decided and drafted on the device, with one host wait.

After the verify graphs (verify_graphs.py) ran a step whose every chunk is a verification decided on the device
(device_verification.py: greedy or GPU-sampler rows, no logits processors, no drafts drawn from the drafter's q),
the drafter's catch-up and chain need nothing from the host but the tokens each request kept, and those are on
the device: the verdict's counts (which set the target's device lengths to the confirmed ends) and its tokens. So
the step queues, back to back: the verdict; the catch-up over the whole chunks (catch_up_graphs.py: row j of a
request at start + j, fed the verdict's token j, the rows at or past the confirmed length storing and reading
nothing); the chain (draft_graphs.py) from each drafting request's last kept catch-up row, its first position the
device length. Only then does the host read the verdict, and the chain's drafts, copied behind it, are already
there: one wait per step instead of one for the verdict and one for the drafts, and no host work between the
verify graph and the chain. The read waits too: `launch_proposal` returns what `read_proposal` needs, and the
speculator hands the step back in flight (speculative.py `Speculator.launch`), so with overlap the engine plans
the next step while this one runs and the runner reads it just before it launches that step (or just after, where
that step is launched ahead: verify_ahead.py, which is why the verdict's and the chain's copies to the host are
queued with the step). Drafters fed the next token (EAGLE, EAGLE-3, MTP: catch-up shift 1, chain from the
confirmed length); a standalone draft model, whose catch-up has one row more than the chunk, and every other step
take the host path (speculative.py), whose tokens and drafts are the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.engine.step import SampledToken
from appliance.executor.device_verification import (
    Verdict,
    keep_emitted,
    read_verdict,
    verdict_on_device,
)
from appliance.executor.draft_graphs import PendingChain
from appliance.executor.input_batch import Chunk
from appliance.executor.speculative_rejection import draws_drafts

if TYPE_CHECKING:
    from appliance.executor.speculative import Speculator


def proposes_on_device(spec: Speculator, chunks: list[Chunk], verifying: dict[str, int]) -> bool:
    """Whether this step (its forward just ran) takes the device path: the verify graphs ran it, the drafter's
    catch-up graphs read their source and feed the next token, and every chunk verifies drafts decided on the
    device."""
    cu = spec.catch_up_graphs
    if cu is None or cu.shift != 1 or not spec._verified_on_graphs or cu.source is not spec.catch_up_source():
        return False
    for c in chunks:
        d = verifying.get(c.state.request_id, 0)
        if not d or draws_drafts(c.state.params) or not spec._decided_on_device(c.state, d):
            return False
    return True


@dataclass(frozen=True)
class Proposal:
    """A step's verdict, catch-up and chain, queued on the device and not read yet."""

    verifications: list[tuple[Chunk, int]]  # (chunk, drafts it verifies), in the verdict's order
    verdict: Verdict
    drafting: list[int]  # the chunks whose requests draft (indices into verifications)
    event: torch.cuda.Event | None  # recorded behind the last of it (None on a CPU)
    chain: tuple[dict[str, int], PendingChain] | None = None  # the drafting requests' rows, their chain


def launch_proposal(spec: Speculator, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
                    verifying: dict[str, int]) -> Proposal:
    """Queue the step's verdict, catch-up and chain on the device (module docstring); nothing is read. The
    drafts the chunks verified are dropped (they are in token_ids until the read)."""
    r = spec.runner
    pairs = [(c, verifying[c.state.request_id]) for c in chunks]
    logits = r.logits(hidden, [first + j for (_, d), first in zip(pairs, row_starts) for j in range(d + 1)])
    verdict = verdict_on_device(r.batch_sampler, logits, pairs, spec.num_steps, spec.forced, spec._verdict_stager,
                                r.block_table.lens)
    for c in chunks:  # the chain below brings the next drafts
        spec._forget(c.state.request_id)
    drafting = catch_up_and_chain(spec, chunks, row_starts, verdict)
    return queued(spec, pairs, verdict, drafting)


def queued(spec: Speculator, pairs: list[tuple[Chunk, int]], verdict: Verdict, drafting: list[int]) -> Proposal:
    """The proposal of a step whose launches are all queued: its verdict's copy to the host queued behind them
    and its chain taken from the speculator (the step keeps it until it is read, whatever launches meanwhile)."""
    chain, spec._pending = spec._pending, None
    verdict = verdict.staged()
    event = torch.cuda.Event() if verdict.tokens.device.type == "cuda" else None
    if event is not None:
        event.record()
    return Proposal(pairs, verdict, drafting, event, chain if drafting else None)


def read_proposal(spec: Speculator, p: Proposal) -> tuple[list[SampledToken], dict[str, int]]:
    """The step's one wait: the verdict read, with the chain's drafts behind it. Returns the sampled tokens and
    the count each request emitted; each state's token_ids end with its kept tokens and the speculator holds
    the new drafts."""
    emitted = read_verdict(p.verdict)
    keep_emitted(p.verifications, emitted)
    if p.chain is not None:  # each chain started at its request's confirmed end
        rows, chain = p.chain
        first = [p.verifications[b][0].start + len(emitted[b]) for b in p.drafting]
        spec._drafts.update(zip(rows, chain.drafts(first)))
    sampled = [SampledToken(c.state.request_id, t) for (c, _), tokens in zip(p.verifications, emitted) for t in tokens]
    return sampled, {c.state.request_id: len(tokens) for (c, _), tokens in zip(p.verifications, emitted)}


def catch_up_and_chain(spec: Speculator, chunks: list[Chunk], row_starts: list[int], verdict: Verdict,
                       placed: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
    """Queue the catch-up over the whole chunks, fed the verdict's tokens, and the chain of the requests that
    draft (returned, as indices into chunks), from their last kept row; nothing is read. placed: the rows'
    positions and slots on the device (a step launched ahead, whose chunks' starts the host does not know)."""
    cu = spec.catch_up_graphs
    assert cu is not None
    width = verdict.tokens.shape[1]
    fed = [b * width + j for b, c in enumerate(chunks) for j in range(c.num_tokens)]  # row j: the token after j
    take = [first + j for c, first in zip(chunks, row_starts) for j in range(c.num_tokens)]
    drafting = [b for b, c in enumerate(chunks) if spec.wants_drafts(c)]
    n, m = len(fed), len(drafting)
    firsts = np.cumsum([0] + [c.num_tokens for c in chunks])[drafting]  # the catch-up rows' layout is the chunks'
    sent = spec._chain_stager.send(np.concatenate([np.asarray(fed + drafting, dtype=np.int64), firsts]))
    got = cu.run_catch_up(chunks, take if cu.source is not None else [], verdict.tokens.reshape(-1)[sent[:n]],
                          placed)
    if got is None:
        raise RuntimeError("a catch-up of a verify-graph step's rows found no graph (it has the same rows)")
    _, tokens, states = got
    if drafting:
        at = sent[n + m :] + verdict.counts[sent[n : n + m]] - 1  # each request's last kept row
        spec.launch_chain([chunks[b].state for b in drafting], tokens[at], None,
                          states[at] if states is not None else None)
    return drafting
