"""Overlap scheduling through the runtime's RemoteExecutor: two worker ranks (threads running FakeExecutors
behind real zmq sockets) get plan N+1 while they compute step N; a fast rank's answer to step N+1 that arrives
before the slow rank's answer to step N is kept for its own collect, and the outputs equal the reference."""
from __future__ import annotations

import threading
import time

import zmq

from appliance.engine import EngineConfig, EngineCore, SamplingParams
from appliance.engine.fake_executor import FakeExecutor, reference_generation
from appliance.runtime.addresses import Addresses, remove_dir
from appliance.runtime.messages import PLAN_CODEC, RESULT_CODEC
from appliance.runtime.remote_executor import RemoteExecutor


def _worker(ctx: zmq.Context, addrs: Addresses, rank: int, stop: threading.Event, log: list) -> None:
    plans = ctx.socket(zmq.PULL)
    plans.bind(addrs.plans[rank])
    results = ctx.socket(zmq.PUSH)
    results.connect(addrs.results)
    fake = FakeExecutor(64, 4)
    try:
        while not stop.is_set():
            if not plans.poll(50):
                continue
            plan = PLAN_CODEC.decode_or_none(plans.recv())
            if rank == 1:
                time.sleep(0.01)  # the slow rank: rank 0 runs ahead by a step
            log.append((rank, plan.step_id))
            results.send_multipart([str(rank).encode(), RESULT_CODEC.encode(fake.execute(plan))])
    finally:
        plans.close(0)
        results.close(0)


def test_overlap_over_two_ranks_keeps_early_answers() -> None:
    addrs, base = Addresses.in_new_dir(2)
    ctx = zmq.Context()
    stop = threading.Event()
    log: list = []
    threads = [threading.Thread(target=_worker, args=(ctx, addrs, r, stop, log), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(0.1)  # the workers bind their plan sockets first (ipc: the worker binds)
    deadline = time.monotonic() + 20  # a lost answer fails the test (WorkerFailed) instead of hanging it
    ex = RemoteExecutor(ctx, addrs, alive=lambda: time.monotonic() < deadline)
    core = EngineCore(EngineConfig(num_blocks=64, block_size=4, max_model_len=64), ex, overlap=True)
    try:
        prompts = {"a": [1, 2, 3, 4, 5], "b": [9, 8, 7]}
        for rid, p in prompts.items():
            core.add_request(rid, p, SamplingParams(max_tokens=6, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while core.has_work():
            for d in core.step():
                out.setdefault(d.request_id, []).extend(d.new_token_ids)
        for rid, p in prompts.items():
            assert out[rid] == reference_generation(FakeExecutor(1, 1).next_token, p, 6, 64)[0]
        assert core.check_accounting().ok
        # rank 0 answered a step before rank 1 answered the previous one, at least once
        order = [s for r, s in log if r == 0]
        assert any(log.index((0, s + 1)) < log.index((1, s)) for s in order[:-1] if (1, s) in log)
        assert not ex._early  # every early answer was collected
    finally:
        stop.set()
        for t in threads:
            t.join(2)
        ex.shutdown()
        ctx.term()
        remove_dir(base)
