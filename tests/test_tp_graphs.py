"""CUDA graphs under tensor parallelism: graph_settings turns them on for tp > 1, and the graphs' padded decode
path (run without capture on the CPU) gives tp=2 (two gloo ranks) the same greedy tokens as tp=1.

The ranks are this file run as a script (`python tests/test_tp_graphs.py RANK PORT MODEL OUT`): each joins a
two-rank gloo group, builds the in-process engine over its shards and decodes through DecodeGraphs.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

PROMPTS = [[5, 6, 7], list(range(10, 80)), [9] * 21]  # 3 rows -> padded to 4; tables of 1..20 blocks
NEW_TOKENS = 10
LLM_ARGS: dict[str, Any] = {"dtype": "float32", "block_size": 4, "max_total_tokens": 2048,
                            "skip_tokenizer_init": True}


def _greedy(llm: Any) -> list[list[int]]:
    from appliance import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]


def _rank_main(rank: int, port: int, model: str, out: str) -> None:
    """One tp rank: shards from parallel_state, decode steps through the graphs' padded static buffers."""
    from decode_graphs import use_graphs
    from graph_ranks import finish_rank

    from appliance import LLM
    from appliance.executor.distributed import DistributedEnv, init_distributed
    from appliance.layers import parallel_state

    init_distributed("cpu", DistributedEnv(rank, 2, rank, "127.0.0.1", port))
    llm = LLM(model=model, **LLM_ARGS)  # tp=1 in the config: one in-process runner per rank, sharded by the group
    r = llm.executor.runner
    _, keys = use_graphs(llm, [1, 2, 4, 8])
    tokens = _greedy(llm)
    report = {"tokens": tokens, "keys": keys, "one_shot": parallel_state._ONE_SHOT is not None,
              "shard_heads": r.model.attention_layers()[0].num_kv_heads}
    finish_rank(report, out)


def test_graph_settings_on_under_tensor_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.executor.cuda_graph import graph_settings
    from appliance.layers import parallel_state

    config = SimpleNamespace(backends=SimpleNamespace(enforce_eager=False, cuda_graph_sizes=None,
                                                      cuda_graph_max_bs=8),
                             scheduler=SimpleNamespace(max_num_seqs=64))
    llama = SimpleNamespace(supports_cuda_graphs=True)
    cuda = torch.device("cuda")
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(1, 2, object()))
    assert graph_settings(config, llama, cuda) == [1, 2, 4, 8]  # tp=2: the all-reduces are captured
    assert graph_settings(config, SimpleNamespace(), cuda) is None  # the model still has to declare support
    assert graph_settings(config, llama, torch.device("cpu")) is None  # gloo: never captured
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", True)
    assert graph_settings(config, llama, cuda) == [1, 2, 4, 8]  # ep > 1: captured too (test_ep_graphs)


def test_tp2_padded_graph_path_matches_tp1_on_cpu(tiny_model: Path, tmp_path: Path) -> None:
    from graph_ranks import run_two_ranks

    from appliance import LLM

    reference = _greedy(LLM(model=str(tiny_model), **LLM_ARGS))
    reports = run_two_ranks(__file__, [str(tiny_model)], tmp_path, timeout_s=240)
    from transformers import AutoConfig

    kv_heads = AutoConfig.from_pretrained(str(tiny_model)).num_key_value_heads
    for rep in reports:
        assert rep["tokens"] == reference
        assert rep["one_shot"] is False  # gloo: every message goes through torch.distributed
        assert rep["shard_heads"] * 2 == kv_heads  # really sharded, not two full replicas
        assert [4, 32] in rep["keys"] and {k[0] for k in rep["keys"]} <= {1, 2, 4}
    assert reports[0]["keys"] == reports[1]["keys"]  # every rank replays the same graph key every step


if __name__ == "__main__":  # run as a script: tests/ is sys.path[0]
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
