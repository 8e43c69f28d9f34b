"""Request -> constraint plumbing without the pipeline: server/constraints.py, the offline LLM's structured
outputs, tool-call arguments for chat templates, and the config rule for api.thinking_budget."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.config import ConfigError, build_config
from appliance.engine.sampling_params import SamplingParams
from appliance.server.chat_template import normalize_messages
from appliance.server.constraints import (
    check_compatible,
    output_spec,
    thinking_budget_extra,
    with_extra,
)
from appliance.server.errors import ApiError
from appliance.server.protocol import ChatMessage
from appliance.structured import (
    StructuredOutputsParams,
    StructuredOutputUnavailable,
    StructuredSpec,
)

pytest.importorskip("xgrammar")

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]


def test_forced_tool_choice_specs() -> None:
    named = output_spec({}, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})
    assert named is not None and named.schema["required"] == ["x"]
    required = output_spec({}, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required is not None and required.schema["maxItems"] == 1 and required.schema["minItems"] == 1
    assert "maxItems" not in output_spec({}, tools=TOOLS, tool_choice="required").schema
    assert output_spec({}, tools=TOOLS, tool_choice="auto") is None
    with pytest.raises(ApiError, match="already constrains") as info:
        output_spec({"response_format": {"type": "json_object"}}, tools=TOOLS, tool_choice="required")
    assert info.value.status == 400


def test_missing_xgrammar_is_a_400_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.structured import validate

    def missing() -> None:
        raise StructuredOutputUnavailable()

    monkeypatch.setattr(validate, "require_xgrammar", missing)
    with pytest.raises(ApiError) as info:
        output_spec({"response_format": {"type": "json_object"}})
    assert info.value.status == 400 and "pip install xgrammar" in info.value.message
    assert info.value.param == "response_format"
    assert output_spec({"response_format": {"type": "text"}}) is None  # no constraint: xgrammar not needed


def test_params_carry_the_constraints() -> None:
    spec = StructuredSpec.regex("a+")
    params = with_extra(SamplingParams(max_tokens=5), structured=spec.to_dict(), thinking_budget=None)
    assert params.extra == {"structured": {"kind": "regex", "value": "a+"}} and params.max_tokens == 5
    assert SamplingParams.from_dict(params.to_dict()) == params  # survives the wire's dict form
    for bad in (SamplingParams(ignore_eos=True), SamplingParams(min_tokens=2)):
        with pytest.raises(ApiError):
            check_compatible(bad, spec)
    check_compatible(SamplingParams(ignore_eos=True), None)


def test_thinking_budget_extra_encodes_the_tags() -> None:
    class Api:
        reasoning_parser = "deepseek_r1"

    class Ctx:
        config = type("C", (), {"api": Api})()

        @staticmethod
        def encode(text: str, add_special_tokens: bool) -> list[int]:
            return [ord(c) for c in text]

    d = thinking_budget_extra(Ctx(), 7, "prompt")
    assert d == {"budget": 7, "end_token_ids": [ord(c) for c in "\n</think>\n\n"],
                 "start_tag_ids": [ord(c) for c in "<think>"], "end_tag_ids": [ord(c) for c in "</think>"],
                 "in_reasoning": True}  # deepseek_r1's template opens the block
    assert thinking_budget_extra(Ctx(), None, "prompt") is None


def test_tool_call_arguments_reach_the_template_as_objects() -> None:
    msgs = [ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "d", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}),
        ChatMessage.model_validate({"role": "tool", "tool_call_id": "c", "content": "2"})]
    out = normalize_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert out[1] == {"role": "tool", "content": "2", "tool_call_id": "c"}


def test_thinking_budget_needs_a_reasoning_parser() -> None:
    with pytest.raises(ConfigError) as info:
        build_config(env={}, dotlist=["api.thinking_budget=100"])
    assert any(p.path == "api.thinking_budget" for p in info.value.problems)
    build_config(env={}, dotlist=["api.thinking_budget=100", "api.reasoning_parser=qwen3"])


_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_GPU)])
def test_offline_llm_structured_outputs(tiny_model: Path, device: str) -> None:
    """Constrained rows batched with free ones (on a GPU: CUDA graphs and the Triton fast path for the free)."""
    from appliance.entrypoints.llm import LLM

    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "boolean"}},
              "required": ["k", "v"], "additionalProperties": False}
    kw = {} if device == "cpu" else {"gpu_memory_utilization": 0.3}
    llm = LLM(model=str(tiny_model), device=device, **kw)
    try:
        extra = StructuredOutputsParams(json=schema).to_extra()
        free = SamplingParams(max_tokens=30, ignore_eos=True)
        greedy = SamplingParams(max_tokens=40, temperature=0.0, extra=extra)
        params = [SamplingParams(max_tokens=40, seed=0, n=2, extra=extra), free, greedy,
                  SamplingParams(max_tokens=40, extra=extra)]
        out = llm.generate(["Hello", "world", "again", "more"], params)
        assert len(out[1].outputs[0].token_ids) == 30
        for o in (out[0], out[2], out[3]):
            for c in o.outputs:
                value: Any = json.loads(c.text)
                assert value["k"] in ("a", "b") and isinstance(value["v"], bool) and c.finish_reason == "stop"
        with pytest.raises(ValueError, match="regex"):
            llm.generate("x", SamplingParams(extra=StructuredOutputsParams(regex="(a").to_extra()))
        with pytest.raises(ValueError, match="ignore_eos"):
            llm.generate("x", SamplingParams(ignore_eos=True, extra=StructuredOutputsParams(regex="a").to_extra()))
    finally:
        llm.shutdown()
