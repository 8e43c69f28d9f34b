"""Prometheus metrics of the whole pipeline, owned by the tokenizer process (where /metrics is served).

Names follow vLLM's where the meaning matches, with the prefix `appliance:` (docs/observability.md lists
each one). Two sources feed one `CollectorRegistry`:

- request-level metrics (TTFT, inter-token latency, TPOT, e2e / queue / prefill / decode time, token counters,
  finish reasons) are observed here, in the tokenizer process, which sees every request arrive, every token
  come back and every request finish: `on_request_arrived / on_request_scheduled / on_tokens /
  on_request_finished`.
- scheduler-level metrics (running / waiting, KV blocks, prefix cache, preemptions, speculative acceptance)
  come from the latest `StatsSnapshot` the scheduler process sent: `update_from_snapshot`. Its cumulative
  counters become counter increments here (the difference to the previous snapshot of the same DP rank).

Times are `time.monotonic()` seconds unless passed explicitly. On Linux that clock is system wide, so a
timestamp taken in the scheduler process (e.g. when a request was first scheduled) can be compared with one
taken here.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from appliance.observability.stats import StatsSnapshot

__all__ = ["PREFIX", "MetricsRegistry", "build_1_2_5_buckets"]

PREFIX = "appliance:"

# vLLM's buckets, with finer low ends for TTFT / ITL (small models answer in milliseconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (token-count histograms)."""
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class _Timeline:
    """What the tokenizer process knows about one in-flight request."""

    arrival: float
    num_prompt_tokens: int = 0
    max_tokens: int | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


class MetricsRegistry:
    """All metrics of one server; one registry per instance, so several servers in one process do not collide."""

    def __init__(self, model_name: str, max_model_len: int = 1 << 20, spec_decode: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.spec_decode = spec_decode
        self._lock = threading.Lock()
        self._live: dict[str, _Timeline] = {}
        self._last: dict[int, StatsSnapshot] = {}  # latest snapshot per DP rank
        self._build_request_metrics(build_1_2_5_buckets(max(1, max_model_len)))
        self._build_scheduler_metrics()

    # ---- construction ------------------------------------------------------------------------------------
    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, ("model_name",) + labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(PREFIX + name, doc, ("model_name",) + labels, registry=self.registry)

    def _hist(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, ("model_name",), buckets=buckets, registry=self.registry)

    def _build_request_metrics(self, token_buckets: tuple[int, ...]) -> None:
        m = self.model_name
        self.request_success = self._counter("request_success", "Finished requests, by finish reason.",
                                             ("finished_reason",))
        self.request_errors = self._counter("request_errors", "Requests rejected or failed with an HTTP "
                                            "error, by status.", ("status",))
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens prefilled.").labels(m)
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens the clients received "
                                               "(none past a stop string).").labels(m)
        self.requests_in_flight = self._gauge("num_requests_in_flight", "Requests the tokenizer process has "
                                              "sent to the engine and not seen finish.").labels(m)
        self.ttft = self._hist("time_to_first_token_seconds", "Arrival to first generated token.",
                               TTFT_BUCKETS).labels(m)
        self.itl = self._hist("inter_token_latency_seconds", "Time between two consecutive outputs of one "
                              "request (one observation per output).", ITL_BUCKETS).labels(m)
        self.tpot = self._hist("request_time_per_output_token_seconds", "Per request: (last token - first "
                               "token) / (generated tokens - 1).", ITL_BUCKETS).labels(m)
        self.e2e = self._hist("e2e_request_latency_seconds", "Arrival to finish.",
                              REQUEST_LATENCY_BUCKETS).labels(m)
        self.queue_time = self._hist("request_queue_time_seconds", "Arrival to first scheduled (WAITING).",
                                     REQUEST_LATENCY_BUCKETS).labels(m)
        self.prefill_time = self._hist("request_prefill_time_seconds", "First scheduled to first token "
                                       "(PREFILL).", REQUEST_LATENCY_BUCKETS).labels(m)
        self.decode_time = self._hist("request_decode_time_seconds", "First token to last token (DECODE).",
                                      REQUEST_LATENCY_BUCKETS).labels(m)
        self.inference_time = self._hist("request_inference_time_seconds", "First scheduled to last token "
                                         "(RUNNING: prefill + decode).", REQUEST_LATENCY_BUCKETS).labels(m)
        self.prompt_tokens_hist = self._hist("request_prompt_tokens", "Prompt length of finished requests.",
                                             token_buckets).labels(m)
        self.generation_tokens_hist = self._hist("request_generation_tokens", "Generated tokens of finished "
                                                 "requests (as usage.completion_tokens).", token_buckets).labels(m)
        self.max_tokens_hist = self._hist("request_params_max_tokens", "max_tokens of finished requests "
                                          "that set it.", token_buckets).labels(m)

    def _build_scheduler_metrics(self) -> None:
        e = ("engine",)
        self.g_running = self._gauge("num_requests_running", "Requests in the running batch.", e)
        self.g_waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", e)
        self.g_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV blocks held by live requests "
                                   "(0-1; evictable prefix-cache blocks count as free).", e)
        self.g_blocks = {k: self._gauge(f"kv_blocks_{k}", doc, e) for k, doc in (
            ("total", "KV cache blocks in the pool."),
            ("free", "KV cache blocks on the free list."),
            ("cached", "Unreferenced KV blocks kept for prefix hits (evictable)."),
            ("owned", "KV blocks referenced by live requests."),
        )}
        self.g_drift = self._gauge("kv_accounting_drift_blocks", "total - (free + cached + owned); non-zero "
                                   "means the block accounting is broken.", e)
        self.g_hit_rate = self._gauge("prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens over "
                                      "the engine's life (0-1).", e)
        self.g_state = {k: self._gauge(f"state_{k}", doc, e) for k, doc in (
            ("slots_total", "Request slots of the state cache of hybrid linear-attention models (0 without)."),
            ("slots_used", "State-cache slots held by running requests."),
            ("cache_bytes", "Bytes of the state cache on each worker (recurrent + convolution states)."),
        )}
        self.g_snapshot_ts = self._gauge("stats_snapshot_timestamp_seconds", "Unix time of the latest "
                                         "scheduler snapshot (staleness check).", e)
        self.c_queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", e)
        self.c_hits = self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", e)
        self.c_preempt = self._counter("num_preemptions", "Requests preempted (blocks released, recomputed "
                                       "later).", e)
        if self.spec_decode:
            self.c_drafts = self._counter("spec_decode_num_drafts", "Speculative steps that proposed drafts.", e)
            self.c_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", e)
            self.c_accepted = self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", e)
            self.c_emitted = self._counter("spec_decode_num_emitted_tokens", "Tokens verifications emitted "
                                           "(accepted drafts plus the target's own token).", e)
            self.c_per_pos = self._counter("spec_decode_num_accepted_tokens_per_pos", "Verifications that "
                                           "accepted the draft at this position (0-based).", e + ("position",))
            self.g_mean_len = self._gauge("spec_decode_mean_acceptance_length", "Tokens emitted per verification "
                                          "over the engine's life (1 + accepted / verifications).", e)
            self.g_accept = self._gauge("spec_decode_acceptance_rate", "Accepted / drafted tokens over the "
                                        "engine's life (0-1).", e)

    # ---- request events (tokenizer process) -------------------------------------------------------------
    def on_request_arrived(self, request_id: str, num_prompt_tokens: int = 0, max_tokens: int | None = None,
                           now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request {request_id!r} is already tracked")
            self._live[request_id] = _Timeline(t, num_prompt_tokens, max_tokens)
            self.requests_in_flight.set(len(self._live))

    def on_request_scheduled(self, request_id: str, when: float) -> None:
        """First time the scheduler put the request in a batch (its own monotonic clock); later calls (after
        a preemption) keep the first."""
        with self._lock:
            tl = self._live.get(request_id)
            if tl is not None and tl.scheduled is None:
                tl.scheduled = when

    def on_tokens(self, request_id: str, num_new_tokens: int, num_prompt_tokens: int | None = None,
                  now: float | None = None) -> None:
        """An output with `num_new_tokens` generated tokens arrived for the request. The first one observes
        TTFT and counts the prompt tokens as prefilled; later ones observe the inter-token latency."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0:
            return
        t = time.monotonic() if now is None else now
        with self._lock:
            tl = self._live.get(request_id)
            if tl is None:
                return  # finished or never announced: nothing to attribute the latency to
            if num_prompt_tokens is not None:
                tl.num_prompt_tokens = num_prompt_tokens
            if tl.first_token is None:
                tl.first_token = t
                self.ttft.observe(max(0.0, t - tl.arrival))
                self.prompt_tokens.inc(tl.num_prompt_tokens)
            elif tl.last_token is not None:
                self.itl.observe(max(0.0, t - tl.last_token))
            tl.last_token = t
            tl.num_generated += num_new_tokens
            self.generation_tokens.inc(num_new_tokens)

    def on_request_finished(self, request_id: str, finish_reason: str | None, now: float | None = None) -> None:
        """The request ended (stop / length / abort / error). Counted once: a second finish of the same id
        (an abort racing the last output) and unknown ids are ignored."""
        t = time.monotonic() if now is None else now
        with self._lock:
            tl = self._live.pop(request_id, None)
            if tl is None:
                return
            self.requests_in_flight.set(len(self._live))
            self.request_success.labels(self.model_name, finish_reason or "unknown").inc()
            self._observe_finished(tl, t)

    def _observe_finished(self, tl: _Timeline, t: float) -> None:
        self.e2e.observe(max(0.0, t - tl.arrival))
        self.prompt_tokens_hist.observe(tl.num_prompt_tokens)
        self.generation_tokens_hist.observe(tl.num_generated)
        if tl.max_tokens is not None:
            self.max_tokens_hist.observe(tl.max_tokens)
        if tl.first_token is not None and tl.last_token is not None:
            self.decode_time.observe(tl.last_token - tl.first_token)
            if tl.num_generated > 1:
                self.tpot.observe((tl.last_token - tl.first_token) / (tl.num_generated - 1))
        if tl.scheduled is not None:  # only when the wiring passes the scheduler's first-scheduled time
            self.queue_time.observe(max(0.0, tl.scheduled - tl.arrival))
            if tl.first_token is not None and tl.last_token is not None:
                self.prefill_time.observe(max(0.0, tl.first_token - tl.scheduled))
                self.inference_time.observe(max(0.0, tl.last_token - tl.scheduled))

    def on_http_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(int(status))).inc()

    @property
    def num_tracked(self) -> int:
        return len(self._live)

    # ---- scheduler snapshots ----------------------------------------------------------------------------
    def update_from_snapshot(self, snap: StatsSnapshot) -> None:
        """Set gauges from `snap` and advance counters by its difference to the previous snapshot of the
        same DP rank. A counter that went down means the engine restarted: its new value is the increment.
        Snapshots older than the latest one seen are ignored (they can arrive out of order)."""
        lab = (self.model_name, str(snap.dp_rank))
        with self._lock:
            prev = self._last.get(snap.dp_rank)
            if prev is not None and snap.timestamp < prev.timestamp:
                return
            self._last[snap.dp_rank] = snap
        self.g_running.labels(*lab).set(snap.num_running)
        self.g_waiting.labels(*lab).set(snap.num_waiting)
        self.g_usage.labels(*lab).set(snap.kv_cache_usage)
        for key, gauge in self.g_blocks.items():
            gauge.labels(*lab).set(getattr(snap, f"kv_blocks_{key}"))
        self.g_drift.labels(*lab).set(snap.kv_accounting_drift)
        q, h = snap.prefix_cache_queries, snap.prefix_cache_hits
        self.g_hit_rate.labels(*lab).set(h / q if q else 0.0)
        self.g_snapshot_ts.labels(*lab).set(snap.timestamp)
        for key, gauge in self.g_state.items():
            gauge.labels(*lab).set(getattr(snap, f"state_{key}"))
        pairs = [(self.c_queries, "prefix_cache_queries"), (self.c_hits, "prefix_cache_hits"),
                 (self.c_preempt, "num_preemptions")]
        if self.spec_decode:
            pairs += [(self.c_drafts, "spec_num_drafts"), (self.c_draft_tokens, "spec_num_draft_tokens"),
                      (self.c_accepted, "spec_num_accepted_tokens")]
            d, a = snap.spec_num_draft_tokens, snap.spec_num_accepted_tokens
            self.g_accept.labels(*lab).set(a / d if d else 0.0)
            n = snap.spec_num_drafts
            self.g_mean_len.labels(*lab).set(1.0 + a / n if n else 0.0)
            self._advance(self.c_emitted.labels(*lab), a + n, (prev.spec_num_accepted_tokens + prev.spec_num_drafts)
                          if prev is not None else 0)
            before = prev.spec_accepted_per_pos if prev is not None else []
            for j, count in enumerate(snap.spec_accepted_per_pos):
                self._advance(self.c_per_pos.labels(*lab, str(j)), count, before[j] if j < len(before) else 0)
        for counter, field in pairs:
            # exported from the first snapshot on, at 0 until something counts
            self._advance(counter.labels(*lab), getattr(snap, field), getattr(prev, field) if prev is not None else 0)

    @staticmethod
    def _advance(child: Any, new: int, old: int) -> None:
        """Move a counter to a snapshot's cumulative value; one that went down restarted: new is the increment."""
        inc = new - old if new >= old else new
        if inc:
            child.inc(inc)

    # ---- exposition -------------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
