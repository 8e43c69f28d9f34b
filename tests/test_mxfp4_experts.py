"""gpt-oss's experts kept in MXFP4 (precision.moe_weight_format = mxfp4, the fused_moe_mxfp4 op): greedy tokens
through the Triton kernel path (interpreted on the CPU) equal the dequantized path's and transformers'; the
loader's tensor-parallel shards of blocks and scales dequantize to the dequantized path's shards; the memory
estimate counts 4.25 bits a weight; dummy weights use every code at small scales; settings the build cannot
honour fail at start-up with the reason. The kernel itself against its reference: tests/test_moe_kernels.py
(kernels/moe/selfcheck.py's mxfp4 cases)."""
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
    rounded to the same blocks at load. Either way the interpreted kernel gives the dequantized path's tokens."""
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


def test_intermediate_shard_off_the_scale_groups_is_refused() -> None:
    pytest.importorskip("triton")
    from appliance.layers import parallel_state
    from appliance.models.gpt_oss import GptOssExperts

    try:
        parallel_state.init_tensor_parallel(0, 2, group=object())
        with torch.device("meta"), pytest.raises(ValueError, match="multiples of 32"):
            GptOssExperts(_gpt_oss_config(intermediate_size=96), "triton", "mxfp4")  # 48 per rank
    finally:
        parallel_state.init_tensor_parallel(0, 1)


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

