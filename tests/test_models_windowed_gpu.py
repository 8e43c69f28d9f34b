"""gpt-oss and Gemma 3 on the GPU path: Triton attention with windows and sinks, gpt-oss's experts in the Triton
fused MoE, decode in CUDA graphs; float32 greedy tokens equal transformers' (on the CPU), with chunked prefill
and a second pass over the prefix cache."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_vs_transformers import NEW, PROMPTS, greedy_params
from test_models_windowed import FAMILIES, WINDOW, build_family

from appliance import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda_graphs"])
def test_gpu_triton_matches_transformers(family: str, eager: bool, tmp_path: Path, tiny_tokenizer_dir: Path,
                                         hf_greedy: Any) -> None:
    path = build_family(family, tmp_path / family, tiny_tokenizer_dir)
    refs = hf_greedy(path, PROMPTS, NEW)
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.3, block_size=16,
              attention_backend="triton", chunked_prefill_size=16, enforce_eager=eager)
    runner = llm.executor.runner
    assert runner.backend == "triton" and runner.model.supports_cuda_graphs
    assert (runner.graphs is None) == eager
    # the sliding layers keep their windows, in groups of the full group's size sharing its pool (Gemma: two
    # groups of one layer; gpt-oss: one), eager or in graphs (executor/window_table.py)
    assert runner.kv_layout.window_sizes == (WINDOW,) * {"gemma3": 2, "gpt_oss": 1}[family]
    assert runner.kv_layout.shared and llm.engine.config.window_shared
    assert eager or runner.graphs.windows is runner.window_table is not None
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params())
        assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]
    assert llm.engine.check_accounting().ok
