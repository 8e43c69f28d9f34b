"""Prometheus metrics of the HTTP server (vLLM-style names under the `appliance:` prefix).

One registry per app, so several apps in one test process do not collide. Scheduler gauges (running, waiting,
KV blocks) are refreshed from the engine's stats on every scrape; the observability issue adds histograms.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # the *_created series only double the scrape size

_SCHED_GAUGES = {
    "num_running": ("num_requests_running", "Requests in the running batch."),
    "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_blocks_total": ("kv_blocks_total", "KV cache blocks in the pool."),
    "kv_blocks_free": ("kv_blocks_free", "KV cache blocks free or held only by the prefix cache."),
    "kv_blocks_owned": ("kv_blocks_owned", "KV cache blocks owned by requests."),
    "kv_blocks_cached": ("kv_blocks_cached", "KV cache blocks held by the prefix cache, evictable."),
    "kv_cache_usage": ("kv_cache_usage_perc", "Share of KV blocks owned by requests (0-1)."),
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        self.requests = Counter("appliance:request_success", "Finished requests by finish reason.",
                                label + ["finished_reason"], registry=self.registry)
        self.errors = Counter("appliance:request_errors", "Requests that ended with an HTTP error, by status.",
                              label + ["status"], registry=self.registry)
        self.prompt_tokens = Counter("appliance:prompt_tokens", "Prompt tokens processed.", label,
                                     registry=self.registry)
        self.generation_tokens = Counter("appliance:generation_tokens", "Tokens generated.", label,
                                         registry=self.registry)
        self.in_flight = Gauge("appliance:http_requests_in_flight", "Generation requests the HTTP server holds.",
                               label, registry=self.registry)
        self.sched = {key: Gauge(f"appliance:{name}", doc, label, registry=self.registry)
                      for key, (name, doc) in _SCHED_GAUGES.items()}

    def finished(self, reason: str | None) -> None:
        self.requests.labels(self.model_name, reason or "unknown").inc()

    def error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt)
        self.generation_tokens.labels(self.model_name).inc(generated)

    def update_scheduler(self, stats: dict[str, Any]) -> None:
        for key, gauge in self.sched.items():
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.labels(self.model_name).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
