"""The scheduler process: EngineCore over a RemoteExecutor, fed by the tokenizer process.

Loop: drain incoming requests/aborts/stats queries; run one engine step when there is work; push the deltas as
one OutputBatch. When the engine goes idle the KV accounting is checked and a drift is logged with the numbers.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from collections import deque
from typing import Any

import zmq

from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore, QueueFull
from appliance.engine.delta import RequestDelta
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.swap import SwapCosts
from appliance.observability import SchedulerObservability
from appliance.runtime.bootstrap import Bootstrap
from appliance.runtime.gc_heap import freeze_startup_heap
from appliance.runtime.messages import (
    CONTROL_CODEC,
    OUTPUT_CODEC,
    REQUEST_CODEC,
    AbortRequest,
    GenerateRequest,
    OutputBatch,
    StageReady,
    StatsQuery,
    StatsReply,
)
from appliance.runtime.process import parent_alive
from appliance.runtime.remote_executor import RemoteExecutor
from appliance.runtime.topology import window_groups_of
from appliance.runtime.watchdog import Watchdog
from appliance.server.engine_client import RequestOutput

log = logging.getLogger("appliance.scheduler")


def delta_to_output(d: RequestDelta, first_scheduled_time: float | None = None) -> RequestOutput:
    logprobs = top = None
    if d.new_logprobs is not None:
        logprobs = [lp.logprob if lp.logprob is not None else 0.0 for lp in d.new_logprobs]
        top = [[(int(t), float(p)) for t, p in lp.top_logprobs] for lp in d.new_logprobs]
    prompt_lps = None
    if d.prompt_logprobs is not None:
        prompt_lps = [None if pos is None else [(int(t), float(p)) for t, p in pos] for pos in d.prompt_logprobs]
    return RequestOutput(d.request_id, list(d.new_token_ids), logprobs, top, prompt_lps, d.finish_reason,
                         d.num_prompt_tokens, d.num_cached_tokens, error=d.error, error_status=500 if d.error else 0,
                         first_scheduled_time=first_scheduled_time)


class FirstScheduled:
    """When each live request was first put in a batch (time.monotonic(), system wide on Linux), reported once
    with its first output so the tokenizer process can fill the queue / prefill / inference-time histograms."""

    def __init__(self) -> None:
        self._pending: dict[str, float] = {}  # scheduled, not yet reported
        self._reported: set[str] = set()

    def after_step(self, core: EngineCore, step_started: float, deltas: list[RequestDelta]) -> None:
        for rid in [r.request_id for r in core.scheduler.running] + [d.request_id for d in deltas]:
            if rid not in self._reported and rid not in self._pending:
                self._pending[rid] = step_started

    def outputs(self, deltas: list[RequestDelta]) -> list[RequestOutput]:
        out = []
        for d in deltas:
            t = self._pending.pop(d.request_id, None)
            if d.finished:
                self._reported.discard(d.request_id)
            elif t is not None:
                self._reported.add(d.request_id)
            out.append(delta_to_output(d, t))
        return out

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._reported.discard(request_id)


class SchedulerLoop:
    def __init__(self, core: EngineCore, requests: zmq.Socket, outputs: zmq.Socket, parent_pid: int,
                 obs: SchedulerObservability, vocab_size: int = 0, worker_gc_frozen: int = 0,
                 watchdog: Watchdog | None = None) -> None:
        self.core = core
        self.watchdog = watchdog  # beaten once per turn of the loop (runtime/watchdog.py)
        self.worker_gc_frozen = worker_gc_frozen  # what worker 0 froze at start-up (runtime/gc_heap.py)
        self.vocab_size = vocab_size  # > 0: token ids are checked here too, so a bad one never reaches a worker
        self.obs = obs
        self.requests = requests
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.accounting_ok = True
        self._busy = False
        # the highest GenerateRequest.seq taken in: the tokenizer process counts what is still on the way (a frame
        # without a seq, sent by anything else, leaves it alone)
        self.num_received = 0
        self.first_scheduled = FirstScheduled()
        self._ended_since_check: deque[str] = deque(maxlen=64)  # named in a drift report: the likely culprits

    def run(self) -> None:
        while parent_alive(self.parent_pid):
            if self.watchdog is not None:
                self.watchdog.beat()
            has_work = self.core.has_work()
            if self.requests.poll(0 if has_work else 50):
                self._drain_requests()
            if self.core.has_work():
                self._busy = True
                started = time.monotonic()
                deltas = self.core.step()
                self.obs.after_step(self.core, deltas)
                self.first_scheduled.after_step(self.core, started, deltas)
                self._ended_since_check.extend(d.request_id for d in deltas if d.finished)
                if deltas:
                    self._send(self.first_scheduled.outputs(deltas))
            elif self._busy:
                self._busy = False
                self._check_accounting()
            snap = self.obs.due_snapshot(self.core, spec=self.core.spec_counts())
            if snap is not None:
                self.outputs.send(OUTPUT_CODEC.encode(snap))

    def _drain_requests(self) -> None:
        rejected: list[RequestOutput] = []
        while True:
            try:
                frame = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = REQUEST_CODEC.decode_or_none(frame)
            if isinstance(msg, GenerateRequest):
                self.num_received = max(self.num_received, msg.seq)
                err = self._add(msg)
                if err is not None:
                    rejected.append(err)
            elif isinstance(msg, AbortRequest):
                for rid in msg.request_ids:
                    self.core.abort(rid)
                    self.first_scheduled.forget(rid)
                    self._ended_since_check.append(rid)
            elif isinstance(msg, StatsQuery):  # a fresh snapshot first: a /metrics scrape waits for the reply
                self.outputs.send(OUTPUT_CODEC.encode(self.obs.snapshot(self.core, spec=self.core.spec_counts())))
                self.outputs.send(OUTPUT_CODEC.encode(StatsReply(msg.query_id, self.stats())))
        if REQUEST_CODEC.num_malformed:
            log.warning("dropped %d malformed frames so far", REQUEST_CODEC.num_malformed)
        if rejected:
            self._send(rejected)

    def _add(self, msg: GenerateRequest) -> RequestOutput | None:
        try:
            params = SamplingParams.from_dict(msg.sampling)
            if self.vocab_size > 0:
                for what, ids in (("prompt", msg.prompt_token_ids), ("stop_token_ids", params.stop_token_ids)):
                    # ints (the wire checked them): min / max scan a 1k-token prompt in C, not in a Python loop
                    if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                        raise ValueError(f"{what} token ids must be in [0, {self.vocab_size})")
            self.core.add_request(msg.request_id, msg.prompt_token_ids, params)
            return None
        except QueueFull as exc:
            return RequestOutput(msg.request_id, finish_reason="error", error=str(exc), error_status=429)
        except (ValueError, TypeError) as exc:  # a bad request fails alone
            return RequestOutput(msg.request_id, finish_reason="error", error=str(exc), error_status=400)

    def _send(self, outputs: list[RequestOutput]) -> None:
        s = self.core.stats()
        self.outputs.send(OUTPUT_CODEC.encode(OutputBatch(outputs, s.num_running, s.num_waiting, self.num_received)))

    def _check_accounting(self) -> None:
        report = self.core.check_accounting()
        self.accounting_ok = report.ok
        if not report.ok:
            log.error("KV accounting drift while idle: total=%d free=%d cached=%d owned=%d problems=%s; requests "
                      "ended since the last check: %s", report.total, report.free, report.cached, report.owned,
                      "; ".join(report.problems[:10]), ", ".join(self._ended_since_check) or "none")
        self._ended_since_check.clear()

    def stats(self) -> dict[str, Any]:
        s = self.core.stats()
        return {
            "num_running": s.num_running, "num_waiting": s.num_waiting, "kv_blocks_total": s.blocks_total,
            "kv_blocks_free": s.blocks_free, "kv_blocks_cached": s.blocks_cached, "kv_blocks_owned": s.blocks_owned,
            "kv_cache_usage": s.kv_usage, "prefix_hit_rate": s.prefix_hit_rate, "num_preemptions": s.num_preemptions,
            "num_steps": s.num_steps, "accounting_ok": self.accounting_ok, "idle": not self.core.has_work(),
            "malformed_frames": REQUEST_CODEC.num_malformed,
            # speculative decoding, cumulative (0 without it): verifications, draft tokens, accepted drafts
            "spec_num_drafts": s.spec_num_drafts, "spec_num_draft_tokens": s.spec_num_draft_tokens,
            "spec_num_accepted_tokens": s.spec_num_accepted_tokens,
            # the host / disk tiers' block copies, cumulative: tier_host_stored, _loaded, tier_swapped_out, _in,
            # tier_disk_spilled, _fetched (absent without a host tier)
            **s.tier_counts,
            # objects kept out of garbage collection since start-up, here and in worker 0 (runtime/gc_heap.py)
            "gc_frozen_objects": gc.get_freeze_count(), "worker_gc_frozen_objects": self.worker_gc_frozen,
        }


def run_scheduler(boot: Bootstrap) -> None:
    config = boot.load_config()
    w0 = boot.peers["worker0"]
    ecfg = EngineConfig.from_appliance(config, int(w0["num_kv_blocks"]), w0.get("eos_token_ids", []),
                                       int(w0["max_model_len"]), int(w0.get("num_host_blocks", 0)),
                                       int(w0.get("num_state_slots", 0)), int(w0.get("state_cache_bytes", 0)),
                                       SwapCosts.from_dict(w0.get("swap_costs")), int(w0.get("num_disk_blocks", 0)),
                                       window_groups_of(w0), serving=True)
    ctx = zmq.Context()
    executor = RemoteExecutor(ctx, boot.addresses, alive=lambda: parent_alive(boot.parent_pid))
    obs = SchedulerObservability(config.observability, ecfg.block_size, dp_rank=boot.rank)  # rank = replica
    core = EngineCore(ecfg, executor, on_kv_event=obs.kv_event_sink, overlap=config.overlap_enabled())
    requests = ctx.socket(zmq.PULL)
    requests.bind(boot.addresses.requests)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 0)
    outputs.bind(boot.addresses.outputs)
    control = ctx.socket(zmq.PUSH)
    control.connect(boot.addresses.control)
    info = {"max_model_len": ecfg.max_model_len, "num_kv_blocks": ecfg.num_blocks, "block_size": ecfg.block_size,
            "max_queued_requests": ecfg.max_queued_requests, "eos_token_ids": sorted(ecfg.eos_token_ids)}
    freeze_startup_heap("scheduler")
    control.send(CONTROL_CODEC.encode(StageReady(boot.name, os.getpid(), info)))
    log.info("scheduler ready: %d KV blocks of %d tokens, max_model_len %d", ecfg.num_blocks, ecfg.block_size,
             ecfg.max_model_len)
    started = time.monotonic()
    watchdog = None
    if config.scheduler.watchdog_timeout > 0:
        watchdog = Watchdog(config.scheduler.watchdog_timeout, lambda s: _stalled(boot, s)).start()
    try:
        SchedulerLoop(core, requests, outputs, boot.parent_pid, obs, vocab_size=int(w0.get("vocab_size") or 0),
                      worker_gc_frozen=int(w0.get("gc_frozen_objects", 0)), watchdog=watchdog).run()
    finally:
        obs.close()
        core.shutdown()
        log.debug("scheduler stopped after %.0f s", time.monotonic() - started)


def _stalled(boot: Bootstrap, seconds: float) -> None:
    """The watchdog's verdict (on its thread): the supervisor logs every stage's stacks and stops the pipeline."""
    from appliance.runtime.stage import report_failure

    message = (f"no progress for {seconds:.0f} s with work to do (scheduler.watchdog_timeout); a step is stuck, "
               "the stages' Python stacks follow")
    log.error("watchdog: %s", message)
    report_failure(boot, message, dump_stacks=True)
