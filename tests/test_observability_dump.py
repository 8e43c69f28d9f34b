"""Request dump: append-only JSONL with sequence numbers, stream aggregation, and replay of what was dumped."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from appliance.observability.dump import RequestDump, StreamAggregator, open_dump, pair_records, read_dump
from appliance.observability.replay import build_replay_requests, compare_responses, replay

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def chat_body(text: str, finish: str = "stop") -> dict:
    return {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def chat_chunks(text: str) -> list[dict]:
    head = {"id": "y", "object": "chat.completion.chunk", "created": 2, "model": "m"}
    out = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}]
    for piece in (text[: len(text) // 2], text[len(text) // 2:]):
        out.append({**head, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
    out.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    out.append({**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    return out


def test_write_read_back_pairs_and_seq_continue_after_reopen(tmp_path) -> None:
    path = str(tmp_path / "d.jsonl")
    d = RequestDump(path)
    req_a = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    s0 = d.record_request(CHAT, req_a)
    s1 = d.record_request(COMPL, {"model": "m", "prompt": "a", "max_tokens": 2})
    d.record_response(s1, COMPL, {"choices": [{"index": 0, "text": "bc", "finish_reason": "length"}]})
    d.record_response(s0, CHAT, chat_body("hello"))
    d.close()
    assert (s0, s1) == (0, 1)
    lines = open(path).read().splitlines()
    assert len(lines) == 4
    first = json.loads(lines[0])
    assert set(first) == {"ts", "endpoint", "kind", "seq", "body"}
    assert first["ts"].endswith("+00:00") and first["kind"] == "request" and first["body"] == req_a

    d2 = open_dump(path)  # appends, never truncates, and continues the numbering
    assert d2.record_request(CHAT, req_a) == 2
    d2.close()
    records = read_dump(path)
    assert [r.seq for r in records] == [0, 1, 1, 0, 2]
    pairs = pair_records(records)
    got = [(q.seq, q.endpoint, p.seq if p else None) for q, p in pairs]
    assert got == [(0, CHAT, 0), (1, COMPL, 1), (2, CHAT, None)]
    assert pairs[0][1].body["choices"][0]["message"]["content"] == "hello"


def test_concurrent_writers_get_distinct_increasing_seqs(tmp_path) -> None:
    path = str(tmp_path / "d.jsonl")
    d = RequestDump(path, fsync="never")
    seqs: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(50):
            s = d.record_request(CHAT, {"x": "y" * 100})
            d.record_response(s, CHAT, {"ok": s})
            with lock:
                seqs.append(s)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d.close()
    assert sorted(seqs) == list(range(200))
    pairs = pair_records(read_dump(path))
    assert all(p is not None and p.body == {"ok": q.seq} for q, p in pairs)


def test_torn_last_line_is_skipped_but_garbage_inside_is_an_error(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    d = RequestDump(str(path))
    d.record_request(CHAT, {"a": 1})
    d.close()
    with open(path, "a") as f:
        f.write('{"ts": "t", "endpoint": "/v1/chat/comp')  # the writer died mid-line
    assert len(read_dump(str(path))) == 1
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"ts": "t", "endpoint": CHAT, "kind": "request", "seq": 5, "body": {}}) + "\n")
    with pytest.raises(ValueError, match="malformed"):
        read_dump(str(path))
    with pytest.raises(ValueError):
        RequestDump(str(tmp_path / "x"), fsync="sometimes")


def test_open_dump_none_and_temp(tmp_path, monkeypatch) -> None:
    assert open_dump(None) is None
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    d = open_dump("")
    try:
        assert d.path.startswith(str(tmp_path)) and d.path.endswith(".jsonl")
    finally:
        d.close()


def test_stream_aggregation_equals_the_non_streaming_shape() -> None:
    agg = StreamAggregator()
    for c in chat_chunks("hello"):
        agg.add(c)
    got = agg.result()
    assert got["object"] == "chat.completion" and got["id"] == "y"
    assert got["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                               "finish_reason": "stop"}]
    assert compare_responses(chat_body("hello"), got) == ()

    tools = StreamAggregator()
    head = {"object": "chat.completion.chunk"}
    tools.add({**head, "choices": [{"index": 0, "delta": {"reasoning_content": "think", "tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a"'}}]}}]})
    tools.add({**head, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]})
    msg = tools.result()["choices"][0]["message"]
    assert msg["reasoning_content"] == "think" and msg["content"] is None
    assert msg["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}]

    text = StreamAggregator()
    for piece, fin in (("ab", None), ("c", "length")):
        text.add({"object": "text_completion", "choices": [{"index": 0, "text": piece, "finish_reason": fin}]})
    assert text.result()["choices"] == [{"index": 0, "text": "abc", "finish_reason": "length"}]

    err = StreamAggregator()
    err.add(chat_chunks("x")[0])
    err.add({"error": {"message": "boom", "code": 500}})
    assert err.result() == {"error": {"message": "boom", "code": 500}}


def fake_server(answers: dict[str, str]) -> httpx.Client:
    """An OpenAI-ish server: answers each user message with answers[content], streaming when asked."""
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append({"path": request.url.path, "body": body})
        text = answers[body["messages"][-1]["content"]]
        if body.get("stream"):
            sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chat_chunks(text)) + "data: [DONE]\n\n"
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=chat_body(text))

    client = httpx.Client(base_url="http://test", transport=httpx.MockTransport(handler))
    client.seen = seen  # type: ignore[attr-defined]
    return client


def test_replay_builds_the_same_requests_and_compares(tmp_path) -> None:
    path = str(tmp_path / "d.jsonl")
    d = RequestDump(path)
    plain = {"model": "m", "messages": [{"role": "user", "content": "q1"}], "temperature": 0}
    streamed = {"model": "m", "messages": [{"role": "user", "content": "q2"}], "stream": True}
    s0 = d.record_request(CHAT, plain)
    d.record_response(s0, CHAT, chat_body("a1"))
    s1 = d.record_request(CHAT, streamed)
    agg = StreamAggregator()
    for c in chat_chunks("a2"):
        agg.add(c)
    d.record_response(s1, CHAT, agg.result(), stream=True)
    d.close()

    reqs = build_replay_requests(read_dump(path))
    assert [(r.seq, r.endpoint, r.body) for r in reqs] == [(0, CHAT, plain), (1, CHAT, streamed)]
    assert build_replay_requests(read_dump(path), seqs=[1])[0].body == streamed
    assert build_replay_requests(read_dump(path), overrides={"model": "z"})[0].body["model"] == "z"

    client = fake_server({"q1": "a1", "q2": "a2"})
    outcomes = replay(reqs, client)
    assert [o.ok for o in outcomes] == [True, True]
    assert [s["body"] for s in client.seen] == [plain, streamed]  # sent exactly as recorded

    drifted = replay(reqs, fake_server({"q1": "a1", "q2": "different"}))
    assert drifted[0].ok and not drifted[1].ok
    assert any("content" in diff for diff in drifted[1].differences)


def test_replay_tool_end_to_end(tmp_path, monkeypatch, capsys) -> None:
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "replay_dump", pathlib.Path(__file__).parents[1] / "tools" / "replay_dump.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    path = str(tmp_path / "d.jsonl")
    d = RequestDump(path)
    s = d.record_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "q1"}]})
    d.record_response(s, CHAT, chat_body("a1"))
    d.close()
    fake = fake_server({"q1": "a1"})
    monkeypatch.setattr(tool.httpx, "Client", lambda **kw: fake)
    assert tool.main([path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["ok"] is True
    assert tool.main([str(tmp_path / "missing.jsonl")]) == 2
