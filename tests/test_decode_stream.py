"""appliance/kernels/triton/decode_stream.py (decode attention with the batch's KV tiles dealt out evenly) against
the torch reference.

CPU: the cases run in one subprocess under TRITON_INTERPRET=1 (`python -m tests.test_decode_stream cpu`). The
program counts are chosen so that pairs are cut between programs in every way the merge must handle: a pair over
many programs, programs with no tiles inside a cut pair, a program holding one pair whole, empty rows. GPU: the
shapes the Qwen3 and Llama runs meet, against the registered kernel.
"""
from __future__ import annotations

import json
import random
import sys
from typing import Any

import pytest
import torch

# name -> (seq_lens, q heads, kv heads, head_dim, page, programs, dtype)
CASES: dict[str, tuple[list[int], int, int, int, int, int, torch.dtype]] = {
    "ragged-gqa2-p3": ([5, 60, 33, 17], 4, 2, 32, 16, 3, torch.float32),
    "empty-rows-gqa4-p5": ([200, 0, 70, 1], 8, 2, 16, 8, 5, torch.float32),
    "one-pair-over-empty-programs": ([300], 4, 1, 32, 16, 7, torch.float32),
    "all-empty": ([0, 0], 2, 1, 16, 16, 4, torch.float32),
    "one-program": ([64, 64, 64], 4, 4, 16, 16, 1, torch.float32),
    "page4-gqa2-p11": ([130, 1, 77, 64, 65], 6, 3, 16, 4, 11, torch.float32),
    "more-programs-than-tiles": ([3, 9], 2, 2, 16, 16, 40, torch.float32),
    "bf16-gqa8-p6": ([150, 40, 0, 255, 64], 16, 2, 64, 16, 6, torch.bfloat16),
    "random-f16-p9": ([random.Random(4).randint(0, 200) for _ in range(9)], 8, 4, 32, 16, 9, torch.float16),
}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def inputs(lens: list[int], h: int, hkv: int, d: int, page: int, dtype: torch.dtype, device: str) -> tuple[Any, ...]:
    """(q, k_cache, v_cache, block_tables, seq_lens, scale): the selfcheck's paged decode inputs."""
    from appliance.kernels.triton.selfcheck import decode_inputs

    return decode_inputs(len(lens), h, hkv, d, page, lens, dtype, device).args


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def main() -> None:
    from appliance.kernels.reference.attention import decode_attention as reference
    from appliance.kernels.triton.decode_stream import stream_decode_attention

    for name, (lens, h, hkv, d, page, programs, dtype) in CASES.items():
        args = inputs(lens, h, hkv, d, page, dtype, "cpu")
        out = stream_decode_attention(*args, programs=programs)
        ref = reference(*args)
        print(json.dumps({"case": name, "err": max_rel_err(out, ref), "finite": bool(torch.isfinite(out).all()),
                          "empty_rows_zero": all(bool((out[i] == 0).all()) for i, n in enumerate(lens) if n == 0)}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    pytest.importorskip("triton")
    from selfcheck_runner import interpreted_rows

    return {r["case"]: r for r in interpreted_rows("tests.test_decode_stream", timeout=240)}


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    row = interpreted.get(name)
    assert row is not None, f"case {name} produced no result"
    assert row["finite"] and row["empty_rows_zero"], row
    assert row["err"] <= TOL[CASES[name][6]], row


def test_bad_shapes_raise_clear_errors() -> None:
    pytest.importorskip("triton")
    from appliance.kernels.triton.decode_stream import stream_decode_attention

    q, k, v, table, lens, scale = inputs([5, 6], 4, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not fit caches"):
        stream_decode_attention(q[:, :3], k, v, table, lens, scale)
    with pytest.raises(ValueError, match="batch size differs"):
        stream_decode_attention(q, k, v, table[:1], lens, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("b", "h", "hkv"), [(64, 16, 8), (200, 32, 8), (1, 32, 8), (13, 16, 8)])
def test_gpu_matches_the_registered_kernel(b: int, h: int, hkv: int) -> None:
    import appliance.kernels.triton  # noqa: F401
    from appliance.kernels.triton.decode import decode_attention
    from appliance.kernels.triton.decode_stream import stream_decode_attention

    lens = [random.Random(b).randint(1, 2048) for _ in range(b)]
    args = inputs(lens, h, hkv, 128, 16, torch.bfloat16, "cuda")
    assert max_rel_err(stream_decode_attention(*args), decode_attention(*args)) <= TOL[torch.bfloat16]


if __name__ == "__main__" and sys.argv[1:] == ["cpu"]:
    main()
