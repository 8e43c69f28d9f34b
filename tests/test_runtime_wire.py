"""The typed wire: every message round-trips; anything else is rejected as a whole, never executed."""
from __future__ import annotations

import pickle

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine.step import (
    NewRequestData,
    SampledToken,
    ScheduledRequest,
    StepPlan,
    StepResult,
)
from appliance.runtime.messages import (
    OUTPUT_CODEC,
    PLAN_CODEC,
    REQUEST_CODEC,
    RESULT_CODEC,
    AbortRequest,
    GenerateRequest,
    OutputBatch,
    StatsQuery,
)
from appliance.runtime.wire import Codec, WireError
from appliance.server.engine_client import RequestOutput


def test_round_trips() -> None:
    plan = StepPlan(7, [NewRequestData("a", [1, 2, 3], 3, 0, [4, 5], {"temperature": 0.5, "stop": ["x"]})],
                    [ScheduledRequest("a", 3, [], True)], ["old"])
    assert PLAN_CODEC.decode(PLAN_CODEC.encode(plan)) == plan
    result = StepResult(7, [SampledToken("a", 9, -0.25, [(9, -0.25), (3, -1.5)])], {"a": [None, [(2, -0.1)]]})
    assert RESULT_CODEC.decode(RESULT_CODEC.encode(result)) == result
    spec = StepResult(8, [SampledToken("a", 9, None)], {}, drafts={"a": 3}, verified={"a": 1})
    assert RESULT_CODEC.decode(RESULT_CODEC.encode(spec)) == spec
    batch = OutputBatch([RequestOutput("a", [1], [-0.1], [[(1, -0.1)]], None, "stop", 3, 2)], 1, 0)
    assert OUTPUT_CODEC.decode(OUTPUT_CODEC.encode(batch)) == batch
    for msg in (GenerateRequest("r", [1], {"n": 1}, 1.5), AbortRequest(["r"]), StatsQuery(3)):
        assert REQUEST_CODEC.decode(REQUEST_CODEC.encode(msg)) == msg


def test_fields_at_their_default_stay_off_the_wire_and_come_back() -> None:
    plain = RequestOutput("a", [5], num_prompt_tokens=3)
    frame = msgpack.unpackb(OUTPUT_CODEC.encode(OutputBatch([plain])), raw=False)
    assert frame == ["OutputBatch", {"outputs": [{"request_id": "a", "new_token_ids": [5], "num_prompt_tokens": 3}]}]
    # values equal to a default but of another type, and non-default values of every kind, are kept
    odd = RequestOutput("b", [], logprobs=[], finish_reason="", num_cached_tokens=0, error_status=1,
                        first_scheduled_time=0.0)
    batch = OutputBatch([plain, odd, RequestOutput("c")], 0, 0, 0)
    assert OUTPUT_CODEC.decode(OUTPUT_CODEC.encode(batch)) == batch
    row = ScheduledRequest("a", 1, [], True)  # save_snapshot -1 (its default) is left out, an empty table is not
    assert msgpack.unpackb(PLAN_CODEC.encode(StepPlan(1, scheduled=[row])), raw=False)[1]["scheduled"] == [
        {"request_id": "a", "num_tokens": 1, "new_block_ids": [], "sample": True}]
    assert PLAN_CODEC.decode(PLAN_CODEC.encode(StepPlan(1, scheduled=[row, ScheduledRequest("b", 2, [3], False, 0)])
                                               )).scheduled[1].save_snapshot == 0


def test_tuples_come_back_as_tuples() -> None:
    out = RESULT_CODEC.decode(RESULT_CODEC.encode(StepResult(1, [SampledToken("a", 1, None, [(1, -0.5)])])))
    assert out.sampled[0].top_logprobs == [(1, -0.5)] and isinstance(out.sampled[0].top_logprobs[0], tuple)


@pytest.mark.parametrize("frame", [
    msgpack.packb(["GenerateRequest", {"request_id": 1, "prompt_token_ids": [1], "sampling": {}}]),
    msgpack.packb(["GenerateRequest", {"request_id": "r", "prompt_token_ids": ["1"], "sampling": {}}]),
    msgpack.packb(["GenerateRequest", {"request_id": "r", "prompt_token_ids": [True], "sampling": {}}]),
    msgpack.packb(["GenerateRequest", {"request_id": "r", "prompt_token_ids": [1]}]),  # missing field
    msgpack.packb(["GenerateRequest", {"request_id": "r", "prompt_token_ids": [1], "sampling": {}, "x": 1}]),
    msgpack.packb(["StepPlan", {"step_id": 1}]),  # a type this codec does not carry
    msgpack.packb(["os.system", {"command": "true"}]),
    msgpack.packb({"tag": "AbortRequest"}),
    pickle.dumps(AbortRequest(["r"])),
    b"",
    b"\xc1",
])
def test_malformed_frames_are_rejected_and_counted(frame: bytes) -> None:
    codec = Codec(GenerateRequest, AbortRequest)
    with pytest.raises(WireError):
        codec.decode(frame)
    assert codec.decode_or_none(frame) is None and codec.num_malformed == 1


def test_only_dataclasses_of_the_codec_encode() -> None:
    with pytest.raises(TypeError):
        REQUEST_CODEC.encode(StatsQuery)  # the class, not an instance
    with pytest.raises(TypeError):
        REQUEST_CODEC.encode(OutputBatch([]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_other_errors(frame: bytes) -> None:
    try:
        REQUEST_CODEC.decode(frame)
    except WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                  max_size=4), max_leaves=20))
def test_random_structures_in_a_known_tag_are_checked(fields: object) -> None:
    frame = msgpack.packb(["StepResult", {"step_id": 1, "sampled": fields}])
    try:
        msg = RESULT_CODEC.decode(frame)
    except WireError:
        return
    assert all(isinstance(s, SampledToken) for s in msg.sampled)


def test_a_rejected_frame_names_the_field_path() -> None:
    frame = msgpack.packb(["StepResult", {"step_id": 1, "sampled": [{"request_id": "a", "token_id": "x"}]}])
    with pytest.raises(WireError, match=r"StepResult\.sampled\[\]\.token_id: expected int, got str"):
        RESULT_CODEC.decode(frame)
    frame = msgpack.packb(["GenerateRequest", {"request_id": "r", "prompt_token_ids": [1, 2.5], "sampling": {}}])
    with pytest.raises(WireError, match=r"GenerateRequest\.prompt_token_ids\[\]: expected int items"):
        REQUEST_CODEC.decode(frame)


def test_float_lists_accept_ints_and_come_back_as_floats() -> None:
    out = OUTPUT_CODEC.decode(msgpack.packb(["OutputBatch", {"outputs": [{"request_id": "a", "logprobs": [0, -1.5]}]}]))
    assert out.outputs[0].logprobs == [0.0, -1.5] and all(type(x) is float for x in out.outputs[0].logprobs)
