"""Observability: Prometheus metrics, KV cache events, request logs, decode-progress logs, request dumps.

Modules: stats.py (StatsSnapshot, the scheduler -> tokenizer record), metrics.py (MetricsRegistry, /metrics),
kv_events.py (ZMQ PUB of msgpack KVEventBatch multiparts, replay), request_log.py (RequestLogger,
DecodeProgressLog), dump.py (JSONL dump, StreamAggregator), replay.py (resend a dump, compare), hooks.py (the
two per-process bundles below). Reference: docs/observability.md.

WIRING (the only calls the pipeline makes; nothing here imports server/ or runtime/):

Scheduler process (runtime/scheduler_proc.py, `run_scheduler` / `SchedulerLoop`):
  1. obs = SchedulerObservability(config.observability, ecfg.block_size, dp_rank=<DP rank, 0 without DP>)
  2. core = EngineCore(ecfg, executor, on_kv_event=obs.kv_event_sink)
  3. in SchedulerLoop.run, after `deltas = self.core.step()`:           obs.after_step(self.core, deltas)
     after `self.core.reset_prefix_cache()` (if ever called):          obs.after_step(self.core, [])
  4. every loop iteration (busy or idle):
         snap = obs.due_snapshot(self.core)
         if snap is not None: self.outputs.send(OUTPUT_CODEC.encode(snap))
     on a StatsQuery (on-demand refresh before a scrape), also send obs.snapshot(self.core)
  5. in the `finally` of run_scheduler:                                 obs.close()
  runtime/messages.py: add StatsSnapshot to OUTPUT_CODEC = Codec(OutputBatch, StatsReply, StatsSnapshot)
  (it is a frozen dataclass of ints and a float; the typed Codec carries it as is - tested).

Tokenizer process (runtime/tokenizer_proc.py, runtime/frontend.py, server/):
  1. fobs = FrontendObservability(config, served_model_name, max_model_len)  (put it on the ServerContext)
  2. frontend.py, when a GenerateRequest is sent:  fobs.request_arrived(request_id, len(prompt_token_ids),
                                                                        sampling.max_tokens)
  3. frontend.py `ZmqEngineClient.generate`, as the consumer takes each output (not when it arrives):
     fobs.on_output(out, arrival_time, num_taken=..., stopped_by_text=...)
     for a StatsSnapshot message:                                       fobs.on_snapshot(msg)
     when a request is aborted by the client and no final output will be routed: fobs.request_aborted(rid)
  4. server/app.py /metrics (404 when fobs.metrics is None, i.e. enable_metrics is false; optionally send a
     StatsQuery first for a fresh snapshot): body, ctype = fobs.render()  (replaces server/metrics.ServerMetrics; its
     request_errors counter is MetricsRegistry.on_http_error(status))
  5. server handlers (chat.py / completions.py) when fobs.dump is not None:
         seq = fobs.dump.record_request(request.url.path, body_json)
         non-streaming: fobs.dump.record_response(seq, path, response_json)
         streaming:     agg = StreamAggregator(); agg.add(chunk_dict) for every SSE chunk (and error event);
                        at the end fobs.dump.record_response(seq, path, agg.result(), stream=True)
     and fobs.request_log.received(...) / .finished(...) where the request is accepted / completed.
  6. shutdown: fobs.close()

Queue / prefill / inference time histograms: the scheduler's first-scheduled time per request
(time.monotonic(), system wide on Linux) travels as `RequestOutput.first_scheduled_time` on the first output of a
request (runtime/scheduler_proc.py `FirstScheduled`); `on_output` reads it. Without it those three histograms
stay empty (TTFT, ITL, TPOT, e2e and decode time do not need it).
"""
from __future__ import annotations

import importlib
from typing import Any

# name -> its module: imported on first use, so a process that needs one of them (the worker reads StatsSnapshot's
# module through runtime/messages.py) does not import prometheus_client and the rest with it
_MODULES = {
    "RequestDump": "dump", "StreamAggregator": "dump", "open_dump": "dump", "read_dump": "dump",
    "FrontendObservability": "hooks", "SchedulerObservability": "hooks",
    "NullKVEventPublisher": "kv_events", "ZmqKVEventPublisher": "kv_events", "decode_batch": "kv_events",
    "make_kv_event_publisher": "kv_events", "offset_endpoint": "kv_events",
    "MetricsRegistry": "metrics", "DecodeProgressLog": "request_log", "RequestLogger": "request_log",
    "StatsSnapshot": "stats", "snapshot_from_core": "stats",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'appliance.observability' has no attribute {name!r}")
    return getattr(importlib.import_module(f"appliance.observability.{_MODULES[name]}"), name)
