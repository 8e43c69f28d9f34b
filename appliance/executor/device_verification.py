"""Verification on the device, for requests whose every verification row samples on the device (greedy argmax or
the GPU sampler; no logits processors, logprobs, penalties or seeds, and no drafts drawn from the drafter's q).

The rows of a step's verifications are laid out as one fixed-shape batch: [B, K + 1] samples (K =
speculative.num_steps; row j of request b sampled with its first j drafts as history), [B, K] drafts and [B]
drafts held. A column at or past a request's held count is masked, not dropped, so the shapes do not depend on
what the previous step left (a graph can hold them). The accept decision is a few torch ops: a draft is accepted
while every draft before it was and its row's sample equals it; a request emits its accepted drafts and the
sample after them (the correction, or the bonus after the last draft), and since an accepted draft equals its
row's sample, the emitted tokens are the first `counts` samples. This is the rule of speculative_verification.py
(its `accepted_length`), so the tokens are the same; the device lengths of the verified rows are set to the
confirmed end in the same launches (request_table.py's `lens`), and the host reads counts and tokens in one copy.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.executor.input_batch import Chunk, Stager
from appliance.executor.speculative_verification import verification_rows

if TYPE_CHECKING:
    from appliance.executor.batch_sampler import BatchSampler
    from appliance.executor.speculative_forced import ForcedAcceptance


@dataclass(frozen=True)
class Verdict:
    """The outcome of a batch of verifications, on the device."""

    counts: torch.Tensor  # [B] int64: tokens each request emits, 1..held + 1
    tokens: torch.Tensor  # [B, K + 1] int64: the emitted tokens first; columns from counts on are not emitted
    host: torch.Tensor | None = None  # counts then tokens, copied to the host behind the launches (`staged`)
    copied: torch.cuda.Event | None = None  # recorded behind that copy (None on a CPU)

    def staged(self) -> Verdict:
        """The verdict with its copy to the host queued now: read later, it waits for this step's launches only,
        not for what was queued after them (a plain read would wait for the whole stream)."""
        flat = torch.cat([self.counts, self.tokens.reshape(-1)])
        if flat.device.type != "cuda":
            return replace(self, host=flat)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return replace(self, host=host, copied=copied)


def accept(samples: torch.Tensor, drafts: torch.Tensor, held: torch.Tensor,
           forced: torch.Tensor | None = None) -> Verdict:
    """The verdict of verifications laid out as in the module docstring. `forced` [B] (benchmarks,
    speculative_forced.py): drafts kept per request instead of the match, capped at the held count; the
    tokens are then those drafts and the sample after them."""
    k = drafts.shape[1]
    if samples.shape != (drafts.shape[0], k + 1) or held.shape != (drafts.shape[0],):
        raise ValueError(f"samples {tuple(samples.shape)}, drafts {tuple(drafts.shape)} and held "
                         f"{tuple(held.shape)} do not describe one batch of verifications")
    col = torch.arange(k, device=drafts.device)
    if forced is None:
        ok = (samples[:, :k] == drafts) & (col < held[:, None])
        accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
        return Verdict(accepted + 1, samples)
    accepted = torch.minimum(forced, held)
    padded = torch.cat([drafts, samples[:, k:]], dim=1)  # the last column is never a kept draft
    keep = torch.arange(k + 1, device=drafts.device) < accepted[:, None]
    return Verdict(accepted + 1, torch.where(keep, padded, samples))


@dataclass(frozen=True)
class Uploaded:
    """A VerifyBatch on the device (one staged upload)."""

    index: torch.Tensor  # [B, K + 1]: each column's row in the step's flat samples (past the bonus row: it again)
    drafts: torch.Tensor  # [B, K]: 0 past the held count
    held: torch.Tensor  # [B]
    table_rows: torch.Tensor  # [B]
    starts: torch.Tensor  # [B]
    forced: torch.Tensor | None  # [B], or None


@dataclass(frozen=True)
class VerifyBatch:
    """Verifications to decide on the device, as the host knows them: each request's first row in the step's
    flat samples, its drafts (d of them), the table row and start of its chunk."""

    first_rows: list[int]
    drafts: list[list[int]]
    table_rows: list[int]
    starts: list[int]
    forced: list[int] | None = None  # drafts kept per request (benchmarks), else None

    def upload(self, num_steps: int, stager: Stager) -> Uploaded:
        b, k = len(self.drafts), num_steps
        index = np.zeros((b, k + 1), dtype=np.int64)
        drafts = np.zeros((b, k), dtype=np.int64)
        for i, (first, d) in enumerate(zip(self.first_rows, self.drafts)):
            if len(d) > k:
                raise ValueError(f"a verification of {len(d)} drafts exceeds speculative.num_steps={k}")
            index[i] = first + np.minimum(np.arange(k + 1), len(d))
            drafts[i, : len(d)] = d
        tail = [[len(d) for d in self.drafts], self.table_rows, self.starts] + (
            [self.forced] if self.forced is not None else [])
        flat = np.concatenate([index.reshape(-1), drafts.reshape(-1), np.asarray(tail, dtype=np.int64).reshape(-1)])
        sent = stager.send(flat)
        at = b * (2 * k + 1)
        rest = sent[at:].view(-1, b)
        return Uploaded(sent[: b * (k + 1)].view(b, k + 1), sent[b * (k + 1) : at].view(b, k), rest[0], rest[1],
                        rest[2], rest[3] if self.forced is not None else None)


def decide(samples: torch.Tensor, batch: VerifyBatch, num_steps: int, stager: Stager,
           lens: torch.Tensor | None) -> list[list[int]]:
    """The tokens each verification of `batch` emits, decided on the device from the step's flat `samples`
    (one per verification row); `lens` (the device block table's lengths, or None) gets each request's
    confirmed end. The host waits once, for counts and tokens together."""
    if not batch.drafts:
        return []
    return read_verdict(launch_verdict(samples, batch, num_steps, stager, lens))


def launch_verdict(samples: torch.Tensor, batch: VerifyBatch, num_steps: int, stager: Stager,
                   lens: torch.Tensor | None) -> Verdict:
    """`decide` without the read: the verdict stays on the device (work launched after it, such as the drafter's
    catch-up and chain placed from `lens`, runs before the host reads it)."""
    up = batch.upload(num_steps, stager)
    verdict = accept(samples[up.index.reshape(-1)].view(up.index.shape), up.drafts, up.held, up.forced)
    if lens is not None:
        lens.index_copy_(0, up.table_rows, up.starts + verdict.counts)
    return verdict


def launch_verdict_ahead(samples: torch.Tensor, first_rows: list[int], held: list[int], table_rows: list[int],
                         drafts: torch.Tensor, forced: list[int] | None, num_steps: int, stager: Stager,
                         lens: torch.Tensor) -> Verdict:
    """`launch_verdict` for a step launched before the previous one was read (verify_ahead.py): its drafts
    ([B, >= K] on the device, the previous chain's) and its chunks' starts (the device lengths, which the verify
    graph moved to each chunk's end: start + 1 + held) are not on the host."""
    batch = VerifyBatch(first_rows, [[0] * d for d in held], table_rows, [0] * len(held), forced)
    up = batch.upload(num_steps, stager)
    col = torch.arange(num_steps, device=drafts.device)
    mine = torch.where(col < up.held[:, None], drafts[:, :num_steps], 0)
    verdict = accept(samples[up.index.reshape(-1)].view(up.index.shape), mine, up.held, up.forced)
    starts = lens.index_select(0, up.table_rows) - up.held - 1
    lens.index_copy_(0, up.table_rows, starts + verdict.counts)
    return verdict


def read_verdict(verdict: Verdict) -> list[list[int]]:
    """The emitted tokens of each request: counts and tokens in one copy (the host's wait for the verdict and
    everything launched before this call)."""
    b, width = verdict.tokens.shape
    if verdict.copied is not None:
        verdict.copied.synchronize()
    flat = verdict.host if verdict.host is not None else torch.cat([verdict.counts, verdict.tokens.reshape(-1)])
    host = flat.tolist()
    return [host[b + i * width : b + i * width + host[i]] for i in range(b)]


def verdict_on_device(sampler: BatchSampler, rows: torch.Tensor, verifications: list[tuple[Chunk, int]],
                      num_steps: int, forced: ForcedAcceptance | None, stager: Stager, lens: torch.Tensor) -> Verdict:
    """The verdict of these (chunk, d) verifications, on the device (nothing read). `rows`: their logits, d + 1
    rows each in order, every row taking a device path of `sampler` (BatchSampler.on_device); each state's
    token_ids ends with its d drafts. The device lengths become the confirmed ends."""
    samples = sampler.sample_on_device(rows, [row for c, d in verifications for row in verification_rows(c.state, d)])
    firsts = np.cumsum([0] + [d + 1 for _, d in verifications]).tolist()[:-1]
    drafts = [c.state.token_ids[len(c.state.token_ids) - d:] for c, d in verifications]
    kept = [forced.accepted(d) for _, d in verifications] if forced is not None else None
    batch = VerifyBatch(firsts, drafts, [c.state.table_row for c, _ in verifications],
                        [c.start for c, _ in verifications], kept)
    return launch_verdict(samples, batch, num_steps, stager, lens)


def keep_emitted(verifications: list[tuple[Chunk, int]], emitted: list[list[int]]) -> None:
    """Each state's d drafts replaced by the tokens it emitted; the mirror of its device length set to the
    confirmed end."""
    for (c, d), tokens in zip(verifications, emitted):
        del c.state.token_ids[len(c.state.token_ids) - d:]
        c.state.token_ids.extend(tokens)
        c.state.pos_on_device = c.start + len(tokens)


def verify_on_device(sampler: BatchSampler, rows: torch.Tensor, verifications: list[tuple[Chunk, int]],
                     num_steps: int, forced: ForcedAcceptance | None, stager: Stager, lens: torch.Tensor
                     ) -> list[list[int]]:
    """The tokens each (chunk, d) verification emits (`verdict_on_device`, read at once). Afterwards each
    state's token_ids ends with the kept tokens, and the device length and its mirror are the confirmed end."""
    if not verifications:
        return []
    emitted = read_verdict(verdict_on_device(sampler, rows, verifications, num_steps, forced, stager, lens))
    keep_emitted(verifications, emitted)
    return emitted
