"""What the KV tier tests share (a plain module the tests import, not a conftest): host caches of random values,
their comparison as bits (fp8 has no ==), random device caches on a GPU and the check of a store-then-load plan
on them, the copy stream that logs instead of waiting, and the session turns the offline API's tier tests run on
a small random model."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from appliance.executor.kv_cache import KVCacheSpec, allocate_host

Caches = list[tuple[torch.Tensor, torch.Tensor | None]]
CPU = torch.device("cpu")


def random_host(spec: KVCacheSpec, num_slots: int, gen: torch.Generator, device: torch.device = CPU) -> Caches:
    """The host tier's slots (allocate_host) filled with random normals drawn from gen, k before v, layer by
    layer, so a wrong slot or layer cannot pass."""
    host = allocate_host(spec, num_slots, device)
    for pair in host:
        for t in pair:
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return host


def assert_same_bits(got: Caches, want: Caches, note: object = None) -> None:
    """Every tensor of got equal to want's bit for bit; note is the failure's message."""
    assert len(got) == len(want), note
    for pair, ref in zip(got, want, strict=True):
        for x, y in zip(pair, ref, strict=True):
            assert (x is None) == (y is None), note
            if x is not None and y is not None:
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), note


def cuda_caches() -> tuple[KVCacheSpec, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Two layers of 64 device blocks of random bf16 values (16 tokens, 2 KV heads of 64) and their spec."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cuda = torch.device("cuda")
    dev = [(torch.randn(64, 16, 2, 64, device=cuda, dtype=torch.bfloat16),
            torch.randn(64, 16, 2, 64, device=cuda, dtype=torch.bfloat16)) for _ in range(spec.num_layers)]
    return spec, dev


def assert_stored_then_loaded(dev: list[tuple[torch.Tensor, torch.Tensor]],
                              before: list[tuple[torch.Tensor, torch.Tensor]], host: Caches) -> None:
    """Host slots 0..7 hold device blocks 0..7 as they were before the step rewrote them (`before`, on the host),
    and so do device blocks 40..47, loaded back from those slots."""
    for (k, v), (bk, bv), (hk, hv) in zip(dev, before, host, strict=True):
        assert hv is not None
        assert torch.equal(hk[0:8], bk) and torch.equal(hv[0:8], bv)
        assert torch.equal(k[40:48].cpu(), bk) and torch.equal(v[40:48].cpu(), bv)


class Recording:
    """The CPU's synchronous copies, with every call logged."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log, self.n = log, 0

    def begin(self) -> None:
        self.log.append(("begin", -1))

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def mark(self) -> object:
        self.n += 1
        self.log.append(("mark", self.n))
        return self.n

    def wait(self, mark: object) -> None:
        assert isinstance(mark, int)
        self.log.append(("wait", mark))

    def drain(self) -> None:
        self.log.append(("drain", -1))


def llm_args(model: Path) -> dict[str, Any]:
    """The offline API's tier tests: a 128-token device pool of 4-token blocks (32 blocks), float32."""
    return {"model": str(model), "dtype": "float32", "block_size": 4, "max_total_tokens": 128, "max_model_len": 96}


def turns() -> list[list[list[int]]]:
    """Turn 1 of two sessions, a flood of distinct prompts that needs the whole pool, turn 2 of both sessions
    (their turn-1 prompts extended), another flood, turn 3."""
    s = [list(range(10, 58)), list(range(60, 100))]
    flood = [[list(range(200 + 80 * i + 40 * t, 200 + 80 * i + 40 * t + 60)) for i in range(2)] for t in range(2)]
    return [s, flood[0], [p + list(range(120, 132)) for p in s], flood[1],
            [p + list(range(120, 132)) + list(range(140, 148)) for p in s]]
