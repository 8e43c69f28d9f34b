"""OpenAI's API surface through the real pipeline, driven by the official openai client: loglikelihood requests
shaped like lm-evaluation-harness's (compared with transformers on the same model), vLLM's request extensions,
logit_bias, usage in streams, and /v1/responses (items, tools, text.format, reasoning, previous_response_id,
the typed stream)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from agentic_fixtures import WEATHER
from api_surface_fixtures import API_KEY, surface_server

from appliance.server.parsers.tool_calls.schema_check import validate
from appliance.tokenization import decode_token

pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

FN_TOOL = {"type": "function", "name": "get_weather", "description": "the weather", "parameters": WEATHER}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    with surface_server(tmp_path_factory.mktemp("surface_openai")) as got:
        yield got


@pytest.fixture(scope="module")
def hf(server: tuple[str, Path]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(server[1]), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(server[1]))


def client(server: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


PROMPT = [7, 41, 99, 150, 23, 77, 300, 12, 64, 201]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_loglikelihood_requests_match_transformers(server: Any, hf: Any, max_tokens: int) -> None:
    """lm-evaluation-harness's loglikelihood request: prompt ids, echo, logprobs k, max_tokens 0 or 1."""
    model, tok = hf
    k = 3
    r = client(server).completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=k, max_tokens=max_tokens,
                                          temperature=0)
    lp = r.choices[0].logprobs
    ref = hf_logprobs(model, PROMPT)
    n = len(PROMPT) + max_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing scores the first token
    ids = PROMPT + ([int(ref[-1].argmax())] if max_tokens else [])
    for p in range(1, n):
        row = ref[p - 1]
        assert lp.token_logprobs[p] == pytest.approx(float(row[ids[p]]), abs=2e-4)
        top = row.topk(k)
        want = {decode_token(tok, ids[p]): float(row[ids[p]])}
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            want.setdefault(decode_token(tok, t), float(v))  # keyed by text: the position's own token wins a tie
        assert lp.top_logprobs[p].keys() == want.keys()  # the position's own token plus the top k
        assert list(lp.top_logprobs[p].values()) == pytest.approx([want[t] for t in lp.top_logprobs[p]], abs=2e-4)
    assert r.usage.completion_tokens == max_tokens
    assert r.choices[0].finish_reason == "length"


def _is_greedy(lp: Any, context_len: int) -> bool:
    """lm-evaluation-harness's check (its local-completions parse_logprobs): every continuation token is the
    most likely one of its position's top_logprobs."""
    for token, top in zip(lp.tokens[context_len:], lp.top_logprobs[context_len:]):
        if max(top, key=top.get) != token:
            return False
    return True


def test_greedy_check_of_evaluation_tools(server: Any, hf: Any) -> None:
    model, _ = hf
    ref = hf_logprobs(model, PROMPT)
    greedy, other = int(ref[-1].argmax()), int(ref[-1].argsort()[-5])
    got = {}
    for cont in (greedy, other):
        r = client(server).completions.create(model="tiny", prompt=PROMPT + [cont], echo=True, logprobs=1,
                                              max_tokens=0, temperature=0)
        got[cont] = _is_greedy(r.choices[0].logprobs, len(PROMPT))
    assert got == {greedy: True, other: False}


def test_logprobs_zero_gives_the_sampled_token_per_position(server: Any) -> None:
    r = client(server).completions.create(model="tiny", prompt=PROMPT, logprobs=0, max_tokens=4, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {token: value}


def test_logit_bias_and_return_token_ids(server: Any) -> None:
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                          logit_bias={"123": 100}, extra_body={"return_token_ids": True})
    extra = r.choices[0].model_extra
    assert extra["token_ids"] == [123] * 5
    assert extra["prompt_token_ids"] == PROMPT


def test_truncate_prompt_tokens_keeps_the_tail(server: Any) -> None:
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                          extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    assert r.usage.prompt_tokens == 4
    assert r.choices[0].model_extra["prompt_token_ids"] == PROMPT[-4:]


def test_choice_constraint_with_top_logprobs_is_json(server: Any) -> None:
    """Masked tokens' -inf logprobs are reported as -9999 (JSON has no -inf)."""
    r = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "yes or no?"}], logprobs=True, top_logprobs=5,
        max_tokens=10, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    c = r.choices[0]
    assert c.message.content in ("yes", "no")
    entries = c.logprobs.content
    assert entries and all(len(e.top_logprobs) == 5 for e in entries)
    assert min(t.logprob for e in entries for t in e.top_logprobs) == -9999.0


def test_chat_extensions(server: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    r = client(server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=-1,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False,
                    "prompt_logprobs": 2, "return_token_ids": True})
    body = r.model_extra
    c = r.choices[0]
    assert c.message.content.startswith("The answer is")
    assert len(body["prompt_token_ids"]) == r.usage.prompt_tokens == len(body["prompt_logprobs"])
    assert body["prompt_logprobs"][0] is None
    for pos, tid in zip(body["prompt_logprobs"][1:], body["prompt_token_ids"][1:]):
        assert str(tid) in pos and 2 <= len(pos) <= 3
    assert len(c.model_extra["token_ids"]) == r.usage.completion_tokens == 3
    assert all(len(e.top_logprobs) == 20 for e in c.logprobs.content)  # -1: the vocabulary, capped at 20


def test_stream_usage_options(server: Any) -> None:
    chunks = list(client(server).completions.create(
        model="tiny", prompt="hello", max_tokens=4, stream=True, extra_body={"return_token_ids": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    seen = 0
    for c in chunks[:-1]:  # each chunk's usage counts the tokens streamed so far
        seen += len(c.choices[0].model_extra["token_ids"])
        assert c.usage.completion_tokens == seen
    assert seen == 4
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client(server).completions.create(model="tiny", prompt="x", max_tokens=1,
                                          stream_options={"include_usage": True})


def test_beam_search_is_refused(server: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="beam search"):
        client(server).completions.create(model="tiny", prompt="x", n=2, max_tokens=2,
                                          extra_body={"use_beam_search": True})


def test_load_and_invocations(server: Any) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server[0]}/load", timeout=30).json() == {"server_load": 0}
    r = httpx.post(f"{server[0]}/invocations", json={"prompt": PROMPT, "max_tokens": 2}, headers=auth, timeout=60)
    assert r.json()["object"] == "text_completion"
    r = httpx.post(f"{server[0]}/invocations", json={"messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 2}, headers=auth, timeout=60)
    assert r.json()["object"] == "chat.completion"
    assert httpx.post(f"{server[0]}/invocations", json={"prompt": "x"}, timeout=30).status_code == 401


# ---- /v1/responses ------------------------------------------------------------------------------------------
def test_responses_json_schema_text_format(server: Any) -> None:
    r = client(server).responses.create(model="tiny", input="Weather in Paris?", instructions="Answer in JSON.",
                                        text=JSON_FORMAT, max_output_tokens=80)
    assert r.status == "completed" and r.output[0].type == "message"
    assert validate(json.loads(r.output_text), WEATHER) == []
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0


def test_responses_reasoning_item(server: Any) -> None:
    r = client(server).responses.create(model="tiny", input="Think first.", max_output_tokens=40)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def _forced_call(server: Any) -> Any:
    r = client(server).responses.create(model="tiny", input="Weather in Paris?", tools=[FN_TOOL],
                                        tool_choice={"type": "function", "name": "get_weather"},
                                        max_output_tokens=120)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert validate(json.loads(calls[0].arguments), WEATHER) == []
    return r


def test_responses_function_call_output_round_trip(server: Any) -> None:
    first = _forced_call(server)
    call = next(o for o in first.output if o.type == "function_call")
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}]
    r = client(server).responses.create(model="tiny", input=items, tools=[FN_TOOL], max_output_tokens=8)
    # the prompt is the chat conversation with the call and its result, rendered by the template
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees"}]
    tools = [{"type": "function", "function": {k: v for k, v in FN_TOOL.items() if k != "type"}}]
    ids = httpx.post(f"{server[0]}/tokenize", json={"messages": chat, "tools": tools},
                     headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()["tokens"]
    assert r.usage.input_tokens == len(ids)


def test_responses_previous_response_id(server: Any) -> None:
    c = client(server)
    first = c.responses.create(model="tiny", input="hello", max_output_tokens=4)
    second = c.responses.create(model="tiny", input="again", previous_response_id=first.id, max_output_tokens=4)
    alone = c.responses.create(model="tiny", input="again", max_output_tokens=4)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens - 1
    for _ in range(4):  # the store holds 4 responses: the first falls out
        c.responses.create(model="tiny", input="x", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not stored"):
        c.responses.create(model="tiny", input="more", previous_response_id=first.id, max_output_tokens=1)


def test_responses_stream_event_sequence(server: Any) -> None:
    events = list(client(server).responses.create(
        model="tiny", input="Weather in Paris?", tools=[FN_TOOL], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=120, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    call = next(o for o in final.output if o.type == "function_call")
    assert call.arguments == args and validate(json.loads(args), WEATHER) == []


def test_responses_stream_helper(server: Any) -> None:
    with client(server).responses.stream(model="tiny", input="Weather?", text=JSON_FORMAT,
                                         max_output_tokens=80) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) and validate(json.loads(final.output_text), WEATHER) == []
    assert final.usage is not None and final.usage.output_tokens > 0


def test_responses_stream_reasoning_events(server: Any) -> None:
    events = list(client(server).responses.create(model="tiny", input="Think first.", max_output_tokens=12,
                                                  stream=True))
    types = [e.type for e in events]
    assert types[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert events[-1].type == "response.incomplete"  # max_output_tokens ended it
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == text
