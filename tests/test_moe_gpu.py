"""GPU path of the MoE families: the Triton backends (fused MoE, MLA store/decode, CUDA-graph decode) give the
same greedy tokens as transformers on the CPU, float32 with TF32 off, for tiny random-weight models."""
from __future__ import annotations

import pytest
import torch
from test_moe_models import PROMPTS, build_family

from appliance import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda_graphs"])
def test_triton_backends_match_transformers(family: str, eager: bool, tmp_path, hf_greedy) -> None:
    path = build_family(family, tmp_path / family)
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.3, block_size=16,
              attention_backend="triton", moe_backend="triton", enforce_eager=eager, skip_tokenizer_init=True,
              chunked_prefill_size=16)
    assert llm.executor.runner.model.supports_cuda_graphs
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    refs = hf_greedy(path, PROMPTS, 8)
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]
