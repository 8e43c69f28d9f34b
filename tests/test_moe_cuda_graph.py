"""The padded CUDA-graph decode path (executor/cuda_graph.py; on the CPU it runs the same static, padded buffers
without capturing) gives the same greedy tokens as eager decoding for the MoE and MLA families: padding rows
(token 0, slot -1, seq_len 0) go through the router, the experts and the latent cache without effect."""
from __future__ import annotations

from pathlib import Path

import pytest
from decode_graphs import use_graphs
from test_moe_models import (
    build_family,
    one_thread,  # noqa: F401  (autouse: one torch thread in this module)
)

from appliance import LLM, SamplingParams
from appliance.executor.cuda_graph import GraphKey


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_padded_decode_graph_path_matches_eager(family: str, tmp_path: Path) -> None:
    path = build_family(family, tmp_path / family)
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_total_tokens=1024, skip_tokenizer_init=True)
    prompts = [[5, 6, 7], list(range(10, 60)), [9] * 21]  # 3 rows -> padded to 4; tables of 1..15 blocks
    eager = _greedy(llm, prompts, 8)
    _, keys = use_graphs(llm, [1, 2, 4])
    assert _greedy(llm, prompts, 8) == eager
    assert GraphKey(4, 16) in keys  # three live rows and one padding row went through the static path
