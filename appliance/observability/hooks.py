"""The two places the pipeline calls observability from: the scheduler process and the tokenizer process.

Each bundles what its process owns so the wiring is a handful of calls (listed in __init__.py):

- `SchedulerObservability` (scheduler process): the KV event publisher (the prefix cache's event sink), the
  decode-progress log, and timed `StatsSnapshot`s for the tokenizer process.
- `FrontendObservability` (tokenizer process): the `MetricsRegistry` behind /metrics, the request logger and
  the request dump. Engine outputs go to `on_output`, snapshots to `on_snapshot`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from appliance.observability.dump import RequestDump, open_dump
from appliance.observability.kv_events import KVEventCollector, make_kv_event_publisher
from appliance.observability.metrics import MetricsRegistry
from appliance.observability.request_log import DecodeProgressLog, RequestLogger
from appliance.observability.stats import StatsSnapshot, snapshot_from_core

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

__all__ = ["FrontendObservability", "SchedulerObservability"]


class SchedulerObservability:
    def __init__(self, obs: Any, block_size: int, dp_rank: int = 0, snapshot_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`obs` is config.observability. Snapshots are produced only when metrics are enabled."""
        if snapshot_interval_s <= 0:
            raise ValueError(f"snapshot_interval_s must be > 0, got {snapshot_interval_s}")
        self.dp_rank = dp_rank
        self.kv_events: KVEventCollector = make_kv_event_publisher(obs.kv_events, block_size, dp_rank)
        self.decode_log = DecodeProgressLog(obs.decode_log_interval, block_size)
        self.metrics_enabled = bool(obs.enable_metrics)
        self.snapshot_interval_s = snapshot_interval_s
        self._clock = clock
        self._last_snapshot = float("-inf")

    @property
    def kv_event_sink(self) -> KVEventCollector:
        """Pass as `EngineCore(..., on_kv_event=...)`."""
        return self.kv_events

    def after_step(self, core: Any, deltas: Sequence[Any]) -> None:
        """After every `core.step()` (and after `core.reset_prefix_cache()`, with no deltas): one KV event
        batch for the step's cache mutations, and the decode-progress count."""
        self.kv_events.flush()
        generated = sum(len(d.new_token_ids) for d in deltas)
        if generated:
            self.decode_log.on_step(core.stats(), generated)

    def due_snapshot(self, core: Any, spec: tuple[int, int, int] = (0, 0, 0)) -> StatsSnapshot | None:
        """Every loop iteration, busy or idle: a snapshot when snapshot_interval_s has passed (else None)."""
        if not self.metrics_enabled:
            return None
        now = self._clock()
        if now - self._last_snapshot < self.snapshot_interval_s:
            return None
        self._last_snapshot = now
        return self.snapshot(core, spec)

    def snapshot(self, core: Any, spec: tuple[int, int, int] = (0, 0, 0)) -> StatsSnapshot:
        """On demand (a stats query); counts blocks with the full accounting check."""
        return snapshot_from_core(core, self.dp_rank, spec=spec)

    def close(self) -> None:
        self.kv_events.close()


class FrontendObservability:
    def __init__(self, config: ApplianceConfig, model_name: str, max_model_len: int) -> None:
        """`config` is the whole ApplianceConfig (observability and speculative sections are read)."""
        obs = config.observability
        spec_on = getattr(config.speculative, "algorithm", None) is not None
        self.metrics: MetricsRegistry | None = (
            MetricsRegistry(model_name, max_model_len, spec_decode=spec_on) if obs.enable_metrics else None)
        self.request_log = RequestLogger.from_config(obs)
        self.dump: RequestDump | None = open_dump(obs.dump_path)

    def request_arrived(self, request_id: str, num_prompt_tokens: int, max_tokens: int | None = None,
                        now: float | None = None) -> None:
        """When the engine request is sent (after tokenization), once per engine request (n > 1 fans out)."""
        if self.metrics is not None:
            self.metrics.on_request_arrived(request_id, num_prompt_tokens, max_tokens, now)

    def on_output(self, out: Any, now: float | None = None, num_taken: int | None = None,
                  stopped_by_text: bool = False) -> bool:
        """A RequestOutput (server.engine_client.RequestOutput) as the client's stream took it, in arrival
        order; returns whether the request's finish was recorded.

        The metrics count what the client receives (usage.completion_tokens), not what the engine generated:
        `num_taken` is how many of the output's tokens the consumer took before it closed (None: all of them;
        fewer when a stop string matched inside a speculative step's multi-token output), and
        `stopped_by_text` says the consumer matched a stop string, so the request finished "stop" here whatever
        the engine reported. An output cut short without a stop string (the client went away) records no
        finish: the caller reports the abort."""
        if self.metrics is None:
            return False
        n = len(out.new_token_ids)
        taken = n if num_taken is None else num_taken
        if not 0 <= taken <= n:
            raise ValueError(f"num_taken must be in [0, {n}], got {num_taken}")
        finish = out.finish_reason if taken == n else None
        if stopped_by_text:
            finish = "stop"
        scheduled = getattr(out, "first_scheduled_time", None)  # optional field, see __init__.py
        if scheduled is not None:
            self.metrics.on_request_scheduled(out.request_id, scheduled)
        if taken:
            self.metrics.on_tokens(out.request_id, taken, out.num_prompt_tokens or None, now)
        if finish is not None:
            self.metrics.on_request_finished(out.request_id, finish, now)
        return finish is not None

    def request_aborted(self, request_id: str, now: float | None = None) -> None:
        """The client went away or the server aborted, and no finished output will come."""
        if self.metrics is not None:
            self.metrics.on_request_finished(request_id, "abort", now)

    def on_snapshot(self, snap: StatsSnapshot) -> None:
        if self.metrics is not None:
            self.metrics.update_from_snapshot(snap)

    def render(self) -> tuple[bytes, str]:
        if self.metrics is None:
            raise RuntimeError("metrics are disabled (observability.enable_metrics = false)")
        return self.metrics.render()

    def close(self) -> None:
        if self.dump is not None:
            self.dump.close()
