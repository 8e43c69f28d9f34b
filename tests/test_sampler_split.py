"""The Triton sampler's split rows (greedy / plain temperature cut along the vocabulary into chunks) against the
torch reference and the one-program-per-row launch, bit for bit.

CPU: the cases below run in one subprocess under TRITON_INTERPRET=1 (it must be set before triton is imported,
which this process may already have done): this file run as a script prints one JSON line per case. GPU
(@pytest.mark.gpu): real sizes in-process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
Args = tuple[torch.Tensor, ...]


def _settings(b: int, temp: list[float], top_k: list[int] | None = None, top_p: list[float] | None = None,
              min_p: list[float] | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.tensor(temp), torch.tensor(top_k or [0] * b, dtype=torch.int32), torch.tensor(top_p or [1.0] * b),
            torch.tensor(min_p or [0.0] * b), torch.randint(0, 2**40, (b,), generator=gen),
            torch.randint(0, 4096, (b,), generator=gen))


def _logits(b: int, vocab: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return (3 * torch.randn(b, vocab, generator=torch.Generator().manual_seed(seed))).to(dtype)


def mixed(vocab: int = 300, dtype: torch.dtype = torch.float32) -> Args:
    """Greedy, plain-temperature and filtered rows (each filter alone and combined) in one call."""
    temp = [0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 0.9, 1.0, 2.0, 1.0]
    top_k = [0, 0, 0, 0, 5, 20, 0, 0, 40, vocab]  # vocab: top-k off (a split row)
    top_p = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 1.0]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.05, 0.0]
    return (_logits(10, vocab, dtype), *_settings(10, temp, top_k, top_p, min_p))


def ties() -> Args:
    """Equal winners in several chunks and lanes, -inf rows, and rows whose only finite tokens are in the last chunk."""
    vocab = 200
    x = _logits(6, vocab, seed=1)
    for row in (0, 1):  # greedy: 30 beats every 3 * N(0, 1) draw; +inf ties the race of a temperature row
        x[row, [150, 53, 37, 38, 100]] = 30.0 if row == 0 else float("inf")
    x[2] = float("-inf")  # greedy over nothing: index 0
    x[3] = float("-inf")  # a random row over nothing: index 0
    x[4, :180] = float("-inf")  # the early chunks report -inf
    x[5, :180] = float("-inf")
    return (x, *_settings(6, [0.0, 1.0, 0.0, 1.0, 0.0, 0.8]))


def batch_one(vocab: int = 1000, dtype: torch.dtype = torch.bfloat16) -> Args:
    return (_logits(1, vocab, dtype, seed=2), *_settings(1, [1.0], seed=2))


def many_rows(b: int = 140, vocab: int = 100) -> Args:
    """More rows than an H100 has SMs; every other row greedy."""
    return (_logits(b, vocab, torch.float16, seed=3), *_settings(b, [0.0 if i % 2 else 0.8 for i in range(b)], seed=3))


def cases() -> list[tuple[str, Callable[[], Args], int, int | None]]:
    """(name, inputs, chunk_block, chunks); chunks None: the heuristic for 132 SMs."""
    return [*[(f"mixed-f32-c{c}", mixed, 32, c) for c in (1, 2, 3, 5, 10)],
            ("mixed-bf16-c4", lambda: mixed(dtype=torch.bfloat16), 16, 4),
            *[(f"ties-c{c}", ties, 16, c) for c in (1, 4, 13)],
            ("batch1-bf16-c63", batch_one, 16, 63),  # vocab 1000 over 16-token blocks: 63 chunks, the last short
            ("batch140-f16-sms132", many_rows, 16, None)]


def run_case(name: str, build: Callable[[], Args], chunk_block: int, chunks: int | None) -> dict:
    from appliance.kernels.reference.sampling import sample_reference
    from appliance.kernels.triton.sampling import (
        chunks_for,
        sample_per_row,
        sample_split,
    )

    args = build()
    if chunks is None:
        chunks = chunks_for(args[0].shape[0], args[0].shape[1], 132, chunk_block=chunk_block)
    new = sample_split(*args, chunks=chunks, chunk_block=chunk_block)
    first_max = [int((r.float() == r.float().max()).nonzero()[0]) for r in args[0]]
    return {"case": name, "chunks": chunks, "new": new.tolist(), "reference": sample_reference(*args).tolist(),
            "per_row": sample_per_row(*args).tolist(), "first_max": first_max, "greedy": (args[1] <= 0).tolist()}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in rows}


@pytest.mark.parametrize("name", [c[0] for c in cases()])
def test_split_rows_equal_reference_and_per_row(interpreted: dict[str, dict], name: str) -> None:
    row = interpreted[name]
    assert row["new"] == row["reference"], row
    assert row["new"] == row["per_row"], row
    greedy_ids = [n for n, g in zip(row["new"], row["greedy"]) if g]
    assert greedy_ids == [f for f, g in zip(row["first_max"], row["greedy"]) if g]  # argmax, lowest index on ties


def test_ties_and_empty_rows_resolve_to_the_lowest_index(interpreted: dict[str, dict]) -> None:
    for c in (1, 4, 13):
        new = interpreted[f"ties-c{c}"]["new"]
        assert new[:4] == [37, 37, 0, 0]  # 37 is the lowest of the tied indices set in ties()
        assert new[4] >= 180 and new[5] >= 180  # only the last chunk holds finite logits
    assert interpreted["ties-c13"]["chunks"] == 13  # 200 tokens over 16-token blocks
    assert interpreted["batch140-f16-sms132"]["chunks"] > 1  # 140 rows still split on 132 SMs


def test_chunk_heuristic_fills_the_gpu() -> None:
    from appliance.kernels.triton.sampling import CHUNK_BLOCK, MAX_CHUNKS, chunks_for

    for batch, vocab in ((1, 128256), (8, 151936), (256, 151936), (1024, 151936), (4096, 32000)):
        c = chunks_for(batch, vocab, 132, programs_per_sm=4)
        assert 1 <= c <= MAX_CHUNKS and c * CHUNK_BLOCK <= -(-vocab // CHUNK_BLOCK) * CHUNK_BLOCK
        full = batch * c >= 4 * 132
        assert full or c == -(-vocab // CHUNK_BLOCK) or c == MAX_CHUNKS, (batch, vocab, c)
        assert batch * (c - 1) < 4 * 132  # no more chunks than needed
    assert chunks_for(1, 128256, 132) == -(-128256 // CHUNK_BLOCK)  # batch 1: every block its own program
    with pytest.raises(ValueError, match="chunks_for"):
        chunks_for(0, 100, 132)


def test_bad_knobs_raise_clear_errors() -> None:
    from appliance.kernels.triton.sampling import MAX_CHUNKS, sample_split

    args = mixed(64)
    with pytest.raises(ValueError, match="chunks"):
        sample_split(*args, chunks=MAX_CHUNKS + 1)
    with pytest.raises(ValueError, match="chunk_block"):
        sample_split(*args, chunk_block=24)
    with pytest.raises(ValueError, match="top_p"):
        sample_split(args[0], *args[1:3], args[3][:2], *args[4:])


def test_kernels_compile_for_hopper() -> None:
    """Triton compiles the kernels for sm_90 without a GPU: the first GPU run is not a compile-error hunt. Integer
    arguments equal to 1 (chunks) are specialised to constants there, which the interpreter never does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.kernels.triton import sampling as S

    if not isinstance(S._chunk_kernel, triton.runtime.JITFunction):
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    common = {"logits_ptr": "*bf16", "stride": "i32", "vocab": "i32", "temp_ptr": "*fp32", "topk_ptr": "*i32",
              "topp_ptr": "*fp32", "minp_ptr": "*fp32", "seed_ptr": "*i64", "step_ptr": "*i64"}
    chunk_sig = {**common, "chunk_len": "i32", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "BLOCK_V": "constexpr"}
    chunk_sig = {k: chunk_sig[k] for k in S._chunk_kernel.arg_names}
    builds = [(S._chunk_kernel, chunk_sig, {"BLOCK_V": S.CHUNK_BLOCK}, 4)]
    row_sig = {**common, "out_ptr": "*i64", "scratch_ptr": "*fp32", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32",
               "chunks": "i32", "BLOCK_V": "constexpr", "CAP": "constexpr", "BLOCK_CHUNKS": "constexpr"}
    row_sig = {k: row_sig[k] for k in S._sample_kernel.arg_names}
    consts = {"BLOCK_V": S.BLOCK_V, "CAP": S.CAP, "BLOCK_CHUNKS": S.MAX_CHUNKS}
    for ones in ((), ("chunks",)):
        builds.append((S._sample_kernel, {**row_sig, **{k: "constexpr" for k in ones}},
                       {**consts, **{k: 1 for k in ones}}, 8))
    for fn, sig, const, warps in builds:
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps})
        assert kernel.asm["cubin"], fn


# ------------------------------------------------------------------------------------------------ GPU, real sizes
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("batch", "vocab", "mode"), [(256, 151936, "plain"), (256, 151936, "mixed"),
                                                      (1, 128256, "greedy"), (1, 128256, "plain")])
def test_gpu_split_equals_per_row_and_reference(batch: int, vocab: int, mode: str, dtype: torch.dtype) -> None:
    import appliance.kernels.triton  # noqa: F401
    from appliance.kernels.reference.sampling import sample_reference
    from appliance.kernels.registry import get
    from appliance.kernels.triton.sampling import sample_per_row, sample_split

    x = _logits(batch, vocab, dtype, seed=4).cuda()
    temp = [0.0 if mode == "greedy" or (mode == "mixed" and i % 4 == 0) else 1.0 for i in range(batch)]
    top_k = [50 if mode == "mixed" and i % 4 == 1 else 0 for i in range(batch)]
    top_p = [0.9 if mode == "mixed" and i % 4 in (1, 2) else 1.0 for i in range(batch)]
    args = (x, *(t.cuda() for t in _settings(batch, temp, top_k, top_p, seed=4)))
    new = get("sample", "triton")(*args)
    assert torch.equal(new, sample_per_row(*args))  # the same GPU arithmetic: bit for bit
    for chunks in (1, 7, 64):
        assert torch.equal(sample_split(*args, chunks=chunks), new)
    greedy = torch.tensor(temp, device="cuda") <= 0
    assert torch.equal(new[greedy], x.float().argmax(1)[greedy])
    # GPU log differs from the CPU's in the last bit: a near tie may flip against the reference, rarely
    mismatch = (new != sample_reference(*args)).float().mean().item()
    assert mismatch <= 0.02, mismatch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_far_better_logit_always_wins() -> None:
    """No uniform rounds to 1 (whose E = 0 won any race): a token 1000 nats above the rest wins every draw, on
    the split path (temperature only) and the full one (top-k 50)."""
    import appliance.kernels.triton  # noqa: F401
    from appliance.kernels.registry import get

    n, vocab = 64, 1 << 20
    x = torch.full((n, vocab), -1000.0, device="cuda")
    x[:, 5] = 0.0
    for top_k in (0, 50):
        temp, k, p = _settings(n, [1.0] * n, [top_k] * n, [1.0] * n, seed=9)[:3]
        args = (x, temp.cuda(), k.cuda(), p.cuda(), torch.zeros(n, device="cuda"),
                torch.arange(n, device="cuda"), torch.arange(n, device="cuda"))
        assert get("sample", "triton")(*args).tolist() == [5] * n, top_k


def main() -> None:
    """Interpreted run (see the module docstring): one JSON line per case."""
    for name, build, chunk_block, chunks in cases():
        print(json.dumps(run_case(name, build, chunk_block, chunks)), flush=True)


if __name__ == "__main__":
    main()
