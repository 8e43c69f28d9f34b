"""Triton kernels against their torch references.

CPU: the small cases of appliance.kernels.triton.selfcheck run in one subprocess with TRITON_INTERPRET=1 (it must
be set before triton is imported, so not in this process). GPU (@pytest.mark.gpu): realistic shapes in-process.
"""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from appliance.kernels.registry import get
from appliance.kernels.triton import selfcheck as sc
from selfcheck_runner import interpreted_rows

CASES = [(op, case) for op, case, _ in sc.small_cases()]
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def interpreted() -> dict[tuple[str, str], dict]:
    rows = interpreted_rows("appliance.kernels.triton.selfcheck", timeout=240)
    return {(r["op"], r["case"]): r for r in rows}


@pytest.mark.parametrize(("op", "case"), CASES, ids=[f"{o}-{c}" for o, c in CASES])
def test_interpreted_matches_reference(interpreted: dict[tuple[str, str], dict], op: str, case: str) -> None:
    row = interpreted.get((op, case))
    assert row is not None, f"case {op}/{case} produced no result"
    assert "error" not in row, row.get("error")
    assert row["err"] <= row["tol"], f"{op}/{case}: relative error {row['err']:.3g} > {row['tol']:.3g}"


def test_every_op_has_a_triton_and_a_torch_version() -> None:
    for op in ("store_kv", "decode_attention", "prefill_attention", "rms_norm", "rope", "silu_and_mul", "sample"):
        assert callable(get(op, "triton")) and callable(get(op, "torch"))
    assert {op for op, _ in CASES} >= {"store_kv", "decode_attention", "prefill_attention", "rms_norm", "rope",
                                        "silu_and_mul", "sample"}


def test_split_heuristic_fills_the_gpu_but_keeps_splits_long() -> None:
    from appliance.kernels.triton.decode import MIN_SPLIT_TOKENS, num_splits_for

    assert num_splits_for(256, 8, 4096, 132) == 1  # plenty of programs already
    long_single = num_splits_for(1, 8, 4096, 132)
    assert long_single > 1 and 4096 / long_single >= MIN_SPLIT_TOKENS
    assert num_splits_for(1, 8, 64, 132) == 1  # short contexts never split


def test_bad_shapes_raise_clear_errors() -> None:
    inp = sc.decode_inputs(2, 4, 2, 64, 16, [3, 5], torch.float32, "cpu")
    q, k, v, table, lens, scale = inp.args
    with pytest.raises(ValueError, match="decode_attention"):
        get("decode_attention", "triton")(q[:, :3], k, v, table, lens, scale)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match="rms_norm"):
        get("rms_norm", "triton")(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="silu_and_mul"):
        get("silu_and_mul", "triton")(torch.randn(2, 7))
    with pytest.raises(ValueError, match="sample"):
        s = sc.sample_inputs(3, 50, torch.float32, "cpu", "plain").args
        get("sample", "triton")(s[0], s[1][:2], *s[2:])


def test_reference_sampler_follows_the_distribution() -> None:
    """The Gumbel race over the counter hash samples softmax(l / T): frequencies over many steps match."""
    from appliance.kernels.reference.sampling import sample_reference

    n, vocab = 1500, 6
    logits = torch.randn(vocab).repeat(n, 1)
    steps = torch.arange(n)
    ids = sample_reference(logits, torch.full((n,), 0.8), torch.zeros(n, dtype=torch.int32), torch.ones(n),
                           torch.zeros(n), torch.full((n,), 1234), steps)
    freq = torch.bincount(ids, minlength=vocab).float() / n
    want = torch.softmax(logits[0] / 0.8, 0)
    assert (freq - want).abs().max() < 0.05, (freq, want)
    again = sample_reference(logits[:50], torch.full((50,), 0.8), torch.zeros(50, dtype=torch.int32),
                             torch.ones(50), torch.zeros(50), torch.full((50,), 1234), steps[:50])
    assert torch.equal(again, ids[:50])  # same seed and step: same tokens


def test_race_values_stay_finite_and_lose_to_a_far_better_logit() -> None:
    """Every uniform lies strictly inside (0, 1), so no race value is infinite. With 24 bits the top hash value
    rounded to u = 1 (E = 0, an infinite race value): in ~6% of 1M-token draws a token 1000 nats below the best won."""
    from appliance.kernels.reference.sampling import race_value, sample_reference, uniform_reference

    u = uniform_reference(7, 3, 1 << 22)
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert bool(torch.isfinite(race_value(torch.zeros_like(u), u)).all())
    n, vocab = 48, 1 << 20
    logits = torch.full((n, vocab), -1000.0)
    logits[:, 5] = 0.0
    ids = sample_reference(logits, torch.ones(n), torch.zeros(n, dtype=torch.int32), torch.ones(n), torch.zeros(n),
                           torch.arange(n), torch.arange(n))
    assert ids.tolist() == [5] * n


def test_reference_filters_restrict_the_support() -> None:
    from appliance.kernels.reference.sampling import sample_reference

    n, vocab = 200, 40
    logits = torch.randn(n, vocab)
    ones = torch.ones(n)
    k1 = sample_reference(logits, ones, torch.ones(n, dtype=torch.int32), ones, torch.zeros(n),
                          torch.arange(n), torch.zeros(n, dtype=torch.int64))
    assert torch.equal(k1, logits.argmax(1))  # top_k = 1 is greedy
    k3 = sample_reference(logits, ones, torch.full((n,), 3, dtype=torch.int32), ones, torch.zeros(n),
                          torch.arange(n), torch.zeros(n, dtype=torch.int64))
    top3 = logits.topk(3, 1).indices
    assert bool((top3 == k3[:, None]).any(1).all())


# ------------------------------------------------------------------------------------------------ GPU, realistic
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_match_reference() -> None:
    import appliance.kernels.triton  # noqa: F401

    failures = []
    for op, case, build in sc.realistic_cases("cuda"):
        res = sc.compare(op, build(), case)
        if op == "sample":  # GPU log/div are not bit-exact with the CPU: allow a rare near-tie flip
            ok = res.err <= 0.05
        else:
            ok = res.ok
        if not ok:
            failures.append(f"{op}/{case}: {res.err:.3g} > {res.tol:.3g}")
    assert not failures, failures


def test_decode_tile_kernel_compiles_for_hopper() -> None:
    """The one-tile decode kernel compiles for sm_90 under programmatic dependent launch, with its cache reads
    issued before the wait and only q and the newest row after it (the CPU interpreter runs it without PDL)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.kernels.triton import decode

    if not isinstance(decode._decode_tile_kernel, triton.runtime.JITFunction):
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    fn = decode._decode_tile_kernel
    const = {"GROUP": 4, "BLOCK_H": 16, "D": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64, "ORDERED": True,
             "UPCAST": False, "GDC": True}
    types = {"lens_ptr": "*i32", "bt_ptr": "*i32", "order_ptr": "*i64", "mid_o_ptr": "*fp32",
             "mid_lse_ptr": "*fp32", "qk_scale": "fp32"}
    sig = {a: "constexpr" if a in const else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
           for a in fn.arg_names}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": decode.NUM_WARPS, "num_stages": 1}).asm["ptx"]
    before, _, after = ptx.partition("griddepcontrol.wait")
    assert after, "no wait for the kernel before"
    assert before.count("ld.global") >= 3 and after.count("ld.global") >= 3  # cache rows before; q, newest after
