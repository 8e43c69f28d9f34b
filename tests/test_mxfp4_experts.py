"""gpt-oss's experts kept in MXFP4 (precision.moe_weight_format = mxfp4, the fused_moe_mxfp4 op): float32 greedy
tokens through the Triton kernels (interpreted on the CPU: their hand-decoded float32 product) equal the
dequantized path's and transformers'; tensor-parallel shards of blocks and scales, padded to whole scale groups,
add up to the unsplit experts; the memory estimate counts 4.25 bits a weight (gpt-oss-120b fits one 80 GB GPU);
dummy weights use every code at small scales; settings the build cannot honour fail at start-up with the reason;
both kernels compile to sm_90 cubins. The kernels against their reference, bf16 / fp16 (tl.dot_scaled) included:
tests/test_moe_kernels.py (kernels/moe/selfcheck.py's mxfp4 cases). On a GPU: float32 parity with transformers in
decode graphs and eager, and the bf16 dot_scaled path in graphs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_vs_transformers import NEW, PROMPTS
from test_models_windowed import FAMILIES, TINY, build_family, to_mxfp4_checkpoint

from appliance.config import build_config, check_supported
from appliance.kernels import mxfp4

ROOT = Path(__file__).resolve().parents[1]

PARITY_SCRIPT = """
import json, sys
import torch
from appliance import LLM, SamplingParams
torch.set_num_threads(1)
sp = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
prompts = json.loads(sys.argv[2])
out = {}
for fmt in ("dequantized", "mxfp4"):
    llm = LLM(model=sys.argv[1], dtype="float32", block_size=4, skip_tokenizer_init=True, moe_backend="triton",
              moe_weight_format=fmt, chunked_prefill_size=16)
    experts = [layer.mlp.experts for layer in llm.executor.runner.model.model.layers]
    assert all(e.mxfp4 == (fmt == "mxfp4") for e in experts), fmt
    if fmt == "mxfp4":  # the blocks stay packed and the Triton MXFP4 kernel runs them
        assert all(e.w13_blocks.dtype == torch.uint8 and e._op.__module__.endswith("triton_mxfp4") for e in experts)
    out[fmt] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    llm.shutdown()
print(json.dumps(out))
"""


def _gpt_oss_config(**overrides: Any) -> Any:
    import transformers

    _, _, extra = FAMILIES["gpt_oss"]
    return transformers.GptOssConfig(**{**TINY, **extra, **overrides})


@pytest.mark.parametrize("checkpoint", ["mxfp4", "float"])
def test_kernel_path_greedy_equals_dequantized_and_transformers(checkpoint: str, tmp_path: Path,
                                                                tiny_tokenizer_dir: Path, hf_greedy: Any) -> None:
    """The shipped MXFP4 checkpoint keeps its blocks and scales; the float one (values on the MXFP4 grid) is
    rounded to the same blocks at load. Either way the interpreted kernels give the dequantized path's tokens."""
    pytest.importorskip("triton")
    path = build_family("gpt_oss", tmp_path / "float", tiny_tokenizer_dir)
    prompts = PROMPTS[:4]
    refs = [t for t, _ in hf_greedy(path, prompts, NEW)]  # transformers runs the float checkpoint
    if checkpoint == "mxfp4":
        path = to_mxfp4_checkpoint(path, tmp_path / "mxfp4")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", PARITY_SCRIPT, str(path), json.dumps(prompts), str(NEW)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["dequantized"] == refs
    assert got["mxfp4"] == refs


def test_k_steps_are_whole_scale_groups_dividing_k() -> None:
    pytest.importorskip("triton")
    from appliance.kernels.moe.triton_mxfp4 import whole_steps

    assert whole_steps(2880, 128) == 64  # gpt-oss: 90 groups
    assert whole_steps(1440, 128) == 32  # its intermediate at tp 2: 45 groups
    assert whole_steps(4096, 128) == 128
    assert whole_steps(96, 16) == 32  # never under one group


def test_tensor_parallel_shards_dequantize_to_the_dequantized_shards() -> None:
    """Rank r of tp 2 holds gate rows, up rows (interleaved in the checkpoint) and down's input columns of its
    half; in MXFP4 those are whole 32-value groups of blocks and scales, so they dequantize to the same shard."""
    pytest.importorskip("triton")
    from appliance.layers import parallel_state
    from appliance.models.gpt_oss import GptOssExperts

    cfg = _gpt_oss_config(intermediate_size=128)
    gen = torch.Generator().manual_seed(3)
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    packs = {"gate_up_proj": mxfp4.quantize(torch.randn(e, 2 * i, h, generator=gen)),
             "down_proj": mxfp4.quantize(torch.randn(e, h, i, generator=gen))}
    try:
        for rank in range(2):
            parallel_state.init_tensor_parallel(rank, 2, group=object())
            with torch.device("meta"):  # meta: no kernel runs, and the CPU refusal does not apply
                kept = GptOssExperts(cfg, "triton", "mxfp4")
            kept = kept.to_empty(device="cpu")
            plain = GptOssExperts(cfg, "torch")
            for proj, (blocks, scales) in packs.items():
                assert kept.load_mxfp4(proj, blocks, scales) == [f"{'w13' if proj == 'gate_up_proj' else 'w2'}_"
                                                                 f"{k}" for k in ("blocks", "scales")]
                plain.load_mxfp4(proj, blocks, scales)
            for name in ("w13", "w2"):
                got = mxfp4.dequantize(mxfp4.unpacked(getattr(kept, f"{name}_blocks")), getattr(kept, f"{name}_scales"))
                assert torch.equal(got, getattr(plain, f"{name}_weight"))
            assert plain.w2_weight.shape == (e, h, i // 2)
    finally:
        parallel_state.init_tensor_parallel(0, 1)


@pytest.mark.parametrize(("tp", "intermediate"), [(2, 96), (4, 128), (3, 64)])
def test_padded_shards_sum_to_the_whole_experts(tp: int, intermediate: int) -> None:
    """Where intermediate / tp is not whole 32-value groups (96 at tp 2: 48 a rank; 128 at tp 4: 32, whole; 64 at
    tp 3: a rank of padding only), each rank holds whole groups padded with zero units, and the ranks' partial
    MoE outputs (the torch oracle on each shard) sum to the unsplit experts' output."""
    pytest.importorskip("triton")
    from appliance.kernels import registry
    from appliance.layers import parallel_state
    from appliance.models.gpt_oss import GptOssExperts

    cfg = _gpt_oss_config(intermediate_size=intermediate)
    gen = torch.Generator().manual_seed(tp)
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    packs = {"gate_up_proj": mxfp4.quantize(torch.randn(e, 2 * i, h, generator=gen)),
             "down_proj": mxfp4.quantize(torch.randn(e, h, i, generator=gen))}
    biases = {"gate_up_proj": torch.randn(e, 2 * i, generator=gen), "down_proj": torch.randn(e, h, generator=gen)}
    x = torch.randn(7, h, generator=gen)
    weights, ids = torch.randn(7, e, generator=gen).softmax(-1).topk(cfg.num_experts_per_tok, dim=-1)
    op = registry.get("fused_moe_mxfp4", "torch")

    def partial(rank: int, size: int) -> torch.Tensor:
        parallel_state.init_tensor_parallel(rank, size, group=object() if size > 1 else None)
        with torch.device("meta"):  # meta: the CPU refusal does not apply (no kernel runs here)
            experts = GptOssExperts(cfg, "triton", "mxfp4")
        experts = experts.to_empty(device="cpu")
        for proj, (blocks, scales) in packs.items():
            experts.load_mxfp4(proj, blocks, scales)
            experts.load(proj, "_bias", biases[proj])
        assert experts.intermediate % 32 == 0 and experts.intermediate * size >= i
        return op(x, experts.w13_blocks, experts.w13_scales, experts.w2_blocks, experts.w2_scales, weights, ids,
                  w13_bias=experts.w13_bias, w2_bias=experts.w2_bias if rank == 0 else None, swiglu_limit=0.5)

    try:
        whole = partial(0, 1)
        split = sum(partial(rank, tp) for rank in range(tp))
    finally:
        parallel_state.init_tensor_parallel(0, 1)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    assert whole.abs().mean() > 0.1


def test_memory_estimate_counts_the_packed_experts() -> None:
    from appliance.executor.memory_check import build_on_meta, module_bytes
    from appliance.models.gpt_oss import GptOssForCausalLM

    pytest.importorskip("triton")
    cfg = _gpt_oss_config()
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    models = {fmt: build_on_meta(GptOssForCausalLM, cfg, torch.bfloat16,
                                 {"backend": "torch", "moe_backend": "triton", "moe_weight_format": fmt})
              for fmt in ("dequantized", "mxfp4")}
    weights = 3 * h * i  # w13 and w2 of one expert
    per_layer = {"dequantized": e * weights * 2, "mxfp4": e * (weights // 2 + weights // 32)}
    layers = cfg.num_hidden_layers
    saved = module_bytes(models["dequantized"]) - module_bytes(models["mxfp4"])
    assert saved == layers * (per_layer["dequantized"] - per_layer["mxfp4"])
    assert per_layer["mxfp4"] * 8 == weights * e * 4.25  # 4.25 bits a weight


def test_dummy_weights_use_every_code_at_small_scales() -> None:
    pytest.importorskip("triton")
    from appliance.executor.model_loader import init_dummy_weights
    from appliance.models.gpt_oss import GptOssExperts

    with torch.device("meta"):
        experts = GptOssExperts(_gpt_oss_config(num_local_experts=16), "triton", "mxfp4")
    experts = experts.to_empty(device="cpu")
    init_dummy_weights(experts, seed=0)
    assert experts.w13_blocks.unique().numel() == 256
    assert set(experts.w2_scales.unique().tolist()) == {115, 116, 117}
    w = mxfp4.dequantize(mxfp4.unpacked(experts.w13_blocks), experts.w13_scales)
    assert 2e-4 < w.abs().mean().item() < 2e-3  # as small as the other dummy weights (uniform within 1e-3)


def test_settings_the_build_cannot_honour_are_refused() -> None:
    from appliance.executor.runner_setup import model_kwargs
    from appliance.models.gpt_oss import GptOssForCausalLM
    from appliance.models.mixtral import MixtralForCausalLM

    pytest.importorskip("triton")
    refused = check_supported(build_config(dotlist=["precision.moe_weight_format=mxfp4", "backends.moe=torch"]))
    assert any("moe_weight_format" in m and "Triton" in m for m in refused)
    mxfp4_cfg = build_config(dotlist=["precision.moe_weight_format=mxfp4"])
    assert not [m for m in check_supported(mxfp4_cfg) if "moe_weight_format" in m]  # backends.moe auto
    with pytest.raises(ValueError, match="ship in MXFP4"):
        model_kwargs(MixtralForCausalLM, mxfp4_cfg, "triton")
    with pytest.raises(ValueError, match="resolved to 'torch'"):  # auto follows the CPU's torch attention
        model_kwargs(GptOssForCausalLM, mxfp4_cfg, "torch")
    assert model_kwargs(GptOssForCausalLM, mxfp4_cfg, "triton") == {"moe_backend": "triton",
                                                                    "moe_weight_format": "mxfp4"}
    assert model_kwargs(GptOssForCausalLM, build_config(), "triton") == {"moe_backend": "triton"}


def test_cpu_without_the_interpreter_is_refused() -> None:
    """This process imported triton without TRITON_INTERPRET: a CPU build of the MXFP4 experts is refused."""
    pytest.importorskip("triton")
    from appliance.kernels.triton.common import INTERPRET
    from appliance.models.gpt_oss import GptOssExperts

    if INTERPRET:
        pytest.skip("runs under the interpreter")
    with pytest.raises(ValueError, match="needs a GPU"):
        GptOssExperts(_gpt_oss_config(), "triton", "mxfp4")



def test_gpt_oss_120b_fits_one_80gb_gpu_in_mxfp4() -> None:
    """The weight estimate the start-up check uses (the model built on the meta device): gpt-oss-120b's bf16
    weights are ~4x one GPU; with its experts in MXFP4 they fit 0.9 of an 80 GB GPU at tp 1."""
    pytest.importorskip("triton")
    import transformers

    from appliance.executor.memory_check import estimate_weights
    from appliance.models.gpt_oss import GptOssForCausalLM

    cfg = transformers.GptOssConfig(  # openai/gpt-oss-120b's config.json
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 18, max_position_embeddings=131072,
        swiglu_limit=7.0, tie_word_embeddings=False)
    gib = {fmt: estimate_weights(GptOssForCausalLM, cfg, torch.bfloat16,
                                 {"backend": "triton", "moe_backend": "triton", "moe_weight_format": fmt}
                                 ).bytes_per_rank / 2**30 for fmt in ("dequantized", "mxfp4")}
    assert gib["dequantized"] > 200
    assert 55 < gib["mxfp4"] < 0.9 * 80 * 1e9 / 2**30



def test_shortfall_message_suggests_keeping_the_experts_in_mxfp4() -> None:
    from appliance.executor import memory_check as mc

    gib = 1 << 30
    budget = mc.MemoryBudget(int(71.2 * gib), "GPU 0 has 79.1 GiB total")
    est = mc.WeightEstimate(int(218.7 * gib), int(218.7 * gib), ("bfloat16",))
    kept = mc.shortfall_message(est.bytes_per_rank, budget, "GptOssForCausalLM", torch.device("cuda"), est, True)
    assert 'moe_weight_format = "mxfp4"' in kept and "precision.quantization" not in kept
    plain = mc.shortfall_message(est.bytes_per_rank, budget, "LlamaForCausalLM", torch.device("cuda"), est)
    assert "moe_weight_format" not in plain and "precision.quantization" in plain

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda_graphs"])
def test_gpu_kernel_path_matches_transformers(eager: bool, tmp_path: Path, tiny_tokenizer_dir: Path,
                                             hf_greedy: Any) -> None:
    """The shipped layout on the GPU: Triton attention and the compiled MXFP4 kernel (float32 activations, so the
    tokens can equal transformers'), decode in CUDA graphs or eager, a second pass over the prefix cache."""
    from test_models_vs_transformers import greedy_params

    from appliance import LLM

    path = build_family("gpt_oss", tmp_path / "float", tiny_tokenizer_dir)
    refs = hf_greedy(path, PROMPTS, NEW)
    path = to_mxfp4_checkpoint(path, tmp_path / "mxfp4")
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.3, block_size=16,
              chunked_prefill_size=16, enforce_eager=eager, moe_weight_format="mxfp4")
    runner = llm.executor.runner
    assert all(layer.mlp.experts.mxfp4 for layer in runner.model.model.layers)
    assert runner.model.moe_backend == "triton" and (runner.graphs is None) == eager
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params())
        assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]
    assert llm.engine.check_accounting().ok
    llm.shutdown()


def test_config_checks_against_the_model(tmp_path: Path) -> None:
    """Against config.json, before anything starts: gpt-oss at any tp, and a warning for a model whose experts do
    not ship in MXFP4."""
    from appliance.config import resolve

    oss, qwen = tmp_path / "oss", tmp_path / "qwen"
    for path, data in ((oss, {"model_type": "gpt_oss", "intermediate_size": 2880, "num_attention_heads": 64,
                              "num_key_value_heads": 8}),
                       (qwen, {"model_type": "qwen3_moe", "intermediate_size": 768})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(data))
    fmt = "precision.moe_weight_format=mxfp4"
    for tp in (2, 4, 8):  # 8: 360 a rank, padded to 384
        assert not [w for w in resolve(dotlist=[f"model.path={oss}", fmt, f"parallelism.tp={tp}"], env={}).warnings
                    if w.path == "precision.moe_weight_format"]
    warnings = resolve(dotlist=[f"model.path={qwen}", fmt], env={}).warnings
    assert any(w.path == "precision.moe_weight_format" and "qwen3_moe" in w.message for w in warnings)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_dot_scaled_path_in_graphs(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """bf16 activations take tl.dot_scaled: decode in CUDA graphs gives the eager run's tokens, and the first
    greedy token's logprob is the dequantized experts' within bf16 rounding (the paths differ only in the order
    of their sums, so the token itself may differ where two logits nearly tie)."""
    from test_models_vs_transformers import greedy_params

    from appliance import LLM

    path = to_mxfp4_checkpoint(build_family("gpt_oss", tmp_path / "float", tiny_tokenizer_dir), tmp_path / "mxfp4")
    runs = {}
    for name, fmt, eager in (("eager", "mxfp4", True), ("graphs", "mxfp4", False), ("dequantized", "dequantized", True)):
        llm = LLM(model=str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, block_size=16,
                  enforce_eager=eager, moe_weight_format=fmt)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params())
        runs[name] = [(o.outputs[0].token_ids, o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob)
                      for o in outs]
        llm.shutdown()
    assert [t for t, _ in runs["graphs"]] == [t for t, _ in runs["eager"]]
    for (_, kept), (_, dequantized) in zip(runs["eager"], runs["dequantized"], strict=True):
        assert abs(kept - dequantized) < 0.05

def _signature(kernel: Any, act: str) -> tuple[dict[str, str], dict[tuple[int, ...], list[list[Any]]]]:
    """Argument types of a fused_moe_mxfp4 kernel for an ahead-of-time compile, with the divisibility by 16 a
    launch on real shapes reports for its pointers and strides."""
    types = {"b_ptr": "*u8", "s_ptr": "*u8", "ids_ptr": "*i32", "experts_ptr": "*i32", "weights_ptr": "*fp32",
             "limit": "fp32", "alpha": "fp32", "x_ptr": act, "a_ptr": act, "bias_ptr": act,
             "out_ptr": act if "gate" in kernel.__name__ else "*fp32"}
    names = kernel.arg_names
    sig = {n: types.get(n, "constexpr" if n.isupper() else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n.startswith("stride_") or n in ("hidden", "inter")}
    return sig, attrs


@pytest.mark.parametrize("act", ["bf16", "fp16", "fp32"])
def test_kernels_compile_for_hopper(act: str) -> None:
    """The GPU path without a GPU: both kernels, at the decode and prefill tiles gpt-oss gets (K steps of 64 and
    32), compile through Triton's NVIDIA backend to an sm_90 cubin (the interpreter accepts code this rejects)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces the compiler")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from appliance.kernels.moe import triton_mxfp4
    from appliance.kernels.moe.triton_moe import DECODE, PREFILL

    for tiles, k in ((DECODE, 2880), (PREFILL, 2880), (DECODE, 1440)):  # 1440: the intermediate at tp 2
        consts = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "ACT_FORMAT": act,
                  "BLOCK_K": triton_mxfp4.whole_steps(k, tiles.block_k)}
        for kernel, extra in ((triton_mxfp4._gate_up_kernel, {"TOP_K": 4, "BIAS": True, "CLAMPED": True}),
                              (triton_mxfp4._down_kernel, {"BIAS": True})):
            sig, attrs = _signature(kernel, f"*{act}")
            compiled = triton.compile(ASTSource(kernel, sig, {**consts, **extra}, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"num_stages": tiles.num_stages, "num_warps": 4})
            assert compiled.asm["cubin"], (kernel.__name__, tiles)
