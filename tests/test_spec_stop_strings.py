"""Stop strings when one engine output carries several tokens (speculative decoding verifies drafts, so a step can
emit 1..k+1 tokens of a request): the tokens after the one that completed the stop string are dropped from
token_ids, logprobs and usage, exactly as if the tokens had arrived one by one. Levels: the Detokenizer's
count, the offline LLM's _apply with fake deltas, the HTTP server with a fake engine that answers in chunks, and
end to end through LLM on the tiny DeepSeek-V3 + MTP with drafts forced right (so deltas really are long)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import spec_fixtures
from server_client import client_for, script_for, sse_events
from spec_fixtures import chunked_outputs, delta_lengths, one_by_one_count, oracle, stop_case
from test_server_fakes import FakeEngine

from appliance import LLM, SamplingParams
from appliance.engine.delta import RequestDelta, TokenLogprob
from appliance.entrypoints.llm import _Sequence
from appliance.server.engine_client import RequestOutput
from appliance.tokenization import Detokenizer, load_tokenizer

tiny_v3, tiny_v3_tok = spec_fixtures.tiny_v3, spec_fixtures.tiny_v3_tok  # DeepSeek-V3 with one MTP layer

TEXT = "Hello world! How are you? Fine, thanks."
STOP = "are"


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Any:
    return load_tokenizer(str(tiny_tokenizer_dir))


# ---- Detokenizer ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("include", [False, True])
def test_detokenizer_consumes_up_to_the_token_that_completes_the_stop(tok: Any, include: bool) -> None:
    ids = script_for(tok, TEXT)
    want, want_text = one_by_one_count(tok, ids, STOP, include_stop_str_in_output=include)
    assert 0 < want < len(ids)
    d = Detokenizer(tok, stop=[STOP], include_stop_str_in_output=include)
    text = d.update(ids)  # the whole output in one update, as a long speculative delta would bring it
    assert d.finished and d.stop_reason == STOP
    assert d.num_output_tokens == want and text == want_text
    assert tok.decode(ids[:want]).find(STOP) >= 0 and tok.decode(ids[: want - 1]).find(STOP) < 0
    assert d.update(ids) == "" and d.num_output_tokens == want  # nothing is consumed after the stop


def test_detokenizer_counts_every_token_without_a_stop(tok: Any) -> None:
    ids = script_for(tok, TEXT)
    d = Detokenizer(tok, stop=["never there"])
    d.update(ids[:3])
    d.update(ids[3:])
    assert d.num_output_tokens == len(ids) and not d.finished


def test_min_tokens_defers_the_stop_and_the_count_follows(tok: Any) -> None:
    ids = script_for(tok, "are you are we")
    first, _ = one_by_one_count(tok, ids, "are")
    d = Detokenizer(tok, stop=["are"], min_tokens=first + 1)
    d.update(ids)
    assert d.finished and d.num_output_tokens > first  # the first "are" was inside min_tokens


# ---- offline LLM: _apply with a fake multi-token delta --------------------------------------------------------

class _AbortLog:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def _bare_llm(tok: Any) -> LLM:
    """An LLM with only what _apply reads (tokenizer, engine.abort, prompt logprobs): no model is loaded."""
    llm = LLM.__new__(LLM)
    llm.tokenizer = tok
    llm.engine = _AbortLog()  # type: ignore[assignment]
    llm._prompt_lps = {}
    return llm


@pytest.mark.parametrize("chunk", [3, 5, 64])
def test_llm_drops_tokens_after_the_stop_inside_a_delta(tok: Any, chunk: int) -> None:
    ids = script_for(tok, TEXT)
    want, want_text = one_by_one_count(tok, ids, STOP)
    llm = _bare_llm(tok)
    params = SamplingParams(stop=[STOP], logprobs=0, max_tokens=100)
    s = _Sequence("r1", 0, 0, params, llm._detokenizer([], params))
    lps = [TokenLogprob(t, -0.01 * (i + 1)) for i, t in enumerate(ids)]
    deltas = 0
    for start in range(0, len(ids), chunk):
        if s.finish_reason is not None:
            break
        deltas += 1
        llm._apply(s, RequestDelta("r1", tuple(ids[start : start + chunk]), None, 0, 0,
                                   tuple(lps[start : start + chunk])))
    assert s.token_ids == ids[:want]
    assert s.text == want_text
    assert s.finish_reason == "stop" and s.stop_reason == STOP
    assert s.logprobs is not None and [next(iter(e)) for e in s.logprobs] == ids[:want]
    assert s.cumulative_logprob == pytest.approx(sum(-0.01 * (i + 1) for i in range(want)))
    assert llm.engine.aborted == ["r1"]  # type: ignore[attr-defined]
    assert deltas * chunk > want  # the stop really fell inside a delta that carried more tokens


def test_llm_stop_string_wins_over_a_later_stop_token_in_the_same_delta(tok: Any) -> None:
    """The engine ended the request on a stop token id at the delta's end; the stop string came first."""
    ids = script_for(tok, TEXT)
    want, _ = one_by_one_count(tok, ids, STOP)
    llm = _bare_llm(tok)
    params = SamplingParams(stop=[STOP], stop_token_ids=[ids[want + 1]], max_tokens=100)
    s = _Sequence("r1", 0, 0, params, llm._detokenizer([], params))
    llm._apply(s, RequestDelta("r1", tuple(ids[: want + 2]), "stop", 0, 0))
    assert s.token_ids == ids[:want] and (s.finish_reason, s.stop_reason) == ("stop", STOP)
    assert llm.engine.aborted == []  # type: ignore[attr-defined]  # the engine already finished it


# ---- the HTTP server: an engine that answers several tokens per output ---------------------------------------

class ChunkedEngine(FakeEngine):
    """FakeEngine's script, `chunk` tokens per output."""

    chunk: int = 3

    async def outputs(self, request_id: str, prompt_token_ids: list[int],
                      sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        for out in chunked_outputs(request_id, len(prompt_token_ids), self.script, self.chunk, sampling):
            yield out


@pytest.mark.anyio
@pytest.mark.parametrize("chunk", [3, 4])
async def test_server_completion_usage_and_logprobs_stop_at_the_stop(tok: Any, chunk: int) -> None:
    ids = script_for(tok, TEXT)
    want, want_text = one_by_one_count(tok, ids, STOP)
    engine = ChunkedEngine(ids)
    engine.chunk = chunk
    async with client_for(tok, engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, "stop": [STOP], "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == want_text
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == STOP
    assert body["usage"]["completion_tokens"] == want
    assert len(choice["logprobs"]["tokens"]) == want
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([-0.01 * (i + 1) for i in range(want)])
    assert engine.aborted == [engine.submitted[0][0]]
    assert -(-want // chunk) * chunk > want  # the output that completed the stop carried tokens past it


@pytest.mark.anyio
async def test_server_chat_stream_counts_only_tokens_up_to_the_stop(tok: Any) -> None:
    ids = script_for(tok, TEXT)
    want, want_text = one_by_one_count(tok, ids, STOP)
    engine = ChunkedEngine(ids)
    engine.chunk = 4
    async with client_for(tok, engine) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stop": STOP, "stream": True,
            "logprobs": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    choices = [ch for e in events for ch in e.get("choices", [])]
    content = "".join(ch["delta"].get("content") or "" for ch in choices)
    lps = [x for ch in choices if ch.get("logprobs") for x in ch["logprobs"]["content"]]
    assert content == want_text
    assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["stop"]
    assert len(lps) == want
    assert events[-1]["usage"]["completion_tokens"] == want


# ---- end to end: LLM on the tiny DeepSeek-V3 with MTP drafts forced right ------------------------------------

def test_mtp_llm_stop_string_inside_an_accepted_draft_run(tiny_v3_tok: Path, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    case = stop_case(tiny_v3_tok)
    assert case.want.token_ids == case.ref[: case.keep] and case.want.finish_reason == "stop"

    oracle(monkeypatch, {tuple(case.prompt): case.ref}, wrong=10**9)  # every draft right (but the very first)
    llm = LLM(model=str(tiny_v3_tok), dtype="float32", block_size=4, speculative_algorithm="MTP",
              speculative_num_steps=3)
    seen = delta_lengths(monkeypatch, llm)
    got = llm.generate({"prompt_token_ids": case.prompt}, case.params)[0].outputs[0]
    assert got.token_ids == case.want.token_ids and got.text == case.want.text
    assert (got.finish_reason, got.stop_reason) == ("stop", case.stop)
    assert [next(iter(e)) for e in got.logprobs] == got.token_ids
    assert got.cumulative_logprob == pytest.approx(case.want.cumulative_logprob, abs=1e-3)
    assert max(seen) > 1 and sum(seen) > case.keep  # multi-token deltas, and the last one ran past the stop
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    assert not llm.engine.has_work() and llm.engine.check_accounting().ok
