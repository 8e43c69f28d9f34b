"""A tiny DeepSeek-V3 on the GPU code path, run on the CPU under Triton's interpreter: the Triton MLA store,
decode and prefill, the fp8 fused MoE and the block-fp8 GEMMs (quantization = fp8 quantizes the float checkpoint
at load) give the same greedy tokens as the torch reference kernels on the same weights, with chunked prefill and
prefix-cache hits (prefill over a cached latent prefix). fp8 only, for CI time: the bf16 Triton path of these
models is compared with transformers on the GPU (test_moe_gpu.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_moe_models import PROMPTS, build_family

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
import torch
from appliance import LLM, SamplingParams
torch.set_num_threads(1)
path, prompts = sys.argv[1], json.loads(sys.argv[2])
sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
out = {}
for quant in ("fp8",):
    for be in ("torch", "triton"):
        llm = LLM(model=path, dtype="float32", block_size=4, skip_tokenizer_init=True, attention_backend=be,
                  moe_backend=be, chunked_prefill_size=16, quantization=quant)
        assert llm.executor.runner.backend == be
        runs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
                for _ in range(2)]  # the second pass hits the prefix cache
        out[f"{quant}-{be}"] = runs
print(json.dumps(out))
"""


@pytest.mark.slow
def test_triton_deepseek_matches_torch_kernels_interpreted(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    path = build_family("deepseek_v3", tmp_path / "v3")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path), json.dumps(PROMPTS[:3])], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for quant in ("fp8",):
        torch_runs, triton_runs = out[f"{quant}-torch"], out[f"{quant}-triton"]
        assert torch_runs[0] == torch_runs[1] and triton_runs == torch_runs, quant
