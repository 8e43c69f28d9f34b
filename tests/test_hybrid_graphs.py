"""Decode graphs of hybrid linear-attention models (executor/cuda_graph.py `DecodeGraphs(with_states=True)`): the
rows' device table rows are their state slots, pad rows use the scratch slot 0. On the CPU the same static, padded
path runs without capturing and its greedy tokens equal transformers'; on a GPU the captured graphs equal eager."""
from __future__ import annotations

import pytest
import torch
from decode_graphs import use_graphs

from appliance import LLM, SamplingParams
from appliance.executor.cuda_graph import GraphKey
from tests.test_models_vs_transformers import PROMPTS

NEW = 8
LONG = list(range(3, 3 + 45))  # three 16-token chunks: its decodes join the others' while they run


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_padded_decode_graph_path_matches_transformers(arch: str, make_tiny_model, hf_greedy) -> None:
    path = make_tiny_model(arch)
    prompts = PROMPTS[:3] + [LONG]  # 3 or 4 decode rows -> padded to 4 (pad rows use the scratch state slot)
    refs = [tokens for tokens, _ in hf_greedy(path, prompts, NEW)]
    llm = LLM(model=str(path), dtype="float32", block_size=4, chunked_prefill_size=16, max_num_seqs=8)
    _, keys = use_graphs(llm, [1, 2, 4])
    assert llm.executor.runner.graphs.with_states
    assert _greedy(llm, prompts, NEW) == refs
    assert GraphKey(4, 16) in keys  # live rows and padding rows went through the static path
    # a batch above every capture size runs eagerly, and a second pass reuses the freed slots
    keys.clear()
    assert _greedy(llm, prompts * 2, NEW) == refs * 2
    assert llm.engine.check_accounting().ok


def test_graph_rows_are_the_state_slots(make_tiny_model) -> None:
    """A graph replayed for one set of requests, then for another: each row's state advances in its own slot,
    so the slots come from the uploaded rows, not from anything fixed at capture."""
    path = make_tiny_model("qwen3_next")
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_seqs=4)
    alone = [_greedy(llm, [p], NEW)[0] for p in PROMPTS[:3]]
    _, keys = use_graphs(llm, [4])
    assert _greedy(llm, PROMPTS[:3], NEW) == alone
    assert _greedy(llm, PROMPTS[2:0:-1], NEW) == alone[2:0:-1]  # the same graph, other rows
    assert set(keys) == {GraphKey(4, 16)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_cuda_graphs_match_eager_on_gpu(arch: str, make_tiny_model) -> None:
    path = make_tiny_model(arch)
    llm = LLM(model=str(path), dtype="bfloat16", block_size=16, max_total_tokens=8192, skip_tokenizer_init=True,
              cuda_graph_max_bs=8, chunked_prefill_size=64)
    runner = llm.executor.runner
    assert runner.graphs is not None and runner.graphs.with_states
    # four rows, a capture size: decode-only steps run the same row count in both runs (the fused MoE's tiles
    # follow the row count), the long prompt's chunks make mixed steps that run eagerly in both
    prompts = [[5, 6, 7], list(range(10, 80)), [9] * 21, [3] * 300]
    with_graphs = _greedy(llm, prompts, 24)
    assert runner.graphs.graphs  # captured and replayed
    runner.use_graphs = False
    assert _greedy(llm, prompts, 24) == with_graphs
