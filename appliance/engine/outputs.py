"""A step's sampled tokens become request outputs (pure Python): appended under the stop rules, offered to the
prefix cache and reported as RequestDeltas.

Scheduler.update matches a step's result to the requests it planned, drops the rows of requests that finished or
were preempted meanwhile, and retires the requests a token finishes (that needs its queues); what one request's
tokens do to it is here: functions over the request, its tokens and the parts of the engine a token updates (the
prefix cache, the output reservation of admission.py, the speculative-decoding counters).

Speculative decoding (speculation.py): a request that verified d drafts gets 1..d+1 tokens. num_computed, advanced
by 1 + d when the step was planned, falls back to the accepted count before the tokens are appended, so the prefix
cache only hashes confirmed tokens whose KV holds them; the tokens are then appended one by one under every stop
rule, and those after the one that finishes the request are dropped.
"""
from __future__ import annotations

from appliance.engine.admission import OutputReservation
from appliance.engine.delta import RequestDelta, TokenLogprob
from appliance.engine.prefix_cache import PrefixCache
from appliance.engine.request import DECODING, PREFILLING, Request
from appliance.engine.speculation import SpecCounters
from appliance.engine.step import SampledToken, StepResult


def group_sampled(
    tokens: list[SampledToken],
) -> tuple[dict[str, SampledToken], dict[str, list[SampledToken]]]:
    """A step's sampled tokens by request: the first token of each, and all tokens of the requests that got
    several (a verification: speculative decoding), in order."""
    first = {tok.request_id: tok for tok in tokens}
    if len(first) == len(tokens):  # one token per request: nothing verified
        return first, {}
    first = {}
    verified: dict[str, list[SampledToken]] = {}
    for tok in tokens:
        head = first.setdefault(tok.request_id, tok)
        if head is not tok:
            verified.setdefault(tok.request_id, [head]).append(tok)
    return first, verified


def append_token(
    req: Request, tok: SampledToken, cache: PrefixCache, reserve: OutputReservation | None
) -> RequestDelta:
    """Append one sampled token to a running request and cache its full blocks. A finished delta (its
    finish_reason is a FinishReason's value) leaves the request running: the caller retires it."""
    prompt_lp = None
    if req.status is PREFILLING:  # its first token since (re)admission
        req.transition(DECODING)
        if not req.prompt_logprobs_done:
            req.prompt_logprobs_done = True
            prompt_lp = _prompt_logprobs(req)
    token_id = tok.token_id
    reason = req.append_output(token_id)
    if reserve is not None:
        reserve.decoded(req)
    cache.store(req)
    new_lp = None
    if req.sampling_params.logprobs is not None:
        new_lp = (TokenLogprob(token_id, tok.logprob, tuple(tuple(t) for t in tok.top_logprobs or ()), tok.rank),)
    return RequestDelta(req.request_id, (token_id,), None if reason is None else reason.value, req.num_prompt_tokens,
                        req.num_cached_tokens, new_lp, prompt_lp)


def append_verified(
    req: Request,
    toks: list[SampledToken],
    num_drafts: int,
    cache: PrefixCache,
    reserve: OutputReservation | None,
    spec: SpecCounters,
    num_verified: int | None = None,
) -> RequestDelta:
    """A verification's 1..num_drafts+1 tokens: rewind num_computed to the positions whose KV holds confirmed
    tokens, then append them one by one until one finishes the request (the rest are dropped); as append_token,
    the caller retires a finished request. num_verified: the drafts the workers checked, where fewer than the
    plan's num_drafts (overlap mode); num_computed moved by the plan, so the rewind counts from num_drafts."""
    checked = num_drafts if num_verified is None else num_verified
    if not 0 <= checked <= num_drafts or not 1 <= len(toks) <= checked + 1:
        raise ValueError(f"executor returned {len(toks)} tokens for {req.request_id!r}, which verified "
                         f"{checked} of {num_drafts} drafts (1 to {checked + 1} expected)")
    if checked:
        spec.record(checked, len(toks) - 1)
    req.num_computed_tokens -= num_drafts + 1 - len(toks)
    delta: RequestDelta | None = None
    for tok in toks:
        one = append_token(req, tok, cache, reserve)
        delta = one if delta is None else delta.followed_by(one)
        if one.finished:
            break
    assert delta is not None
    return delta


def take_prompt_logprobs(req: Request, result: StepResult) -> None:
    """Collect the prompt logprobs a step computed for the request (a prefill chunk's share), until it samples."""
    entries = result.prompt_logprobs.get(req.request_id)
    if entries and not req.prompt_logprobs_done:
        req.prompt_logprobs.extend(entries)


def _prompt_logprobs(req: Request) -> tuple[tuple[tuple[int, float], ...] | None, ...] | None:
    """The prompt logprobs the request asked for, as the delta carries them (None if it did not ask)."""
    if req.sampling_params.prompt_logprobs is None:
        return None
    return tuple(None if e is None else tuple(map(tuple, e)) for e in req.prompt_logprobs)
