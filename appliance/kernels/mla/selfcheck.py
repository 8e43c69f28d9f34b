"""The Triton MLA store, decode and prefill against the torch reference on random paged latent caches; one JSON
line per case.

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
    kv: torch.dtype | None = None  # an fp8 latent cache (its scale KV_SCALE), or the activation dtype


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KV_SCALE = 0.05  # an fp8 cache's scale: normal latents land mid-range, the store's outliers (x1000) saturate


def small_cases() -> list[Case]:
    return [Case("ragged", (1, 7, 23, 0), 4, 32, 8, 4, torch.float32),  # 0: a padded CUDA-graph row
            Case("many_heads", (5, 40), 20, 48, 16, 16, torch.float32),
            Case("bf16", (9, 17), 16, 32, 16, 8, torch.bfloat16, tol=3e-2),
            Case("fp8_e4m3_bf16", (9, 17, 0), 16, 32, 16, 8, torch.bfloat16, tol=3e-2, kv=E4M3),
            Case("fp8_e5m2_f32", (5, 40), 4, 48, 16, 16, torch.float32, kv=E5M2)]


def gpu_cases() -> list[Case]:
    return [Case("v2_lite", (1, 300, 4096, 77) * 8, 16, 512, 64, 16, torch.bfloat16, tol=3e-2),
            Case("v3_tp8", (2048,) * 64, 16, 512, 64, 64, torch.bfloat16, tol=3e-2),
            Case("v3_tp8_fp8", (2048,) * 64, 16, 512, 64, 64, torch.bfloat16, tol=3e-2, kv=E4M3)]


@dataclass(frozen=True)
class PrefillCase:
    name: str
    q_lens: tuple[int, ...]  # new tokens per sequence (the last q_len of its seq_len)
    seq_lens: tuple[int, ...]
    heads: int
    nope: int
    rope: int
    rank: int
    v_dim: int
    block_size: int
    dtype: torch.dtype
    tol: float = 2e-3
    kv: torch.dtype | None = None


def small_prefill_cases() -> list[PrefillCase]:
    return [PrefillCase("prefill_ragged", (5, 1, 23, 0, 3), (5, 9, 40, 6, 3), 3, 16, 8, 32, 16, 4, torch.float32),
            PrefillCase("prefill_bf16", (17, 4), (17, 30), 4, 16, 16, 48, 24, 8, torch.bfloat16, tol=3e-2),
            PrefillCase("prefill_fp8_e4m3_bf16", (17, 4), (17, 30), 4, 16, 16, 48, 24, 8, torch.bfloat16, tol=3e-2,
                        kv=E4M3)]


def gpu_prefill_cases() -> list[PrefillCase]:
    return [PrefillCase("prefill_v2_lite", (1024, 77, 300, 1), (1024, 2000, 300, 4096), 16, 128, 64, 512, 128, 16,
                        torch.bfloat16, tol=3e-2),
            PrefillCase("prefill_v3_tp8", (2048,) * 4, (2048, 4096, 6000, 8192), 16, 128, 64, 512, 128, 64,
                        torch.bfloat16, tol=3e-2),
            PrefillCase("prefill_v3_tp8_fp8", (2048,) * 4, (2048, 4096, 6000, 8192), 16, 128, 64, 512, 128, 64,
                        torch.bfloat16, tol=3e-2, kv=E4M3)]


def _paged_cache(gen: torch.Generator, lens: tuple[int, ...], block_size: int, width: int, dtype: torch.dtype,
                 device: str, kv: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache (fp8 with scale KV_SCALE when `kv` says so) and each sequence's shuffled block table."""
    blocks_per = [max(1, -(-n // block_size)) for n in lens]
    total = sum(blocks_per) + 3
    perm = torch.randperm(total, generator=gen)
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    cache = torch.randn(total, block_size, 1, width, generator=gen).to(dtype).to(device)
    if kv is not None:
        from appliance.kernels.reference.kv_quant import quantize

        cache = quantize(cache, torch.tensor([KV_SCALE], device=device), kv)
    return cache, table.to(device)


def _scale(case: Case | PrefillCase, device: str) -> dict[str, torch.Tensor]:
    return {} if case.kv is None else {"kv_scale": torch.tensor([KV_SCALE], device=device)}


def run_prefill_case(case: PrefillCase, device: str) -> dict[str, object]:
    from appliance.kernels import (
        mla,  # noqa: F401
        registry,
    )

    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    cache, table = _paged_cache(gen, case.seq_lens, case.block_size, case.rank + case.rope, case.dtype, device,
                                case.kv)
    t = sum(case.q_lens)
    q = torch.randn(t, case.heads, case.nope + case.rope, generator=gen).to(case.dtype).to(device)
    w_uk = (torch.randn(case.heads, case.nope, case.rank, generator=gen) * case.rank**-0.5).to(case.dtype).to(device)
    w_uv = (torch.randn(case.heads, case.v_dim, case.rank, generator=gen) * case.rank**-0.5).to(case.dtype).to(device)
    cu = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    args = (q, cache, cu, lens, table, w_uk, w_uv, (case.nope + case.rope) ** -0.5)
    ref = registry.get("mla_prefill", "torch")(*args, **_scale(case, device)).float()
    got = registry.get("mla_prefill", "triton")(*args, **_scale(case, device)).float()
    err = ((got - ref).norm() / ref.norm().clamp(min=1e-6)).item()
    return {"op": "mla_prefill", "case": case.name, "err": err, "tol": case.tol}


def run_case(case: Case, device: str) -> dict[str, object]:
    from appliance.kernels import (
        mla,  # noqa: F401
        registry,
    )

    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    width = case.rank + case.rope
    cache, table = _paged_cache(gen, case.seq_lens, case.block_size, width, case.dtype, device, case.kv)
    total = cache.shape[0]
    q = torch.randn(len(case.seq_lens), case.heads, width, generator=gen).to(case.dtype).to(device)
    lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    args = (q, cache, table, lens, width**-0.5, case.rank)
    ref = registry.get("mla_decode", "torch")(*args, **_scale(case, device)).float()
    got = registry.get("mla_decode", "triton")(*args, **_scale(case, device)).float()
    ref[lens == 0] = 0.0  # the reference leaves empty rows undefined; the kernel writes zeros
    err = ((got - ref).norm() / ref.norm().clamp(min=1e-6)).item()
    # the store: the same rows into two copies of the cache, a skipped (-1) slot among them
    latent = torch.randn(5, width, generator=gen).to(case.dtype).to(device)
    if case.kv is not None:
        latent.view(-1)[::7] *= 1000  # outliers past the fp8 range: the stores saturate, never NaN
    slots = torch.tensor([3, -1, 0, total * case.block_size - 1, 9], device=device)
    stored = [cache.clone(), cache.clone()]
    registry.get("mla_store", "torch")(latent, stored[0], slots, **_scale(case, device))
    registry.get("mla_store", "triton")(latent, stored[1], slots, **_scale(case, device))
    # compared as float: fp8 tensors have no torch.equal on every build
    if not torch.equal(stored[0].float(), stored[1].float()) or torch.isnan(stored[1].float()).any():
        err = float("inf")
    return {"op": "mla_decode", "case": case.name, "err": err, "tol": case.tol}


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    runs = ([(run_case, c) for c in (small_cases() if where == "cpu" else gpu_cases())]
            + [(run_prefill_case, c) for c in (small_prefill_cases() if where == "cpu" else gpu_prefill_cases())])
    for run, case in runs:
        try:
            row = run(case, where)  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001 - report every case, the test names the failure
            row = {"op": "mla_prefill" if isinstance(case, PrefillCase) else "mla_decode", "case": case.name,
                   "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)
