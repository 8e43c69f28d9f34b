"""Request state machine and stop rules."""
from __future__ import annotations

import itertools

import pytest

from appliance.engine.request import (
    LEGAL_TRANSITIONS,
    FinishReason,
    IllegalTransition,
    Request,
    RequestStatus,
)
from appliance.engine.sampling_params import SamplingParams

S = RequestStatus


def make(prompt=(1, 2, 3), eos=frozenset({0}), max_model_len=100, **sp) -> Request:
    return Request("r", list(prompt), SamplingParams(**sp), 0.0, frozenset(eos), max_model_len)


def walk(req: Request, *states: RequestStatus) -> None:
    for s in states:
        req.transition(s)


def test_happy_path_and_preemption_cycle() -> None:
    r = make()
    walk(r, S.PREFILLING, S.PREEMPTED, S.PREFILLING, S.DECODING, S.PREEMPTED, S.PREFILLING, S.DECODING)
    r.finish(FinishReason.STOP)
    assert r.status is S.FINISHED and r.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("src,dst", list(itertools.product(list(S), list(S))))
def test_transition_table_is_enforced(src: RequestStatus, dst: RequestStatus) -> None:
    r = make()
    r.status = src
    if dst in LEGAL_TRANSITIONS[src]:
        r.transition(dst)
        assert r.status is dst
    else:
        with pytest.raises(IllegalTransition) as e:
            r.transition(dst)
        assert e.value.src is src and e.value.dst is dst and r.status is src


def test_terminal_states_have_no_exit_and_abort_is_aborted() -> None:
    assert LEGAL_TRANSITIONS[S.FINISHED] == frozenset() == LEGAL_TRANSITIONS[S.ABORTED]
    r = make()
    r.finish(FinishReason.ABORT)
    assert r.status is S.ABORTED
    with pytest.raises(IllegalTransition):
        r.finish(FinishReason.ABORT)
    with pytest.raises(IllegalTransition):  # cannot finish a waiting request by stop
        make().finish(FinishReason.STOP)


def test_append_output_only_while_decoding() -> None:
    r = make()
    with pytest.raises(IllegalTransition):
        r.append_output(5)
    assert r.output_token_ids == []


def decoding(**kw) -> Request:
    r = make(**kw)
    walk(r, S.PREFILLING, S.DECODING)
    return r


def test_eos_stops_unless_ignored_and_respects_min_tokens() -> None:
    assert decoding().append_output(0) is FinishReason.STOP
    assert decoding(ignore_eos=True).append_output(0) is None
    r = decoding(min_tokens=2)
    assert r.append_output(0) is None  # eos before min_tokens does not stop
    assert r.append_output(0) is FinishReason.STOP
    assert r.output_token_ids == [0, 0]


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    r = decoding(stop_token_ids=[7], ignore_eos=True)
    assert r.append_output(5) is None
    assert r.append_output(7) is FinishReason.STOP


def test_length_by_max_tokens_and_by_max_model_len() -> None:
    r = decoding(max_tokens=2)
    assert r.append_output(5) is None
    assert r.append_output(5) is FinishReason.LENGTH
    r = decoding(prompt=[1] * 8, max_model_len=10, max_tokens=None)
    assert r.max_output_tokens == 2
    assert [r.append_output(5), r.append_output(5)] == [None, FinishReason.LENGTH]
    r = decoding(prompt=[1] * 10, max_model_len=10)  # a prompt of exactly max_model_len gets one token
    assert r.append_output(5) is FinishReason.LENGTH


def test_bad_prompts_are_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        make(prompt=[])
    with pytest.raises(ValueError, match="max_model_len"):
        make(prompt=[1] * 11, max_model_len=10)
    with pytest.raises(ValueError, match="non-negative"):
        make(prompt=[1, -2])


def test_token_slice_spans_prompt_and_output() -> None:
    r = decoding(prompt=[1, 2, 3])
    r.append_output(4)
    r.append_output(5)
    assert r.all_token_ids == [1, 2, 3, 4, 5]
    for a in range(6):
        for b in range(a, 6):
            assert r.token_slice(a, b) == [1, 2, 3, 4, 5][a:b]
