"""KV cache events: prefix-cache stores and removals, published over ZMQ as multipart
messages carrying a msgpack KVEventBatch.

Each batch is three frames on a PUB socket:

    topic (utf-8 bytes, may be empty) | sequence number (8 bytes, big-endian, from 0) | msgpack KVEventBatch

    KVEventBatch = [ts, events, dp_rank]           ts: time.time() float when the batch was flushed
    event        = ["BlockStored", [block_hash], parent_hash, token_ids, block_size]
                 | ["BlockRemoved", [block_hash]]
                 | ["AllBlocksCleared"]

Blocks of the host-memory tier (engine/host_tier.py) add vLLM's trailing fields: ["BlockStored", [block_hash],
parent_hash, token_ids, block_size, lora_id (None), "CPU"] when a block is copied to the host and ["BlockRemoved",
[block_hash], "CPU"] when its host slot is reused; the disk tier behind it (engine/disk_tier.py) does the same with
medium "DISK" when a block is spilled to disk and when its disk slot is reused; events without a medium are the
device's.

Hashes are the prefix cache's chained 64-bit hashes (unsigned, parent_hash None for a first block). The
publisher is the prefix cache's event sink (`PrefixCache(on_event=publisher)`): events are collected as the
scheduler mutates the cache and `flush()` (once per scheduler step) turns them into one batch, so events keep
the cache's order and a batch never mixes steps.

Replay (optional `replay_endpoint`, a ROUTER socket, the protocol of vLLM's ZmqEventPublisher): a DEALER
client sends `[b"", start_seq (8 bytes big-endian)]`; the publisher answers with one `[b"", seq, payload]`
message per buffered batch with seq >= start_seq, then `[b"", -1 (8 bytes big-endian, signed), b""]` (a REQ
socket would see only the first answer). The buffer keeps the last `buffer_steps` batches.

Sockets live in one publisher thread (ZMQ sockets are not thread safe), so a slow subscriber never stalls the
scheduler: `flush()` only encodes and enqueues. A full queue drops the batch and counts it (`num_dropped`);
the sequence number is assigned when the thread sends, so a drop leaves no gap for subscribers to misread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Protocol

import msgpack
import zmq

from appliance.engine.prefix_cache import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED

if TYPE_CHECKING:
    from appliance.config.sections_serving import KvEventsConfig

__all__ = [
    "END_SEQ", "KVEventCollector", "NullKVEventPublisher", "ZmqKVEventPublisher", "decode_batch",
    "make_kv_event_publisher", "offset_endpoint",
]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint of data-parallel rank `dp_rank`: tcp ports are offset by the rank, ipc / inproc paths
    get a `_dp<rank>` suffix; rank 0 keeps the configured endpoint."""
    if endpoint is None or dp_rank == 0:
        return endpoint
    if dp_rank < 0:
        raise ValueError(f"dp_rank must be >= 0, got {dp_rank}")
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit() or host == "tcp":
            raise ValueError(f"KV events endpoint {endpoint!r} has no numeric port to offset by the DP rank")
        return f"{host}:{int(port) + dp_rank}"
    raise ValueError(f"KV events endpoint {endpoint!r}: expected tcp://, ipc:// or inproc://")


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]], int]:
    """Decode one msgpack KVEventBatch (subscribers, tests); raises ValueError on a malformed one."""
    obj = msgpack.unpackb(payload, raw=False)
    if not (isinstance(obj, list) and len(obj) == 3 and isinstance(obj[1], list)):
        raise ValueError("KVEventBatch must be [ts, events, dp_rank]")
    ts, events, rank = obj
    for ev in events:
        if not (isinstance(ev, list) and ev and ev[0] in (BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED)):
            raise ValueError(f"unknown KV event {ev!r}")
    return float(ts), events, int(rank)


class KVEventCollector:
    """The prefix cache's event sink: turns each mutation into a wire-format event and keeps it until flush."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._pending: list[list[Any]] = []

    def __call__(self, kind: str, block_hash: int | None, parent_hash: int | None,
                 token_ids: tuple[int, ...], medium: str | None = None) -> None:
        tail = [] if medium is None else [medium]
        if kind == BLOCK_STORED:
            self._pending.append([BLOCK_STORED, [block_hash], parent_hash, list(token_ids), self.block_size]
                                 + ([None, medium] if medium else []))
        elif kind == BLOCK_REMOVED:
            self._pending.append([BLOCK_REMOVED, [block_hash], *tail])
        elif kind == ALL_BLOCKS_CLEARED:
            self._pending.append([ALL_BLOCKS_CLEARED])
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")

    def take(self) -> list[list[Any]]:
        out, self._pending = self._pending, []
        return out


class KVEventPublisher(Protocol):
    def __call__(self, kind: str, block_hash: int | None, parent_hash: int | None,
                 token_ids: tuple[int, ...], medium: str | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NullKVEventPublisher(KVEventCollector):
    """Events disabled: the sink accepts and drops (the engine can always be given a sink)."""

    def __init__(self, block_size: int = 1) -> None:
        super().__init__(block_size)

    def __call__(self, kind: str, block_hash: int | None, parent_hash: int | None,
                 token_ids: tuple[int, ...], medium: str | None = None) -> None:
        return

    def flush(self) -> None:
        return

    def close(self) -> None:
        return


class ZmqKVEventPublisher(KVEventCollector):
    """PUB socket (bound) + optional ROUTER replay socket, served by one background thread."""

    POLL_S = 0.05

    def __init__(self, block_size: int, endpoint: str, topic: str = "", dp_rank: int = 0,
                 replay_endpoint: str | None = None, buffer_steps: int = 10000, hwm: int = 100000,
                 max_queue_size: int = 100000, clock: Callable[[], float] = time.time,
                 ctx: zmq.Context | None = None) -> None:
        super().__init__(block_size)
        if buffer_steps < 1 or max_queue_size < 1 or hwm < 0:
            raise ValueError("buffer_steps and max_queue_size must be >= 1, hwm >= 0")
        self.dp_rank = dp_rank
        self.endpoint = offset_endpoint(endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint(replay_endpoint, dp_rank)
        self._topic = topic.encode("utf-8")
        self._clock = clock
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0
        self.num_published = 0
        self._closed = False
        ctx = ctx or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(self.endpoint)
            self.bound_endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()  # wildcard ports resolved
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise ValueError(f"KV events: cannot bind {self.endpoint} / {self.replay_endpoint}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{dp_rank}", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s (replay %s, topic %r)", self.endpoint, self.replay_endpoint, topic)

    def flush(self) -> None:
        """Publish the events collected since the last flush as one batch (nothing when there are none)."""
        events = self.take()
        if not events:
            return
        if self._closed:
            raise RuntimeError("KV event publisher is closed")
        payload = msgpack.packb([self._clock(), events, self.dp_rank], use_bin_type=True)
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("KV events: publisher queue full, %d batches dropped", self.num_dropped)

    def close(self, timeout: float = 2.0) -> None:
        """Flush, send what is queued, and close the sockets."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV events: publisher thread did not stop within %.1fs", timeout)

    # ---- publisher thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except zmq.ZMQError:  # a client that went away must not stop publishing
                        log.exception("KV events: replay failed")
                try:
                    item = self._queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                try:
                    self._send(item)
                except zmq.ZMQError:
                    self.num_dropped += 1
                    log.exception("KV events: send failed, batch dropped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, payload: bytes) -> None:
        seq = self._next_seq
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._next_seq += 1  # only after a send, so a failed one leaves no gap
        self._buffer.append((seq, payload))
        self.num_published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def make_kv_event_publisher(cfg: KvEventsConfig, block_size: int, dp_rank: int = 0) -> KVEventCollector:
    """The publisher `config.observability.kv_events` asks for (a `KvEventsConfig`).

    Events are published only when `enable_kv_cache_events` is true and `publisher` is "zmq"; otherwise the
    null publisher is returned (and an inconsistent pair is logged, not silently dropped).
    """
    if cfg.enable_kv_cache_events and cfg.publisher == "zmq":
        return ZmqKVEventPublisher(
            block_size, cfg.endpoint, topic=cfg.topic, dp_rank=dp_rank, replay_endpoint=cfg.replay_endpoint,
            buffer_steps=cfg.buffer_steps, hwm=cfg.hwm, max_queue_size=cfg.max_queue_size,
        )
    if cfg.enable_kv_cache_events:
        log.warning("KV events: enable_kv_cache_events is set but publisher is %r; nothing is published",
                    cfg.publisher)
    elif cfg.publisher == "zmq":
        log.warning("KV events: publisher is 'zmq' but enable_kv_cache_events is false; nothing is published")
    return NullKVEventPublisher(block_size)
