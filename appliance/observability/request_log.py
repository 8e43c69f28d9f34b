"""Request logging (observability.enable_log_requests / log_requests_level) and the decode-progress line
(observability.decode_log_interval).

Request log levels (the config's contract, SGLang's meaning):

    0  metadata: request id, endpoint, prompt / generated / cached token counts, finish reason, latencies
    1  + sampling parameters
    2  + prompt and output text, each cut to PARTIAL_TEXT_CHARS characters (with a "...(N more)" marker)
    3  + full prompt and output text

Nothing is logged unless enable_log_requests is true. Lines go to the `appliance.requests` logger at INFO,
one line per event, `key=value` with JSON-quoted strings so a line never breaks and can be grepped / parsed.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Mapping, Sequence

__all__ = ["DecodeProgressLog", "PARTIAL_TEXT_CHARS", "RequestLogger", "clip_text"]

PARTIAL_TEXT_CHARS = 2048
_REQUEST_LOG = logging.getLogger("appliance.requests")
_DECODE_LOG = logging.getLogger("appliance.scheduler")


def clip_text(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text) - limit} more)"


def _q(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


class RequestLogger:
    """One instance per server; the HTTP layer calls `received` when a request is accepted and `finished`
    when its response is complete (or failed)."""

    def __init__(self, enabled: bool, level: int = 0, logger: logging.Logger | None = None) -> None:
        if not 0 <= level <= 3:
            raise ValueError(f"log_requests_level must be 0-3, got {level}")
        self.enabled = enabled
        self.level = level
        self.log = logger or _REQUEST_LOG

    @classmethod
    def from_config(cls, obs: Any) -> RequestLogger:
        return cls(obs.enable_log_requests, obs.log_requests_level)

    @property
    def _text_limit(self) -> int | None:
        return PARTIAL_TEXT_CHARS if self.level == 2 else None

    def received(self, request_id: str, endpoint: str, num_prompt_tokens: int,
                 params: Mapping[str, Any] | None = None, prompt: str | Sequence[int] | None = None) -> str | None:
        """Log an accepted request; returns the line (None when disabled). `prompt` is the text, or the token
        ids when the client sent ids."""
        if not self.enabled:
            return None
        parts = [f"request_id={_q(request_id)}", f"endpoint={_q(endpoint)}", f"prompt_tokens={num_prompt_tokens}"]
        if self.level >= 1 and params is not None:
            parts.append(f"params={_q(dict(params))}")
        if self.level >= 2 and prompt is not None:
            shown: Any = clip_text(prompt, self._text_limit) if isinstance(prompt, str) else \
                list(prompt)[: self._text_limit or None]
            parts.append(f"prompt={_q(shown)}")
        return self._emit("received " + " ".join(parts))

    def finished(self, request_id: str, finish_reason: str | None, num_prompt_tokens: int, num_generated: int,
                 num_cached: int = 0, e2e_s: float | None = None, ttft_s: float | None = None,
                 output: str | None = None, error: str | None = None) -> str | None:
        if not self.enabled:
            return None
        parts = [f"request_id={_q(request_id)}", f"finish_reason={_q(finish_reason)}",
                 f"prompt_tokens={num_prompt_tokens}", f"generated_tokens={num_generated}",
                 f"cached_tokens={num_cached}"]
        if e2e_s is not None:
            parts.append(f"e2e_s={e2e_s:.4f}")
        if ttft_s is not None:
            parts.append(f"ttft_s={ttft_s:.4f}")
        if error is not None:
            parts.append(f"error={_q(error)}")
        if self.level >= 2 and output is not None:
            parts.append(f"output={_q(clip_text(output, self._text_limit))}")
        return self._emit("finished " + " ".join(parts))

    def _emit(self, line: str) -> str:
        self.log.info("%s", line)
        return line
class DecodeProgressLog:
    """Every `interval` scheduler steps that generated tokens, one INFO line with the batch's state and the
    generation throughput since the previous line (the SGLang "Decode batch" line).

    The scheduler calls `on_step(core.stats(), num_generated)` after each step; `stats` needs num_running,
    num_waiting, kv_usage, blocks_owned, prefix_hit_rate (engine.EngineStats has them, and is cheap).
    """

    def __init__(self, interval: int, block_size: int, logger: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval < 1:
            raise ValueError(f"decode_log_interval must be >= 1, got {interval}")
        self.interval = interval
        self.block_size = block_size
        self.log = logger or _DECODE_LOG
        self._clock = clock
        self._steps = 0
        self._tokens = 0
        self._since = clock()
        self._spec: tuple[int, int, int, tuple[int, ...]] = (0, 0, 0, ())  # speculative counts at the last line

    def on_step(self, stats: Any, num_generated: int) -> str | None:
        """Count one step; returns the line when one was logged."""
        if num_generated <= 0:
            return None  # idle or prefill-only steps do not advance the decode counter
        self._steps += 1
        self._tokens += num_generated
        if self._steps % self.interval:
            return None
        now = self._clock()
        elapsed = now - self._since
        rate = self._tokens / elapsed if elapsed > 0 else 0.0
        line = (f"Decode batch: steps={self._steps} running={stats.num_running} waiting={stats.num_waiting} "
                f"kv_tokens={stats.blocks_owned * self.block_size} kv_usage={stats.kv_usage:.3f} "
                f"prefix_hit_rate={stats.prefix_hit_rate:.3f} gen_throughput_tok_s={rate:.2f}")
        line += self._spec_part(stats)
        self._tokens = 0
        self._since = now
        self.log.info("%s", line)
        return line

    def _spec_part(self, stats: Any) -> str:
        """Speculative decoding since the previous line: verifications, drafted / accepted / emitted tokens, the
        mean acceptance length and the acceptance rate of each draft position ("" without verifications)."""
        now = (getattr(stats, "spec_num_drafts", 0), getattr(stats, "spec_num_draft_tokens", 0),
               getattr(stats, "spec_num_accepted_tokens", 0), tuple(getattr(stats, "spec_accepted_per_pos", ())))
        before, self._spec = self._spec, now
        n, drafted, accepted = (a - b for a, b in zip(now[:3], before[:3]))
        if n <= 0:
            return ""
        per_pos = [c - (before[3][j] if j < len(before[3]) else 0) for j, c in enumerate(now[3])]
        rates = ",".join(f"{c / n:.2f}" for c in per_pos)
        return (f" spec_verifications={n} spec_drafted={drafted} spec_accepted={accepted} spec_emitted={accepted + n}"
                f" spec_mean_accept_len={1 + accepted / n:.2f} spec_accept_per_pos=[{rates}]")
