"""Prefill attention with a draft tree's mask (speculative decoding): the Triton kernel against the torch reference
on random inputs, and the reference against a dense masked softmax written out here.

Cases: a verification (the tree is the chunk: W = q), a drafter's tree step (the tree's earlier nodes lie before
the queries: W > q), a tree after a prefix long enough for unmasked key tiles, a 64-node tree (bit 63), and
sequences without a tree beside ones with. CPU: the kernel runs under TRITON_INTERPRET=1 in a subprocess (this
file run as a script prints one JSON row per case); GPU (@pytest.mark.gpu): in-process on larger shapes.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

# name -> (query lens, tree widths (0: no tree), prefix lens before the tree (or the chunk), heads, kv heads,
#          head dim, block size, dtype)
CASES: dict[str, tuple[Any, ...]] = {
    "verify-f32": ([8, 5], [8, 5], [3, 20], 4, 2, 64, 4, torch.float32),
    "drafter-step-bf16": ([4, 4], [12, 8], [9, 70], 4, 2, 64, 16, torch.bfloat16),
    "long-prefix-f16": ([16, 1, 6], [16, 0, 0], [130, 40, 7], 2, 1, 64, 16, torch.float16),
    "bit63-f32": ([64], [64], [70], 2, 2, 64, 16, torch.float32),
    "mixed-no-tree-f32": ([3, 7, 2], [0, 7, 6], [5, 66, 10], 2, 1, 32, 8, torch.float32),
}
TOL = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def random_tree_bits(q_len: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """[q_len] int64 masks of the chunk's last q_len rows of a random tree of `width` nodes (parents drawn at
    random among earlier nodes): each row sees its ancestors and itself."""
    bits = [0] * width
    for i in range(width):
        parent = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        bits[i] = (bits[parent] if parent >= 0 else 0) | (1 << i)
    rows = [b - (1 << 64) if b >= 1 << 63 else b for b in bits[width - q_len :]]
    return torch.tensor(rows, dtype=torch.int64)


def inputs(spec: tuple[Any, ...], device: str, seed: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from appliance.kernels.triton.selfcheck_attention import _paged_kv

    q_lens, widths, prefixes, h, hkv, d, bs, dtype = spec
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + max(w, n) for p, w, n in zip(prefixes, widths, q_lens)]
    k, v, table = _paged_kv(seq_lens, bs, hkv, d, dtype, device, gen)
    q = torch.randn(sum(q_lens), h, d, generator=gen).to(dtype).to(device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    bits = torch.cat([random_tree_bits(n, w, gen) if w else torch.randint(0, 1 << 20, (n,), generator=gen)
                      for n, w in zip(q_lens, widths)])
    tree = {"tree_mask": bits.to(device), "tree_width": torch.tensor(widths, dtype=torch.int32, device=device)}
    return (q, k, v, cu, lens, table, d**-0.5), tree


def dense_reference(args: tuple[Any, ...], tree: dict[str, Any]) -> torch.Tensor:
    """The same attention as one dense masked softmax per sequence (float32), written without the reference's
    functions: key i of a sequence of length L is seen by its query at position p when i <= p and, for i among the
    last W keys, bit i - (L - W) of the row's mask is set."""
    q, k_cache, v_cache, cu, lens, table, scale = args
    out = torch.empty(q.shape, dtype=torch.float32)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for b, length in enumerate(lens.tolist()):
        s, e = int(cu[b]), int(cu[b + 1])
        idx = torch.tensor([int(table[b, i // bs]) * bs + i % bs for i in range(length)])
        k = k_cache.flatten(0, 1)[idx].float().repeat_interleave(group, 1)
        v = v_cache.flatten(0, 1)[idx].float().repeat_interleave(group, 1)
        w = int(tree["tree_width"][b])
        for j in range(e - s):
            p = length - (e - s) + j
            bits = int(tree["tree_mask"][s + j]) & ((1 << 64) - 1)
            seen = [i for i in range(p + 1) if i < length - w or (bits >> (i - (length - w))) & 1]
            scores = torch.einsum("hd,khd->hk", q[s + j].float(), k[seen]) * scale
            out[s + j] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v[seen])
    return out


def run_case(spec: tuple[Any, ...], device: str) -> dict[str, Any]:
    from appliance.kernels.registry import get

    args, tree = inputs(spec, device)
    ref = get("prefill_attention", "torch")(*args, **tree).double()
    out = get("prefill_attention", "triton")(*args, **tree).double()
    plain = get("prefill_attention", "torch")(*args).double()  # without the mask: must differ (the mask matters)
    err = float((out - ref).norm() / ref.norm())
    return {"err": err, "masked_vs_plain": float((plain - ref).norm() / ref.norm())}


def main() -> None:
    """Under TRITON_INTERPRET=1: one JSON row per case."""
    from tests.selfcheck_runner import (
        print_case_rows,  # run as `python -m tests.<this module>`
    )

    print_case_rows(CASES, run_case)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_a_dense_masked_softmax(name: str) -> None:
    spec = CASES[name]
    args, tree = inputs((*spec[:7], torch.float32), "cpu")
    from appliance.kernels.registry import get

    ref = get("prefill_attention", "torch")(*args, **tree)
    torch.testing.assert_close(ref, dense_reference(args, tree), atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    pytest.importorskip("triton")
    from selfcheck_runner import interpreted_cases

    return interpreted_cases("tests.test_tree_attention", timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_the_reference(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    row = interpreted.get(name)
    assert row is not None, f"case {name} produced no result"
    assert "error" not in row, row["error"]
    assert row["err"] <= TOL[CASES[name][7]], row
    assert row["masked_vs_plain"] > 1e-2, row  # the tree hides keys the causal mask alone would show


def test_a_malformed_tree_mask_is_refused() -> None:
    pytest.importorskip("triton")
    from appliance.kernels.registry import get

    args, tree = inputs(CASES["verify-f32"], "cpu")
    with pytest.raises(ValueError, match="tree_mask"):
        get("prefill_attention", "triton")(*args, tree_mask=tree["tree_mask"][:-1], tree_width=tree["tree_width"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_tree_variant_compiles_for_hopper(dtype: str) -> None:
    """sm_90 without a GPU: the kernel with TREE on (and with a sliding window besides) compiles, as the launcher
    specialises it for Llama-3.1-8B's shapes, so the first GPU run is not a compile-error hunt."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.kernels.triton import prefill as P

    fn = P._prefill_kernel
    if not isinstance(fn, triton.runtime.JITFunction):
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    ptrs = {p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "k_scale_ptr", "v_scale_ptr")}
    ptrs.update({p: "*i32" for p in ("cu_q_ptr", "lens_ptr", "bt_ptr", "cu_tiles_ptr", "tree_width_ptr")})
    ptrs["tree_mask_ptr"] = "*i64"
    ints = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch", "stride_bt",
            "num_seqs", "window")
    for window in (False, True):
        const = {"GROUP": 4, "D": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16, "BLOCK_M": P.BLOCK_M, "BLOCK_N": P.BLOCK_N,
                 "LOG_SEQS": 3, "UPCAST": False, "KV_FP8": False, "FP8_MAX": 0.0, "WINDOW": window, "SINKS": False,
                 "sinks_ptr": None, "TREE": True}
        sig = {**ptrs, **{i: "i32" for i in ints}, "qk_scale": "fp32", **{c: "constexpr" for c in const}}
        div = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig
               if sig[a].startswith("*") or a.startswith("stride")}
        kernel = triton.compile(ASTSource(fn=fn, signature={a: sig[a] for a in fn.arg_names}, constexprs=const,
                                          attrs=div), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": P.NUM_WARPS, "num_stages": P.NUM_STAGES})
        assert "mma" in kernel.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_the_reference_on_the_gpu() -> None:
    import appliance.kernels.triton  # noqa: F401

    for spec in [([64, 40, 8], [64, 40, 8], [1000, 3000, 17], 32, 8, 128, 16, torch.bfloat16),
                 ([8] * 16, [56] * 16, [2048] * 16, 32, 8, 128, 16, torch.bfloat16)]:
        row = run_case(spec, "cuda")
        assert row["err"] <= TOL[spec[7]] and row["masked_vs_plain"] > 1e-2, row


if __name__ == "__main__":
    main()
