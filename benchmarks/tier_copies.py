"""The host KV tier's copy count on the CPU: a closed loop of agentic sessions (a shared system prompt, a history
that grows by the answer and a tool result each turn, think time between turns) drives the engine with the fake
executor under a device pool ~3x smaller than the sessions' histories and a host tier 4x the pool. It reports the
blocks the tier moved, the copy calls a worker issues for them per cache tensor of a layer (executor/block_copies.py:
one per run of consecutive host slots and device blocks, two for a host-slot run whose device blocks are
scattered) per block moved, the runs of (block, slot) pairs consecutive in both (a copy per such run is the issue
path before executor/block_copies.py),
and the distribution of the host-slot ranges' lengths; then it times HostCopier.submit on CPU tensors for the step
that moved the most blocks, with the 8B shape's layer count (32 layers, K and V) and tiny blocks.

    python -m benchmarks.tier_copies [--sessions=32] [--turns=10] [--scale=8] [--host-ratio=4] [--check-kv]
    python -m benchmarks.tier_copies --gpu    # submit() on a GPU: the 8B shape's cache, a 3,840-block reload

--scale divides the GPU benchmark's lengths (benchmarks/sessions.sh: 2048-token system prompt, 256-token first
message, 128-token answers, 320-token tool results, a 65,536-token pool, 16-token blocks).
"""
from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from dataclasses import dataclass

import torch

from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.sampling_params import SamplingParams
from appliance.executor.block_copies import host_runs
from appliance.executor.host_copy import HostCopier, Inline
from appliance.executor.kv_cache import KVCacheSpec, allocate, allocate_host

BLOCK = 16


@dataclass(frozen=True)
class Shape:
    sessions: int
    turns: int
    system: int
    user: int
    output: int
    tool: int
    pool_tokens: int
    think_steps: int
    host_ratio: int = 4  # host slots per device block

    @property
    def longest(self) -> int:
        """The last turn's prompt and answer."""
        return self.system + self.user + self.turns * (self.output + self.tool)


def shape(sessions: int, turns: int, scale: int, host_ratio: int = 4) -> Shape:
    return Shape(sessions, turns, 2048 // scale, 256 // scale, max(2, 128 // scale), 320 // scale,
                 65536 // scale, 20, host_ratio)


def drive(s: Shape, check_kv: bool) -> EngineCore:
    """Every session's turns, closed loop: a session's next turn arrives think_steps steps after its answer."""
    num_blocks = s.pool_tokens // BLOCK
    cfg = EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_model_len=s.longest, chunked_prefill_size=2048,
                       max_prefill_tokens=2048, num_host_blocks=s.host_ratio * num_blocks, max_num_seqs=s.sessions)
    core = EngineCore(cfg, FakeExecutor(num_blocks, BLOCK, vocab_size=1000, verify_kv=check_kv))
    rng = random.Random(0)
    system = [rng.randrange(10, 1000) for _ in range(s.system)]
    history = {i: system + [rng.randrange(10, 1000) for _ in range(s.user)] for i in range(s.sessions)}
    turn = dict.fromkeys(history, 0)
    due: dict[int, int] = dict.fromkeys(history, 0)  # session -> step its next turn arrives
    out: dict[str, list[int]] = {}
    step = 0
    while due or core.has_work():
        for i in [i for i, at in due.items() if at <= step]:
            del due[i]
            rid = f"s{i}-t{turn[i]}"
            out[rid] = []
            core.add_request(rid, history[i], SamplingParams(max_tokens=s.output, ignore_eos=True))
        for d in core.step() if core.has_work() else ():
            out[d.request_id].extend(d.new_token_ids)
            if d.finished:
                i = int(d.request_id[1:d.request_id.index("-")])
                history[i] = history[i] + out[d.request_id] + [rng.randrange(10, 1000) for _ in range(s.tool)]
                turn[i] += 1
                if turn[i] < s.turns:
                    due[i] = step + s.think_steps
        step += 1
    return core


@dataclass(frozen=True)
class CopyCounts:
    blocks: int  # blocks moved between the tiers
    pair_runs: int  # runs of (block, slot) pairs consecutive in both
    runs: int  # runs of consecutive host slots
    consecutive_runs: int  # of which on consecutive device blocks
    calls: int  # copy calls per cache tensor of a layer
    lengths: Counter[int]  # host-slot run length -> how many

    @classmethod
    def of(cls, plans: list[list[tuple[int, int, int]]]) -> CopyCounts:
        runs = [r for p in plans for r in host_runs(p)]
        return cls(sum(map(len, plans)), sum(map(pair_runs, plans)), len(runs), sum(r.consecutive for r in runs),
                   sum(r.calls for r in runs), Counter(len(r.blocks) for r in runs))


def report_counts(core: EngineCore, num_tensors: int) -> list[tuple[int, int, int]]:
    """Prints the copy figures; returns the step's copies that moved the most blocks."""
    plans = [p.host_copies for p in core.executor.plans]
    c = CopyCounts.of(plans)
    host = core.scheduler.cache.host
    assert host is not None
    biggest = max(plans, key=len)
    print(f"steps {len(plans)}, host hit {core.scheduler.cache.hit_rate:.3f}, stored {host.num_stored}, "
          f"loaded {host.num_loaded}, blocks moved {c.blocks}")
    print(f"runs of consecutive (block, slot) pairs, one copy each: {c.pair_runs} "
          f"({c.pair_runs / max(c.blocks, 1):.3f} per block)")
    print(f"host-slot runs: {c.runs}, {c.consecutive_runs} of them on consecutive device blocks")
    print(f"copy calls per layer tensor: {c.calls} ({c.calls / max(c.blocks, 1):.3f} per block moved); "
          f"with {num_tensors} layer tensors: {c.calls * num_tensors}")
    edges = (1, 2, 4, 8, 16, 32, 64, 128, 1 << 30)
    ranges: Counter[int] = Counter()
    weighted: Counter[int] = Counter()
    for n, k in c.lengths.items():
        e = next(e for e in edges if n <= e)
        ranges[e] += k
        weighted[e] += n * k
    print("host run length <=  runs  blocks")
    for e in edges:
        if ranges[e]:
            print(f"  {e if e < 1 << 30 else 'more':>15}  {ranges[e]:>5}  {weighted[e]:>6}")
    print(f"largest step: {len(biggest)} blocks, {sum(r.calls for r in host_runs(biggest))} calls per layer tensor "
          f"({pair_runs(biggest)} runs of consecutive pairs)")
    return biggest


def pair_runs(copies: list[tuple[int, int, int]]) -> int:
    """Runs of copies whose blocks and slots both step by one (what a copy per run of pairs would issue)."""
    n, last = 0, (-1, -2, -2)
    for d, b, s in copies:
        n += not (d == last[0] and b == last[1] + 1 and s == last[2] + 1)
        last = (d, b, s)
    return n


def time_submit(copies: list[tuple[int, int, int]], num_blocks: int, num_slots: int) -> None:
    """HostCopier.submit on CPU tensors, 32 layers of K and V with tiny blocks: the issuing cost, not the bytes."""
    spec = KVCacheSpec(num_layers=32, num_kv_heads=1, head_dim=8, block_size=BLOCK, dtype=torch.bfloat16)
    device = torch.device("cpu")
    copier = HostCopier(allocate(spec, num_blocks, device), allocate_host(spec, num_slots, device), Inline())
    copier.submit(copies)  # warm
    t0 = time.perf_counter()
    reps = 3
    for _ in range(reps):
        copier.submit(copies)
    ms = (time.perf_counter() - t0) / reps * 1e3
    print(f"HostCopier.submit of the largest step ({len(copies)} blocks, 32 layers x K/V, CPU): {ms:.1f} ms")


def issue_timed(copier: HostCopier, copies: list[tuple[int, int, int]], per_block: bool) -> tuple[float, float]:
    """(seconds to issue, seconds until the copies are done) of submit, or of one copy per block and tensor."""
    t = time.perf_counter()
    if per_block:
        with copier.stream.scope():
            for _, b, s in copies:
                for (dk, dv), (hk, hv) in zip(copier.device_caches, copier.host_caches, strict=True):
                    dk[b].copy_(hk[s], non_blocking=True)
                    if dv is not None and hv is not None:
                        dv[b].copy_(hv[s], non_blocking=True)
    else:
        copier.submit(copies)
    issued = time.perf_counter() - t
    copier.stream.drain()
    return issued, time.perf_counter() - t


LLAMA_8B = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=BLOCK, dtype=torch.bfloat16)


def gpu_submit(device: torch.device, spec: KVCacheSpec = LLAMA_8B, num_blocks: int = 4096, num_slots: int = 4096,
               histories: int = 10, history: int = 384) -> None:
    """HostCopier.submit on a GPU with the 8B shape's cache (32 layers, 8 KV heads of 128, bf16, 16-token blocks):
    a step reloading `histories` histories of `history` blocks, each in 10 ranges of host slots, into scattered
    and into consecutive device blocks, against one copy per block and tensor: host issue time, time to done."""
    copier = HostCopier.for_device(allocate(spec, num_blocks, device), allocate_host(spec, num_slots, device), device)
    stride = num_slots // (histories * 10)  # one range of history // 10 slots at the start of each stride
    slots = [r * stride + i for r in range(histories * 10) for i in range(history // 10)]
    scattered = random.Random(0).sample(range(num_blocks), len(slots))
    plans = {"scattered device blocks": [(1, b, s) for b, s in zip(scattered, slots, strict=True)],
             "consecutive device blocks": [(1, b, s) for b, s in enumerate(slots)]}
    gb = len(slots) * spec.bytes_per_block / 1e9
    for name, copies in plans.items():
        for per_block in (False, True):
            issue_timed(copier, copies, per_block)  # first use
            issued, done = issue_timed(copier, copies, per_block)
            print(f"{name}, {'one copy per block' if per_block else 'submit'}: {len(copies)} blocks, issued in "
                  f"{issued * 1e3:.1f} ms, done in {done * 1e3:.1f} ms, {gb / done:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--host-ratio", type=int, default=4, help="host slots per device block (1: the tier recycles)")
    ap.add_argument("--check-kv", action="store_true", help="the fake executor checks every position read")
    ap.add_argument("--gpu", action="store_true", help="time HostCopier.submit on the GPU with the 8B shape instead")
    a = ap.parse_args()
    if a.gpu:
        gpu_submit(torch.device("cuda"))
        return
    s = shape(a.sessions, a.turns, a.scale, a.host_ratio)
    t0 = time.perf_counter()
    core = drive(s, a.check_kv)
    print(f"{s} in {time.perf_counter() - t0:.1f} s")
    biggest = report_counts(core, 64)
    time_submit(biggest, s.pool_tokens // BLOCK, s.host_ratio * s.pool_tokens // BLOCK)


if __name__ == "__main__":
    main()
