"""KV cache events: a real ZMQ subscriber receives what the real prefix cache did, frame by frame."""
from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import zmq

from appliance.config.sections_serving import KvEventsConfig
from appliance.engine.block_pool import BlockPool
from appliance.engine.prefix_cache import PrefixCache
from appliance.engine.request import Request
from appliance.engine.sampling_params import SamplingParams
from appliance.observability.kv_events import (
    END_SEQ,
    KVEventCollector,
    NullKVEventPublisher,
    ZmqKVEventPublisher,
    decode_batch,
    make_kv_event_publisher,
    offset_endpoint,
)

BS = 4
TOPIC = "kv-events"


def computed(cache: PrefixCache, tokens: list[int], rid: str) -> Request:
    r = Request(rid, list(tokens), SamplingParams(), 0.0)
    r.block_ids = cache.pool.allocate(-(-len(tokens) // BS))
    r.num_computed_tokens = len(tokens)
    cache.store(r)
    return r


def recv_batch(sub: zmq.Socket, timeout_ms: int = 3000) -> tuple[list[bytes], Any]:
    assert sub.poll(timeout_ms), "no KV event batch arrived"
    frames = sub.recv_multipart()
    return frames, msgpack.unpackb(frames[2], raw=False)


def drain_probes(pub: ZmqKVEventPublisher, sub: zmq.Socket, probe) -> None:
    """PUB drops messages sent before a subscription has propagated ("slow joiner"): publish probe batches
    until one arrives, wait until the publisher thread has sent all of them, then drain them."""
    deadline = time.monotonic() + 5
    sent = 0
    while not sub.poll(50):
        assert time.monotonic() < deadline, "subscriber never connected"
        probe()
        pub.flush()
        sent += 1
    while pub.num_published < sent:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    while sub.poll(200):
        sub.recv_multipart()


@pytest.fixture
def ipc_dir():
    """A short directory for ipc:// endpoints (socket paths are limited to ~107 bytes; tmp_path can be longer)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="obs-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ctx() -> zmq.Context:
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def rig(ctx: zmq.Context, ipc_dir):
    """A publisher on ipc endpoints (no port clashes with parallel test runs), a connected subscriber, and a
    prefix cache whose sink is the publisher."""
    ep = f"ipc://{ipc_dir}/kv"
    pub = ZmqKVEventPublisher(BS, ep, topic=TOPIC, replay_endpoint=f"ipc://{ipc_dir}/replay", buffer_steps=3,
                              ctx=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(ep)
    cache = PrefixCache(BlockPool(6), BS, on_event=pub)
    drain_probes(pub, sub, lambda: pub("AllBlocksCleared", None, None, ()))  # a clear of an empty cache
    yield pub, sub, cache
    sub.close()
    pub.close()


def test_store_evict_clear_match_the_cache_frame_by_frame(rig) -> None:
    pub, sub, cache = rig
    last_seq = -1

    def next_batch() -> list[Any]:
        nonlocal last_seq
        frames, batch = recv_batch(sub)
        assert len(frames) == 3
        assert frames[0] == TOPIC.encode()
        assert len(frames[1]) == 8
        seq = int.from_bytes(frames[1], "big")
        assert seq > last_seq
        last_seq = seq
        assert isinstance(batch, list) and len(batch) == 3
        ts, events, rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 60
        assert rank == 0
        return events

    # step 1: a request computes 9 tokens = 2 full blocks (the partial tail is private, not stored)
    r1 = computed(cache, list(range(9)), "a")
    pub.flush()
    events = next_batch()
    h0, h1 = r1.block_hashes[:2]
    assert events == [
        ["BlockStored", [h0], None, [0, 1, 2, 3], BS],
        ["BlockStored", [h1], h0, [4, 5, 6, 7], BS],
    ]
    assert {cache.cached_block(b).block_hash for b in r1.block_ids[:2]} == {h0, h1}

    # a step without cache mutations publishes nothing
    pub.flush()
    assert not sub.poll(150)

    # step 2: the request ends (its blocks become evictable), another one needs 5 of the 6 blocks: the pool
    # evicts the LRU cached block, which the cache publishes as a removal
    cache.pool.free(r1.block_ids)
    r2 = Request("b", list(range(100, 120)), SamplingParams(), 0.0)
    r2.block_ids = cache.pool.allocate(5)
    pub.flush()
    events = next_batch()
    assert events == [["BlockRemoved", [h0]]]
    assert len(cache) == 1 and cache.match(Request("c", list(range(9)), SamplingParams(), 0.0)) == []

    # step 3: r2 stores its 5 blocks, then the cache is reset: one batch, stores then one clear event
    r2.num_computed_tokens = 20
    cache.store(r2)
    cache.reset()
    pub.flush()
    events = next_batch()
    assert [e[0] for e in events] == ["BlockStored"] * 5 + ["AllBlocksCleared"]
    assert [e[1][0] for e in events[:5]] == r2.block_hashes
    assert events[-1] == ["AllBlocksCleared"]
    assert len(cache) == 0


def test_replay_returns_buffered_batches_from_a_sequence_number(rig, ctx: zmq.Context) -> None:
    pub, sub, cache = rig
    seqs: list[int] = []
    payloads: list[bytes] = []
    for i in range(4):  # 4 batches, buffer holds the last 3
        computed(cache, [10 * i + k for k in range(BS)], f"r{i}")
        pub.flush()
        frames, _ = recv_batch(sub)
        seqs.append(int.from_bytes(frames[1], "big"))
        payloads.append(frames[2])
    assert seqs == sorted(seqs) and len(set(seqs)) == 4

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        def replay(start: int) -> list[tuple[int, bytes]]:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(3000), "replay did not answer"
                empty, seq_b, payload = dealer.recv_multipart()
                assert empty == b""
                if seq_b == END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq_b, "big"), payload))

        assert replay(seqs[2]) == list(zip(seqs[2:], payloads[2:]))
        assert replay(0) == list(zip(seqs[1:], payloads[1:]))  # the oldest fell out of the 3-batch buffer
        assert replay(seqs[-1] + 1) == []
        _, events, _ = decode_batch(payloads[3])
        assert events[0][3] == [30, 31, 32, 33]
    finally:
        dealer.close()


def test_offset_endpoint_per_dp_rank() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://127.0.0.1:5557", 1) == "tcp://127.0.0.1:5558"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    assert offset_endpoint(None, 2) is None
    with pytest.raises(ValueError):
        offset_endpoint("tcp://host", 1)
    with pytest.raises(ValueError):
        offset_endpoint("udp://x:1", 1)


def test_dp_rank_is_in_the_batch_and_the_port(ctx: zmq.Context, ipc_dir) -> None:
    pub = ZmqKVEventPublisher(BS, f"ipc://{ipc_dir}/kv", dp_rank=2, ctx=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{ipc_dir}/kv_dp2")
    try:
        deadline = time.monotonic() + 5
        while not sub.poll(50):
            assert time.monotonic() < deadline
            pub("BlockRemoved", 7, None, ())
            pub.flush()
        frames = sub.recv_multipart()
        assert frames[0] == b""
        assert decode_batch(frames[2])[1:] == ([["BlockRemoved", [7]]], 2)
    finally:
        sub.close()
        pub.close()


def test_factory_follows_the_config(ctx: zmq.Context, ipc_dir) -> None:
    assert isinstance(make_kv_event_publisher(KvEventsConfig(), BS), NullKVEventPublisher)
    off = KvEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(make_kv_event_publisher(off, BS), NullKVEventPublisher)
    on = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{ipc_dir}/f",
                        topic="t", buffer_steps=5)
    pub = make_kv_event_publisher(on, BS, dp_rank=1)
    try:
        assert isinstance(pub, ZmqKVEventPublisher)
        assert pub.endpoint == f"ipc://{ipc_dir}/f_dp1"
        assert pub._buffer.maxlen == 5
    finally:
        pub.close()


def test_bad_events_and_payloads_are_rejected() -> None:
    null = NullKVEventPublisher(BS)
    null("BlockStored", 1, None, (1, 2, 3, 4))  # dropped, no error
    null.flush()
    pub_sink = KVEventCollector(BS)
    with pytest.raises(ValueError):
        pub_sink("BlockMoved", 1, None, ())
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb([1.0, [["Nope"]], 0]))
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb({"ts": 1}))


def test_subscriber_tool_replays_then_follows_live(ctx: zmq.Context, ipc_dir, capsys) -> None:
    import importlib.util
    import json
    import pathlib
    import threading

    spec = importlib.util.spec_from_file_location(
        "kv_events_subscriber", pathlib.Path(__file__).parents[1] / "tools" / "kv_events_subscriber.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ep, rep = f"ipc://{ipc_dir}/kv", f"ipc://{ipc_dir}/rep"
    pub = ZmqKVEventPublisher(BS, ep, replay_endpoint=rep, ctx=ctx)
    try:
        for h in (11, 12):
            pub("BlockStored", h, None, (1, 2, 3, 4))
            pub.flush()
        deadline = time.monotonic() + 5
        while pub.num_published < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        rc: list[int] = []
        t = threading.Thread(target=lambda: rc.append(tool.main(
            ["--endpoint", ep, "--replay-endpoint", rep, "--from-seq", "1", "--count", "1", "--json"])))
        t.start()
        while t.is_alive():  # live batches until the tool's subscription has joined and it got one
            pub("BlockRemoved", 99, None, ())
            pub.flush()
            t.join(0.05)
        assert rc == [0]
        out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert out[0] == {"seq": 1, "ts": out[0]["ts"], "dp_rank": 0, "replayed": True,
                          "events": [["BlockStored", [12], None, [1, 2, 3, 4], BS]]}
        live = [o for o in out if not o["replayed"]]
        assert len(live) == 1 and live[0]["events"] == [["BlockRemoved", [99]]] and live[0]["seq"] >= 2
        assert tool.format_event(["BlockStored", [255], None, list(range(10)), BS]).startswith(
            "BlockStored hash=0x00000000000000ff parent=- block_size=4 tokens=[0,1,2,3,4,5,6,7,...]")
    finally:
        pub.close()


def test_a_taken_port_is_a_clear_error(ctx: zmq.Context) -> None:
    first = ZmqKVEventPublisher(BS, "tcp://127.0.0.1:*", ctx=ctx)  # zmq picks a free port
    try:
        taken = first.bound_endpoint
        with pytest.raises(ValueError, match="cannot bind"):
            ZmqKVEventPublisher(BS, taken, ctx=ctx)
    finally:
        first.close()
