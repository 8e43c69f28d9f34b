"""Decode graphs under expert parallelism (ep = tp = 2) on a tiny DeepSeek-V2 (MLA + routed and shared experts).

graph_settings captures decode graphs with ep > 1 because this holds on GPUs (measured on 2x H200); the ranks here
build DecodeGraphs themselves, so the check runs whatever graph_settings says:
- CPU (two gloo ranks, always run): the graphs' padded static-buffer path (no capture on a CPU) gives the greedy
  tokens of eager decoding on the same ranks and of one unsharded process. Padding rows go through the router,
  the experts of both ranks and the all-reduce without effect.
- GPU (two NCCL ranks on two GPUs, `-m gpu`): the same with the graphs really captured and replayed.

The ranks are this file run as a script: `python tests/test_ep_graphs.py RANK PORT MODEL DEVICE OUT`.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

PROMPTS = [[5, 6, 7], list(range(10, 60)), [9] * 21]  # 3 rows -> padded to 4
NEW_TOKENS = 8
LLM_ARGS: dict[str, Any] = {"dtype": "float32", "block_size": 4, "max_total_tokens": 2048, "skip_tokenizer_init": True}


def _greedy(llm: Any) -> list[list[int]]:
    from appliance import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]


def _rank_main(rank: int, port: int, model: str, device: str, out: str) -> None:
    from decode_graphs import use_graphs
    from graph_ranks import finish_rank

    from appliance import LLM
    from appliance.executor.distributed import DistributedEnv, init_distributed
    from appliance.layers import parallel_state

    init_distributed(device, DistributedEnv(rank, 2, rank, "127.0.0.1", port))
    parallel_state.init_expert_parallel(True)
    llm = LLM(model=model, device=device, **LLM_ARGS)  # tp=1 config: the in-process runner shards by the group
    r = llm.executor.runner
    eager = _greedy(llm)
    graphs, keys = use_graphs(llm, [1, 2, 4, 8])
    tokens = _greedy(llm)
    experts = next(m for m in r.model.modules() if hasattr(m, "num_local"))
    report = {"eager": eager, "graphs": tokens, "keys": keys, "captured": len(graphs.graphs),
              "local_experts": experts.num_local, "ep_size": experts.ep_size}
    finish_rank(report, out)


def _run_ranks(model: Path, tmp_path: Path, device: str) -> list[dict[str, Any]]:
    from graph_ranks import run_two_ranks

    return run_two_ranks(__file__, [str(model), device], tmp_path)


def _check(reports: list[dict[str, Any]], reference: list[list[int]] | None) -> None:
    for rep in reports:
        assert rep["ep_size"] == 2 and rep["local_experts"] == 2  # 4 routed experts, split over the ranks
        assert rep["graphs"] == rep["eager"]
        if reference is not None:
            assert rep["eager"] == reference
        assert rep["keys"] and {k[0] for k in rep["keys"]} <= {1, 2, 4}  # decode steps went through the graphs
    assert reports[0]["keys"] == reports[1]["keys"]  # both ranks replay the same key every step


def test_ep2_padded_graph_path_matches_eager_on_cpu(tmp_path: Path) -> None:
    from test_moe_models import build_family

    from appliance import LLM

    model = build_family("deepseek_v2", tmp_path / "dsv2")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: spin-waiting threads only cost time on a busy 2-core machine
    try:
        reference = _greedy(LLM(model=str(model), **LLM_ARGS))
    finally:
        torch.set_num_threads(before)
    _check(_run_ranks(model, tmp_path, "cpu"), reference)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_ep2_captured_graphs_match_eager(tmp_path: Path) -> None:
    from test_moe_models import build_family

    reports = _run_ranks(build_family("deepseek_v2", tmp_path / "dsv2"), tmp_path, "cuda")
    _check(reports, None)  # tf32 kernels on the GPU: compared with eager on the same ranks, not with the CPU
    assert all(rep["captured"] > 0 for rep in reports)


if __name__ == "__main__":  # run as a script: tests/ is sys.path[0]
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
