"""The Triton MLA decode against the torch reference on random paged latent caches; one JSON line per case.

    TRITON_INTERPRET=1 python -m appliance.kernels.mla.selfcheck cpu     # small shapes, CPU interpreter
    python -m appliance.kernels.mla.selfcheck cuda                       # DeepSeek shapes on a GPU
"""
from __future__ import annotations

import json
import sys
import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    name: str
    seq_lens: tuple[int, ...]
    heads: int
    rank: int
    rope: int
    block_size: int
    dtype: torch.dtype
    tol: float = 2e-3


def small_cases() -> list[Case]:
    return [Case("ragged", (1, 7, 23, 0), 4, 32, 8, 4, torch.float32),  # 0: a padded CUDA-graph row
            Case("many_heads", (5, 40), 20, 48, 16, 16, torch.float32),
            Case("bf16", (9, 17), 16, 32, 16, 8, torch.bfloat16, tol=3e-2)]


def gpu_cases() -> list[Case]:
    return [Case("v2_lite", (1, 300, 4096, 77) * 8, 16, 512, 64, 16, torch.bfloat16, tol=3e-2),
            Case("v3_tp8", (2048,) * 64, 16, 512, 64, 64, torch.bfloat16, tol=3e-2)]


def run_case(case: Case, device: str) -> dict[str, object]:
    from appliance.kernels import (
        mla,  # noqa: F401
        registry,
    )

    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    width = case.rank + case.rope
    blocks_per = [max(1, -(-n // case.block_size)) for n in case.seq_lens]
    total = sum(blocks_per) + 3
    perm = torch.randperm(total, generator=gen)
    table = torch.zeros(len(case.seq_lens), max(blocks_per), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    cache = torch.randn(total, case.block_size, 1, width, generator=gen).to(case.dtype).to(device)
    q = torch.randn(len(case.seq_lens), case.heads, width, generator=gen).to(case.dtype).to(device)
    lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    args = (q, cache, table.to(device), lens, width**-0.5, case.rank)
    ref = registry.get("mla_decode", "torch")(*args).float()
    got = registry.get("mla_decode", "triton")(*args).float()
    ref[lens == 0] = 0.0  # the reference leaves empty rows undefined; the kernel writes zeros
    err = ((got - ref).norm() / ref.norm().clamp(min=1e-6)).item()
    # the store: the same rows into two copies of the cache, a skipped (-1) slot among them
    latent = torch.randn(5, width, generator=gen).to(case.dtype).to(device)
    slots = torch.tensor([3, -1, 0, total * case.block_size - 1, 9], device=device)
    stored = [cache.clone(), cache.clone()]
    registry.get("mla_store", "torch")(latent, stored[0], slots)
    registry.get("mla_store", "triton")(latent, stored[1], slots)
    if not torch.equal(stored[0], stored[1]):
        err = float("inf")
    return {"op": "mla_decode", "case": case.name, "err": err, "tol": case.tol}


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    for case in small_cases() if where == "cpu" else gpu_cases():
        try:
            row = run_case(case, where)
        except Exception as exc:  # noqa: BLE001 - report every case, the test names the failure
            row = {"op": "mla_decode", "case": case.name, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)
