"""FP8 e4m3 weights with block scales (DeepSeek-V3's `weight_scale_inv` layout): quantization, the block-scaled
matmul, the fp8 layers' loaders, an fp8 checkpoint end to end (equal to transformers on the dequantized weights)
and the dummy-weight layout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_moe_models import (
    PROMPTS,
    build_family,
    one_thread,  # noqa: F401  (autouse: one torch thread in this module)
)

from appliance import LLM, SamplingParams
from appliance.kernels import registry
from appliance.kernels.moe.reference import FP8_DTYPE, FP8_MAX, block_quantize, dequantize_blocks
from appliance.layers.fp8 import (
    Fp8BlockConfig,
    Fp8MergedColumnParallelLinear,
    make_linear,
)
from appliance.layers.moe import FusedMoE

BLOCK = (32, 32)


def test_block_quantize_round_trips_within_e4m3_precision() -> None:
    torch.manual_seed(0)
    w = torch.randn(70, 100) * torch.logspace(-3, 1, 100)  # columns of very different magnitude
    q, s = block_quantize(w, BLOCK)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (3, 4)  # ragged edges get their own tiles
    # every tile's largest value lands on the top of the e4m3 range
    tiles_max = torch.stack([q[i * 32 : (i + 1) * 32, j * 32 : (j + 1) * 32].float().abs().max()
                             for i in range(3) for j in range(4)])
    assert torch.allclose(tiles_max, torch.full_like(tiles_max, FP8_MAX))
    back = dequantize_blocks(q, s, BLOCK)
    assert ((back - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-9).all()  # 3 mantissa bits, subnormals


def test_block_scaled_matmul_equals_dequantized_reference() -> None:
    torch.manual_seed(1)
    w, x = torch.randn(96, 64), torch.randn(5, 64)
    q, s = block_quantize(w, BLOCK)
    got = registry.get("fp8_block_matmul", "torch")(x, q, s, BLOCK)
    torch.testing.assert_close(got, x @ dequantize_blocks(q, s, BLOCK).T)
    assert ((got - x @ w.T).norm() / (x @ w.T).norm()) < 0.05  # and close to the unquantized product


def test_fp8_linears_load_and_multiply() -> None:
    torch.manual_seed(2)
    quant = Fp8BlockConfig(*BLOCK)
    for kind in ("replicated", "column", "row"):
        layer = make_linear(kind, 64, 96, quant=quant)
        w = torch.randn(96, 64)
        q, s = block_quantize(w, BLOCK)
        layer.weight.weight_loader(layer.weight, q)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s)
        x = torch.randn(3, 64)
        torch.testing.assert_close(layer(x), x @ dequantize_blocks(q, s, BLOCK).T, msg=kind)
    merged = make_linear("merged", 64, [32, 64], quant=quant)
    assert isinstance(merged, Fp8MergedColumnParallelLinear)
    parts = [block_quantize(torch.randn(n, 64), BLOCK) for n in (32, 64)]
    for i, (q, s) in enumerate(parts):
        merged.weight_loader(merged.weight, q, i)
        merged.weight_loader(merged.weight_scale_inv, s, i)
    assert torch.equal(merged.weight_scale_inv, torch.cat([s for _, s in parts]))
    x = torch.randn(2, 64)
    want = torch.cat([x @ dequantize_blocks(q, s, BLOCK).T for q, s in parts], dim=-1)
    torch.testing.assert_close(merged(x), want)
    assert not hasattr(make_linear("column", 64, 96, quant=Fp8BlockConfig(*BLOCK, ignored=("o_proj",)),
                                   prefix="layers.0.o_proj"), "weight_scale_inv")


def test_fp8_experts_load_scales_per_tile() -> None:
    quant = Fp8BlockConfig(*BLOCK)
    moe = FusedMoE(num_experts=2, hidden_size=64, intermediate_size=64, quant=quant)
    assert moe.w13_weight.dtype == FP8_DTYPE and moe.w13_weight_scale_inv.shape == (2, 4, 2)
    assert moe.w2_weight_scale_inv.shape == (2, 2, 2)
    (gq, gs), (uq, us), (dq, ds) = (block_quantize(torch.randn(*shape), BLOCK)
                                    for shape in ((64, 64), (64, 64), (64, 64)))
    for param, tensor, shard in ((moe.w13_weight, gq, 0), (moe.w13_weight_scale_inv, gs, 0),
                                 (moe.w13_weight, uq, 1), (moe.w13_weight_scale_inv, us, 1),
                                 (moe.w2_weight, dq, None), (moe.w2_weight_scale_inv, ds, None)):
        moe.load_expert(param, tensor, 1, shard)
    assert torch.equal(moe.w13_weight_scale_inv[1], torch.cat((gs, us)))
    x = torch.randn(3, 64)
    ids, weights = torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1)
    g, u, d = (dequantize_blocks(q, s, BLOCK) for q, s in ((gq, gs), (uq, us), (dq, ds)))
    torch.testing.assert_close(moe(x, weights, ids), (F.silu(x @ g.T) * (x @ u.T)) @ d.T, rtol=1e-4, atol=1e-4)


def test_quantization_config_is_validated() -> None:
    from types import SimpleNamespace

    v3 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert Fp8BlockConfig.from_hf(SimpleNamespace(quantization_config=v3)) == Fp8BlockConfig(128, 128)
    assert Fp8BlockConfig.from_hf(SimpleNamespace()) is None
    with pytest.raises(ValueError, match="awq"):
        Fp8BlockConfig.from_hf(SimpleNamespace(quantization_config={"quant_method": "awq"}))
    with pytest.raises(ValueError, match="weight_block_size"):
        Fp8BlockConfig.from_hf(SimpleNamespace(quantization_config={"quant_method": "fp8"}))
    with pytest.raises(ValueError, match="static"):
        Fp8BlockConfig.from_hf(SimpleNamespace(quantization_config={**v3, "activation_scheme": "static"}))


def _quantizable(name: str) -> bool:
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(fp8 checkpoint dir, float checkpoint dir holding exactly the dequantized weights) of a tiny V3."""
    src = build_family("deepseek_v3", tmp_path_factory.mktemp("v3_src"))
    fp8_dir, deq_dir = tmp_path_factory.mktemp("v3_fp8"), tmp_path_factory.mktemp("v3_deq")
    tensors = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if _quantizable(name):
            q, s = block_quantize(t, BLOCK)
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = q, s
            deq[name] = dequantize_blocks(q, s, BLOCK).contiguous()
        else:
            fp8[name] = deq[name] = t
    config = json.loads((src / "config.json").read_text())
    save_file(deq, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    (deq_dir / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, deq_dir


def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(fp8_checkpoint, hf_greedy) -> None:
    fp8_dir, deq_dir = fp8_checkpoint
    refs = hf_greedy(deq_dir, PROMPTS, 6)
    llm = LLM(model=str(fp8_dir), dtype="float32", block_size=4, skip_tokenizer_init=True)
    model = llm.executor.runner.model
    attn = model.model.layers[1].self_attn
    assert attn.q_b_proj.weight.dtype == FP8_DTYPE and attn.kv_b_proj.weight_scale_inv.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == FP8_DTYPE
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]


def test_dummy_weights_keep_the_fp8_layout(fp8_checkpoint) -> None:
    fp8_dir, _ = fp8_checkpoint
    real = LLM(model=str(fp8_dir), dtype="float32", block_size=4, skip_tokenizer_init=True)
    dummy = LLM(model=str(fp8_dir), dtype="float32", block_size=4, skip_tokenizer_init=True, load_format="dummy")
    layout = {n: (p.dtype, tuple(p.shape)) for n, p in real.executor.runner.model.named_parameters()}
    assert layout == {n: (p.dtype, tuple(p.shape)) for n, p in dummy.executor.runner.model.named_parameters()}
    assert sum(p.dtype == FP8_DTYPE for p in dummy.executor.runner.model.parameters()) > 10
    for name, p in dummy.executor.runner.model.named_parameters():
        if p.dtype == FP8_DTYPE:  # benchmarks must not run on (mostly) zeros: they are faster than real data
            assert (p.float() == 0).float().mean() < 0.01, name
        if name.endswith("weight_scale_inv"):
            assert bool((p > 0).all()), name
    out = dummy.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=3,
                                                                             ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_fp8_checkpoint_of_a_family_without_fp8_support_is_refused(tmp_path: Path) -> None:
    path = build_family("qwen3_moe", tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="fp8 checkpoints are not supported for this family"):
        LLM(model=str(path), dtype="float32", skip_tokenizer_init=True)
