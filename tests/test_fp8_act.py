"""FP8 linears' inputs quantized by the kernels that produce them (ops rms_norm_quant and silu_and_mul_quant,
a QuantizedAct handed to kernels/fp8_gemm.scaled_linear; layers/fp8_scaled.py quantize_producers picks the
producers): the kernels against the two launches they replace and the torch reference under the interpreter
(selfcheck_fp8_act) and compiled for sm_90; scaled_linear on a QuantizedAct; which producers a model switches;
and models giving the same tokens with and without them (torch backend, and the Triton backend interpreted).

Run: python -m pytest -q -p no:cacheprovider tests/test_fp8_act.py
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from selfcheck_runner import interpreted_cases, interpreted_script_rows
from test_fp8_checkpoints import write_fp8_checkpoint

from appliance import LLM, SamplingParams
from appliance.kernels.fp8_act import quantized
from appliance.kernels.fp8_gemm import FP8, FP8_MAX, QuantizedAct, scaled_linear
from appliance.kernels.triton.selfcheck_fp8_act import gpu_cases, run_case, small_cases
from appliance.layers import fp8_scaled

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42] * 5, list(range(100, 130))]
COMMON = {"block_size": 4, "skip_tokenizer_init": True, "dtype": "bfloat16", "seed": 0}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_cases("appliance.kernels.triton.selfcheck_fp8_act", timeout=300)


@pytest.mark.parametrize("case", [c.name for c in small_cases()])
def test_fused_quantization_matches_interpreted(interpreted: dict[str, dict], case: str) -> None:
    row = interpreted.get(case)
    assert row is not None, f"{case} printed no result"
    assert "error" not in row, row.get("error")
    assert row["exact"] <= row["exact_tol"] and row["err"] <= row["tol"], row


def test_fused_kernels_compile_for_hopper() -> None:
    """The quantizing variants build for sm_90 with programmatic dependent launch, and convert to e4m3 on the
    device (no float32 store of the row)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.kernels.triton import activation, norm

    if not isinstance(norm._rms_norm_kernel, triton.runtime.JITFunction):
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    types = {"q_ptr": "*fp8e4nv", "out_ptr": "*fp8e4nv", "s_ptr": "*fp32", "scale_ptr": "*fp32", "eps": "fp32"}
    fp8 = {"MIN_AMAX": 448e-12, "FP8_MAX": 448.0, "GDC": True}
    builds = [(norm._rms_norm_kernel, {"HAS_RESIDUAL": res, "QUANT": True, "BLOCK_N": 4096, **fp8})
              for res in (False, True)]
    builds += [(activation._act_and_mul_quant_kernel, {"ACT": 0, "ONE_PASS": one, "BLOCK_N": block, **fp8})
               for one, block in ((True, 16384), (False, 4096))]
    for fn, const in builds:
        sig = {a: "constexpr" if a in const else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
               for a in fn.arg_names}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 16, "num_stages": 1})
        assert kernel.asm["cubin"] and "e4m3" in kernel.asm["ptx"], fn


def test_scaled_linear_uses_a_quantized_act_as_it_is() -> None:
    """On the reference path (as on cuBLASLt's) a QuantizedAct gives the product of quantizing x there, bit for
    bit, in x's shape and dtype; a layer with a static input scale refuses one."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=gen)
    x[..., 7] *= 40  # an outlier channel
    x = x.to(torch.bfloat16)
    w = torch.randn(48, 96, generator=gen) * 0.05
    ws = w.abs().amax(dim=1) / FP8_MAX
    wq, bias = (w / ws[:, None]).to(FP8), torch.randn(48, generator=gen).to(torch.bfloat16)
    pre = quantized(x)
    assert pre.xq.shape == x.shape and pre.scale.shape == (15, 1) and pre.dtype is torch.bfloat16
    got = scaled_linear(pre, wq, ws, None, bias)
    assert got.shape == (3, 5, 48) and got.dtype is torch.bfloat16
    assert torch.equal(got, scaled_linear(x, wq, ws, None, bias))
    with pytest.raises(ValueError, match="static input scale"):
        scaled_linear(pre, wq, ws, torch.tensor([0.1]))


def _quantizing(model: torch.nn.Module) -> dict[str, bool]:
    """Which norms and activations of the first layer, and the final norm, hand out a QuantizedAct."""
    inner = model.model
    layer = inner.layers[0]
    x = torch.randn(2, inner.norm.weight.shape[0], dtype=torch.bfloat16)
    gate_up = torch.randn(2, layer.mlp.gate_up_proj.weight.shape[0], dtype=torch.bfloat16)
    return {"input_layernorm": isinstance(layer.input_layernorm(x), QuantizedAct),
            "post_attention_layernorm": isinstance(layer.post_attention_layernorm(x, x)[0], QuantizedAct),
            "act": isinstance(layer.mlp.act(gate_up), QuantizedAct),
            "final_norm": isinstance(inner.norm(x), QuantizedAct)}


def test_producers_quantize_for_dynamic_fp8_linears_only(tiny_model: Path, tmp_path: Path) -> None:
    """Dynamic per-token FP8 (w8a8_fp8 online, a compressed-tensors checkpoint): both norms of a layer and its
    SiLU-and-mul quantize, the final norm (read by the 16-bit LM head) does not; a static checkpoint keeps
    today's path, as does a 16-bit model."""
    want = {"input_layernorm": True, "post_attention_layernorm": True, "act": True, "final_norm": False}
    online = LLM(model=str(tiny_model), quantization="w8a8_fp8", **COMMON)
    assert _quantizing(online.executor.runner.model) == want
    dynamic = write_fp8_checkpoint(tiny_model, tmp_path / "dynamic", "compressed-tensors", per_channel=True)
    assert _quantizing(LLM(model=str(dynamic), **COMMON).executor.runner.model) == want
    static = write_fp8_checkpoint(tiny_model, tmp_path / "static", "compressed-tensors", static=True)
    assert not any(_quantizing(LLM(model=str(static), **COMMON).executor.runner.model).values())
    assert not any(_quantizing(LLM(model=str(tiny_model), **COMMON).executor.runner.model).values())


@pytest.fixture
def unfused(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], None]]:
    """unfused(True): models built from now on keep every producer 16-bit (the path before quantize_producers)."""
    original = fp8_scaled.quantize_producers

    def switch(off: bool) -> None:
        monkeypatch.setattr(fp8_scaled, "quantize_producers", (lambda model: 0) if off else original)
    yield switch


def _greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                           o.outputs[0].token_ids)])
            for o in outs]


def test_fused_producers_give_the_same_tokens(tiny_model: Path, unfused: Callable[[bool], None]) -> None:
    """The torch backend's quantizing producers are the 16-bit op, then the quantization scaled_linear ran: the
    same greedy tokens and the same logprobs, bit for bit."""
    runs = {}
    for off in (True, False):
        unfused(off)
        llm = LLM(model=str(tiny_model), quantization="w8a8_fp8", **COMMON)
        assert _quantizing(llm.executor.runner.model)["act"] is not off
        runs[off] = _greedy(llm)
    assert runs[True] == runs[False]


def test_moe_layers_quantize_the_attention_input_only(tmp_path: Path, unfused: Callable[[bool], None]) -> None:
    """A Qwen3-MoE layer in w8a8_fp8: its input norm feeds the FP8 qkv alone and quantizes; the post-attention
    norm's output goes to the router too and stays 16-bit. The same tokens and logprobs as without."""
    from test_moe_models import build_family

    src = build_family("qwen3_moe", tmp_path / "qwen3_moe")
    runs = {}
    for off in (True, False):
        unfused(off)
        llm = LLM(model=str(src), quantization="w8a8_fp8", **COMMON)
        layer = llm.executor.runner.model.model.layers[0]
        x = torch.randn(2, layer.input_layernorm.weight.shape[0], dtype=torch.bfloat16)
        assert isinstance(layer.input_layernorm(x), QuantizedAct) is not off
        assert isinstance(layer.post_attention_layernorm(x, x)[0], torch.Tensor)
        runs[off] = _greedy(llm)
    assert runs[True] == runs[False]


_TRITON_SCRIPT = """
import json
from appliance import LLM
from appliance.layers import fp8_scaled
from test_fp8_act import COMMON, _greedy, _quantizing
original = fp8_scaled.quantize_producers
runs = {{}}
for off in (True, False):
    fp8_scaled.quantize_producers = (lambda model: 0) if off else original
    llm = LLM(model={path!r}, quantization="w8a8_fp8", attention_backend="triton", device="cpu", **COMMON)
    runner = llm.executor.runner
    runs[off] = (_greedy(llm), _quantizing(runner.model)["act"] and runner.backend == "triton")
    llm.shutdown()
print(json.dumps({{"unfused": runs[True], "fused": runs[False]}}))
"""


def test_fused_producers_give_the_same_tokens_on_triton_interpreted(tiny_model: Path) -> None:
    """The Triton backend under the interpreter (norms, SiLU-and-mul and attention in Triton; the FP8 product on
    the CPU's reference): the fused kernels write the bits rms_norm / silu_and_mul and act_quant.py wrote, so
    the greedy tokens and logprobs are the same."""
    (row,) = interpreted_script_rows(_TRITON_SCRIPT.format(path=str(tiny_model)), timeout=600)
    (unfused_runs, unfused_on), (fused_runs, fused_on) = row["unfused"], row["fused"]
    assert fused_on and not unfused_on
    assert fused_runs == unfused_runs


# ---- on a GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", gpu_cases(), ids=lambda c: c.name)
def test_gpu_fused_quantization_matches(case: Any) -> None:
    import appliance.kernels.triton  # noqa: F401  (registers the ops)

    row = run_case(case, "cuda")
    assert row["exact"] <= row["exact_tol"] and row["err"] <= row["tol"], row  # type: ignore[operator]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_scaled_linear_on_a_quantized_act() -> None:
    """A QuantizedAct holding act_quant.py's own output gives scaled_linear's result bit for bit: through the
    FP8 GEMV at up to 16 rows, through cuBLASLt above."""
    from appliance.kernels.triton.act_quant import quant_act

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 4096, generator=gen) * 0.02
    ws = w.abs().amax(dim=1) / FP8_MAX
    wq, ws = (w / ws[:, None]).to(FP8).cuda(), ws.cuda()
    for m in (1, 16, 17, 256):
        x = torch.randn(m, 4096, generator=gen).to("cuda", torch.bfloat16)
        pre = QuantizedAct(*quant_act(x, None), torch.bfloat16)
        assert torch.equal(scaled_linear(pre, wq, ws, None), scaled_linear(x, wq, ws, None)), m


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_producers_through_decode_graphs(make_tiny_model: Callable[..., Path],
                                                   unfused: Callable[[bool], None]) -> None:
    """w8a8_fp8, bf16, the Triton backend with decode CUDA graphs (the FP8 GEMV at these batch sizes): the
    fused producers capture, and give the unfused model's greedy tokens."""
    path = make_tiny_model("llama3", hidden_size=256, intermediate_size=512, head_dim=128)
    kw = {**COMMON, "device": "cuda", "gpu_memory_utilization": 0.3, "attention_backend": "triton",
          "block_size": 16}
    runs = {}
    for off in (True, False):
        unfused(off)
        llm = LLM(model=str(path), quantization="w8a8_fp8", **kw)
        assert llm.executor.runner.graphs is not None
        runs[off] = [t for t, _ in _greedy(llm)]
        del llm
    assert runs[True] == runs[False]
