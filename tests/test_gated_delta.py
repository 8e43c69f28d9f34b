"""The gated delta rule and the causal convolution over state slots (kernels/reference/gated_delta.py): the
chunked form equals the token-by-token form and transformers' torch implementations; state carried across
calls (chunked prefill, then decode) equals one call over the whole sequence."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance.kernels.reference import gated_delta as gd


def _inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(t, hv, generator=g))  # log decay <= 0
    beta = torch.rand(t, hv, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("length,chunk", [(1, 4), (5, 4), (16, 4), (23, 8), (70, 64)])
def test_chunked_equals_recurrent(length, chunk):
    q, k, v, g, beta = _inputs(length)
    qp, kp = gd._prepare(q, k, v.shape[1])
    init = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(1))
    o_r, s_r = gd.recurrent_sequence(qp, kp, v, g, beta, init)
    o_c, s_c = gd.chunked_sequence(qp, kp, v, g, beta, init, chunk)
    torch.testing.assert_close(o_c, o_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_c, s_r, atol=1e-4, rtol=1e-4)


def test_matches_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta = _inputs(37)
    init = torch.randn(1, 4, 8, 6, generator=torch.Generator().manual_seed(2))
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], chunk_size=16,
                                                   initial_state=init.clone(), output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    rec_o, rec_s = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                       initial_state=init.clone(), output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    states = torch.zeros(3, 4, 8, 6)
    states[2] = init[0]
    out = gd.gated_delta_prefill(q, k, v, g, beta, [0, 37], states, [2], [False], chunk=16)
    torch.testing.assert_close(out, ref_o[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[2], ref_s[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, rec_o[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[2], rec_s[0], atol=1e-4, rtol=1e-4)


def test_chunks_then_decode_carry_state():
    """Prefill in two calls (chunk boundaries inside the delta-rule chunks), then decode tokens one by one, two
    requests interleaved in other slots, equals one fresh call over each whole sequence."""
    length = 29
    seqs = [_inputs(length, seed=s) for s in (3, 4)]
    whole = torch.zeros(3, 4, 8, 6)
    expected = [gd.gated_delta_prefill(*x, [0, length], whole, [i + 1], [True], chunk=8) for i, x in enumerate(seqs)]
    states = torch.full((3, 4, 8, 6), 7.0)  # stale contents: a fresh start must not read them
    got: list[list[torch.Tensor]] = [[], []]
    for a, b in ((0, 11), (11, 20)):  # a batch of both requests' chunks, varlen
        cat = [torch.cat([x[j][a:b] for x in seqs]) for j in range(5)]
        out = gd.gated_delta_prefill(*cat, [0, b - a, 2 * (b - a)], states, [2, 1], [a == 0, a == 0], chunk=8)
        got[0].append(out[: b - a])
        got[1].append(out[b - a:])
    for p in range(20, length):  # decode rows
        rows = [torch.stack([x[j][p] for x in seqs]) for j in range(5)]
        out = gd.gated_delta_decode(*rows, states, torch.tensor([2, 1]), torch.tensor([False, False]))
        got[0].append(out[:1])
        got[1].append(out[1:])
    for i in range(2):
        torch.testing.assert_close(torch.cat(got[i]), expected[i], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[2], whole[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[1], whole[2], atol=1e-4, rtol=1e-4)


def test_decode_fresh_row_ignores_its_slot():
    q, k, v, g, beta = _inputs(1, seed=5)
    zero = torch.zeros(2, 4, 8, 6)
    ref = gd.gated_delta_decode(q, k, v, g, beta, zero, torch.tensor([1]), torch.tensor([False]))
    stale = torch.randn(2, 4, 8, 6)
    out = gd.gated_delta_decode(q, k, v, g, beta, stale, torch.tensor([1]), torch.tensor([True]))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(stale[1], zero[1])


def test_causal_conv_carries_state():
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(13, 10, generator=gen), torch.randn(10, 4, generator=gen)
    ref = F.silu(F.conv1d(x.t()[None], w[:, None, :], padding=3, groups=10)[0, :, :13]).t()
    states = torch.randn(2, 10, 3, generator=gen)  # stale: the fresh start must not read it
    first = gd.causal_conv1d(x[:6], w, [0, 6], states, [1], [True])
    second = gd.causal_conv1d(x[6:9], w, [0, 3], states, [1], [False])
    rest = [gd.causal_conv1d_decode(x[i : i + 1], w, states, torch.tensor([1]), torch.tensor([False]))
            for i in range(9, 13)]
    torch.testing.assert_close(torch.cat([first, second, *rest]), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[1], x[10:13].t())


@pytest.mark.gpu
def test_fla_kernels_match_the_reference_on_gpu():
    """flash-linear-attention's kernels (kernels/triton/gated_delta.py) against the torch reference: varlen
    prefill with fresh and carried states, then a decode step, bfloat16 inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from appliance.kernels.triton import gated_delta as fla_gd

    if not fla_gd.HAVE_FLA:
        pytest.skip("fla-core is not installed (pip install appliance[hybrid])")
    dev = torch.device("cuda")
    seqs = [_inputs(n, hk=2, hv=4, dk=64, dv=64, seed=s) for s, n in ((7, 37), (8, 100))]
    cat = [torch.cat([x[j] for x in seqs]).to(dev) for j in range(5)]
    cat[:3] = [t.bfloat16() for t in cat[:3]]
    init = torch.randn(3, 4, 64, 64, device=dev) * 0.1
    ref_states, fla_states = init.clone(), init.clone()
    args = (*cat, [0, 37, 137])
    ref = gd.gated_delta_prefill(*args, ref_states, [2, 1], [True, False])
    got = fla_gd.gated_delta_prefill(*args, fla_states, [2, 1], [True, False])
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fla_states, ref_states, atol=2e-2, rtol=2e-2)
    rows = [t[:2] for t in cat]
    slots, fresh = torch.tensor([1, 2], device=dev), torch.tensor([False, False], device=dev)
    ref = gd.gated_delta_decode(*rows, ref_states, slots, fresh)
    got = fla_gd.gated_delta_decode(*rows, fla_states, slots, fresh)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fla_states, ref_states, atol=2e-2, rtol=2e-2)


def test_fla_prefill_plumbing_uploads_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/triton/gated_delta.py's prefill on the CPU with a stand-in for fla's chunked kernel (the reference,
    per sequence of cu_seqlens): the slots, fresh flags and offsets it uploads give the reference's outputs and
    states, and every layer of a step (the same host lists) gets the same device tensors, so fla's per-tensor
    caches are built once per step; its chunk indices come from the host lists (no read-back), q and k keep
    their key heads."""
    from appliance.kernels.triton import gated_delta as fla_gd

    seen: list[torch.Tensor] = []

    def chunk_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                   chunk_indices):
        assert output_final_state and use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5
        assert q.shape[2] == k.shape[2] == 2 and v.shape[2] == 4  # key heads stay shared: fla groups them itself
        assert g.dtype == torch.float32
        if initial_state is None:  # every sequence fresh
            initial_state = torch.zeros(len(cu) - 1, v.shape[2], q.shape[-1], v.shape[-1])
        assert initial_state.dtype == torch.float32
        # what fla's prepare_chunk_indices makes of these offsets: (sequence, chunk) of each 64-token chunk
        assert chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0]]
        seen.append(cu_seqlens)
        qp, kp = gd._prepare(q[0], k[0], v.shape[-2])
        outs, finals = [], []
        for i in range(len(cu) - 1):
            a, b = cu[i], cu[i + 1]
            o, s = gd.chunked_sequence(qp[a:b], kp[a:b], v[0, a:b].float(), g[0, a:b], beta[0, a:b].float(),
                                       initial_state[i], 8)
            outs.append(o)
            finals.append(s)
        return torch.cat(outs)[None], torch.stack(finals)

    monkeypatch.setattr(fla_gd, "_fla", lambda: (chunk_rule, None))
    seqs = [_inputs(n, seed=s) for s, n in ((5, 13), (6, 70), (7, 9))]
    cat = [torch.cat([x[j] for x in seqs]) for j in range(5)]
    cu, slots, fresh = [0, 13, 83, 92], [3, 1, 2], [False, True, False]
    init = torch.randn(4, 4, 8, 6, generator=torch.Generator().manual_seed(9))
    ref_states, got_states = init.clone(), init.clone()
    ref = gd.gated_delta_prefill(*cat, cu, ref_states, slots, fresh, chunk=8)
    for _ in range(2):  # two layers of one step: the second call reads the first one's uploads
        got = fla_gd.gated_delta_prefill(*cat, cu, got_states, slots, fresh)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_states, ref_states, atol=1e-4, rtol=1e-4)
        got_states, ref_states = init.clone(), init.clone()
        gd.gated_delta_prefill(*cat, cu, ref_states, slots, fresh, chunk=8)
    assert seen[0] is seen[1] and seen[0].tolist() == cu
    fla_gd.gated_delta_prefill(*cat, list(cu), got_states, slots, fresh)  # the next step: its own lists
    assert seen[2] is not seen[1] and seen[2].tolist() == cu
    for flags in ([True] * 3, [False] * 3):  # all fresh (no gather: fla starts from zeros), none fresh
        got_states, ref_states = init.clone(), init.clone()
        ref = gd.gated_delta_prefill(*cat, cu, ref_states, slots, flags, chunk=8)
        got = fla_gd.gated_delta_prefill(*cat, cu, got_states, slots, list(flags))
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_states, ref_states, atol=1e-4, rtol=1e-4)
    args = fla_gd.prefill_args(cu, slots, fresh, torch.device("cpu"))
    assert args.slots.tolist() == slots and args.keep.flatten().tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="3 prefill slots need 4 offsets"):
        fla_gd.prefill_args([0, 13], slots, fresh, torch.device("cpu"))


CONV_SCRIPT = """
import json, torch
import appliance.kernels.triton  # noqa: F401
from appliance.kernels.reference import gated_delta as gd
from appliance.kernels.triton.causal_conv import causal_conv1d
g = torch.Generator().manual_seed(0)
cases = {"f32-fresh-and-short": (torch.float32, torch.float32, [0, 5, 6, 8, 48], [3, 1, 2, 4],
                                 [False, True, False, True], 40),
         "bf16-two-tiles": (torch.bfloat16, torch.bfloat16, [0, 70, 72], [2, 1], [False, False], 200),
         "f32-bf16-states": (torch.float32, torch.bfloat16, [0, 1, 3], [1, 2], [False, False], 16)}
for name, (dt, sdt, cu, slots, fresh, c) in cases.items():
    x = torch.randn(cu[-1], c + 7, generator=g).to(dt)[:, 3:3 + c]  # strided rows, as the layer's slice
    w = torch.randn(c, 1, 4, generator=g).to(dt)[:, 0, :]
    states = torch.randn(6, c, 3, generator=g).to(sdt)
    ref_states, got_states = states.clone(), states.clone()
    ref = gd.causal_conv1d(x, w, cu, ref_states, slots, fresh)
    got = causal_conv1d(x, w, cu, got_states, slots, fresh)
    err = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())
    untouched = [r for r in range(6) if r not in slots]
    print(json.dumps({"case": name, "out": err(got, ref), "states": err(got_states, ref_states),
                      "untouched": bool(torch.equal(got_states[untouched], states[untouched]))}))
"""


def test_triton_causal_conv_matches_the_reference_interpreted() -> None:
    """triton/causal_conv.py under the interpreter against the torch reference: several sequences (fresh ones,
    ones shorter than the kernel, one across token tiles), strided input rows, states in another dtype; only the
    sequences' slots change. (The interpreter casts to bfloat16 by truncation, hence bfloat16's tolerance.)"""
    pytest.importorskip("triton")
    from selfcheck_runner import interpreted_script_rows

    rows = {r["case"]: r for r in interpreted_script_rows(CONV_SCRIPT, timeout=120)}
    assert set(rows) == {"f32-fresh-and-short", "bf16-two-tiles", "f32-bf16-states"}
    assert rows["f32-fresh-and-short"]["out"] < 1e-5 and rows["f32-fresh-and-short"]["states"] == 0.0
    for name in ("bf16-two-tiles", "f32-bf16-states"):
        assert rows[name]["out"] < 2e-2 and rows[name]["states"] < 1e-2, rows[name]
    assert all(r["untouched"] for r in rows.values())


def _compiles_for_hopper(kernel, types: dict, const: dict) -> bool:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    sig = {n: "constexpr" if n in const else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
           for n in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    return bool(compiled.asm["cubin"])


def test_layer_kernels_compile_for_hopper() -> None:
    """The gates, the gated norm and the causal convolution's two kernels compile through Triton's NVIDIA backend
    to sm_90 cubins without a GPU, bfloat16 (the interpreter accepts code the compiler rejects)."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces the compiler")
    from appliance.kernels.triton import causal_conv, delta_gates

    bf = "*bf16"
    cases = [
        (delta_gates._gdn_gating_kernel, {"a_ptr": bf, "b_ptr": bf, "a_log_ptr": bf, "dt_bias_ptr": bf,
                                          "g_ptr": "*fp32", "beta_ptr": bf}, {"ROWS": 16, "BLOCK_H": 32}),
        (delta_gates._gated_rms_norm_kernel, {"x_ptr": bf, "z_ptr": bf, "w_ptr": bf, "out_ptr": bf, "eps": "fp32"},
         {"ROUND_PRODUCT": True, "BLOCK_N": 128}),
        (causal_conv._conv_kernel, {"x_ptr": bf, "w_ptr": bf, "states_ptr": bf, "out_ptr": bf, "cu_ptr": "*i64",
                                    "slots_ptr": "*i64", "keep_ptr": "*fp32"},
         {"WIDTH": 3, "TOKENS": 32, "CHANNELS": 128}),
        (causal_conv._state_kernel, {"x_ptr": bf, "states_ptr": bf, "cu_ptr": "*i64", "slots_ptr": "*i64",
                                     "keep_ptr": "*fp32"}, {"WIDTH": 3, "BLOCK_W": 4, "CHANNELS": 128}),
    ]
    for kernel, types, const in cases:
        assert _compiles_for_hopper(kernel, types, const), kernel.__name__
