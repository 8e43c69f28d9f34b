"""Expert routing against transformers' routers, the torch fused_moe against a dense per-token loop, the Triton
fused MoE (16-bit, fp8 and MXFP4 experts; and the fp8 block GEMM) against the torch reference under
TRITON_INTERPRET=1, GPU shapes on a GPU."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from selfcheck_runner import interpreted_rows
from test_moe_models import (
    one_thread,  # noqa: F401  (autouse: one torch thread in this module)
)

from appliance.kernels import registry
from appliance.layers.moe import FusedMoE, RouterConfig, select_experts


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _hf_router(kind: str, **cfg):
    import transformers

    if kind == "v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter,
        )

        config = transformers.DeepseekV3Config(hidden_size=32, **cfg)
        return DeepseekV3TopkRouter(config)
    if kind == "v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2TopkRouter,
        )

        return DeepseekV2TopkRouter(transformers.DeepseekV2Config(hidden_size=32, **cfg))
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(hidden_size=32, **cfg))


ROUTERS = [
    ("qwen_softmax", "qwen", {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
     RouterConfig(8, 2)),
    ("qwen_renorm", "qwen", {"num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": True},
     RouterConfig(8, 3, renormalize=True)),
    ("v2_greedy", "v2", {"n_routed_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 1.7},
     RouterConfig(8, 2, routed_scaling_factor=1.7)),
    ("v2_group_limited", "v2", {"n_routed_experts": 16, "num_experts_per_tok": 3, "topk_method": "group_limited_greedy",
                                    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.0},
     RouterConfig(16, 3, num_groups=4, topk_groups=2, routed_scaling_factor=2.0)),
    ("v3_noaux", "v3", {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                            "routed_scaling_factor": 2.5, "norm_topk_prob": True},
     RouterConfig(16, 4, scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2,
                  routed_scaling_factor=2.5)),
]


@pytest.mark.parametrize(("name", "kind", "hf_cfg", "ours"), ROUTERS, ids=[r[0] for r in ROUTERS])
def test_select_experts_matches_transformers(name: str, kind: str, hf_cfg: dict, ours: RouterConfig) -> None:
    torch.manual_seed(0)
    router = _hf_router(kind, **hf_cfg)
    with torch.no_grad():
        router.weight.normal_()
        bias = None
        if kind == "v3":
            router.e_score_correction_bias.normal_(0, 0.5)
            bias = router.e_score_correction_bias
        x = torch.randn(50, 32)
        _, ref_w, ref_ids = router(x)
        w, ids = select_experts(F.linear(x, router.weight), ours, bias)
    ref_w, ref_ids = _sorted(ref_w.float(), ref_ids)
    w, ids = _sorted(w, ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def test_group_limited_routing_never_leaves_the_chosen_groups() -> None:
    cfg = RouterConfig(16, 4, scoring="sigmoid", num_groups=4, topk_groups=1)
    logits = torch.randn(200, 16)
    _, ids = select_experts(logits, cfg, torch.zeros(16))
    groups = ids // 4
    assert bool((groups == groups[:, :1]).all())


def test_router_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="top_k"):
        RouterConfig(4, 5)
    with pytest.raises(ValueError, match="groups"):
        RouterConfig(10, 2, num_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="scoring"):
        RouterConfig(4, 2, scoring="relu")


def test_torch_fused_moe_equals_a_dense_loop() -> None:
    torch.manual_seed(1)
    t, h, i, e, k = 9, 16, 12, 5, 2
    x, w13, w2 = torch.randn(t, h), torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    weights, ids = torch.rand(t, k), torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    got = registry.get("fused_moe", "torch")(x, w13, w2, weights, ids)
    for row in range(t):
        want = torch.zeros(h)
        for slot in range(k):
            gate, up = (w13[ids[row, slot]] @ x[row]).chunk(2)
            want += weights[row, slot] * (w2[ids[row, slot]] @ (F.silu(gate) * up))
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)


def test_expert_loader_shards_gate_up_down_into_the_stack() -> None:
    moe = FusedMoE(num_experts=3, hidden_size=8, intermediate_size=6)
    gate, up, down = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    moe.load_expert(moe.w13_weight, gate, 2, 0)
    moe.load_expert(moe.w13_weight, up, 2, 1)
    moe.load_expert(moe.w2_weight, down, 2, None)
    assert torch.equal(moe.w13_weight[2], torch.cat((gate, up)))
    assert torch.equal(moe.w2_weight[2], down)
    with pytest.raises(ValueError, match="does not fit"):
        moe.load_expert(moe.w2_weight, torch.randn(8, 5), 0, None)
    with pytest.raises(ValueError, match="expert 3"):
        moe.load_expert(moe.w2_weight, down, 3, None)


@pytest.fixture(scope="module")
def interpreted() -> dict[tuple[str, str], dict]:
    pytest.importorskip("triton")
    rows = interpreted_rows("appliance.kernels.moe.selfcheck", timeout=120)
    return {(r["op"], r["case"]): r for r in rows}


def _cases() -> list[tuple[str, str]]:
    from appliance.kernels.moe import selfcheck as sc

    return [("fused_moe_mxfp4" if c.mxfp4 else "fused_moe", c.name) for c in sc.small_cases()] + [
        ("fp8_block_matmul", c.name) for c in sc.small_gemm_cases()]


@pytest.mark.parametrize(("op", "case"), _cases(), ids=[f"{o}-{c}" for o, c in _cases()])
def test_triton_interpreted_matches_reference(interpreted: dict, op: str, case: str) -> None:
    row = interpreted.get((op, case))
    assert row is not None, f"{op}/{case} produced no result"
    assert "error" not in row, row.get("error")
    assert row["err"] <= row["tol"], f"{op}/{case}: relative error {row['err']:.3g} > {row['tol']:.3g}"


def test_align_blocks_groups_pairs_by_expert() -> None:
    pytest.importorskip("triton")
    from appliance.kernels.moe.triton_moe import align_blocks

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, experts = align_blocks(ids, num_experts=4, block_m=4)
    flat = ids.reshape(-1)
    for tile, e in enumerate(experts.tolist()):
        pairs = [p for p in sorted_ids[tile * 4 : tile * 4 + 4].tolist() if p < flat.numel()]
        if e < 0:
            assert pairs == []
        else:
            assert all(int(flat[p]) == e for p in pairs)
    real = sorted(p for p in sorted_ids.tolist() if p < flat.numel())
    assert real == list(range(flat.numel()))  # every (token, slot) pair exactly once


def test_decode_batches_take_the_decode_tiles() -> None:
    pytest.importorskip("triton")
    from appliance.kernels.moe.triton_moe import DECODE, PREFILL, tiles_for

    assert DECODE != PREFILL  # else the selfcheck's cases could not cover both
    assert tiles_for(pairs=8, num_experts=256) == DECODE  # DeepSeek-V3, one token
    assert tiles_for(pairs=256 * 8, num_experts=128) == DECODE  # 16 rows per expert on average
    assert tiles_for(pairs=256 * 8 + 1, num_experts=128) == PREFILL
    assert tiles_for(pairs=2048 * 6, num_experts=64) == PREFILL  # a prefill chunk


@pytest.mark.parametrize("fp8", [False, True])
def test_kernels_compile_for_hopper(fp8: bool) -> None:
    """fused_moe's two kernels, 16-bit and fp8 block-scaled weights, decode and prefill tiles, compile through
    Triton's NVIDIA backend to an sm_90 cubin without a GPU (the interpreter accepts code the compiler rejects)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces the compiler")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from appliance.kernels.moe import triton_moe as tm

    types = {"w_ptr": "*fp8e4nv" if fp8 else "*bf16", "s_ptr": "*fp32", "ids_ptr": "*i32", "experts_ptr": "*i32",
             "weights_ptr": "*fp32", "limit": "fp32", "alpha": "fp32"}
    for tiles in (tm.DECODE, tm.PREFILL):
        consts = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "BN_Q": 128,
                  "BK_Q": 128, "FP8": fp8, "UPCAST": False}
        for kernel, extra in ((tm._gate_up_kernel, {"TOP_K": 8, "BIAS": True, "CLAMPED": True}),
                              (tm._down_kernel, {"BIAS": False, "bias_ptr": None})):
            const = {**consts, **extra}
            types["out_ptr"] = "*bf16" if kernel is tm._gate_up_kernel else "*fp32"  # the down GEMM sums in fp32
            sig = {n: "constexpr" if n in const else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
                   for n in kernel.arg_names}
            compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                                      options={"num_stages": tiles.num_stages, "num_warps": 4})
            assert compiled.asm["cubin"], (kernel.__name__, tiles)


def _gpu_cases() -> list:
    from appliance.kernels.moe import selfcheck as sc

    return [*sc.gpu_cases(), *sc.gpu_gemm_cases()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: c.name)
def test_triton_gpu_shapes(case) -> None:
    from appliance.kernels.moe import selfcheck as sc

    row = sc.run_case(case, "cuda") if isinstance(case, sc.Case) else sc.run_gemm_case(case, "cuda")
    assert row["err"] <= row["tol"], row
