"""The one-shot all-reduce on 2 GPUs: its sums equal NCCL's (eager and inside a CUDA graph), big messages go to
NCCL, and tp=2 with CUDA graphs and the one-shot gives tp=1's greedy tokens. Skipped without 2 GPUs.

The ranks are this file run as a script (`python tests/test_custom_all_reduce_gpu.py RANK PORT OUT`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs 2 GPUs")]
ROWS = (1, 3, 8, 64, 512)
HIDDEN = 4096


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from appliance.executor.distributed import (
        DistributedEnv,
        init_distributed,
        shutdown_distributed,
    )
    from appliance.layers import parallel_state

    init_distributed("cuda", DistributedEnv(rank, 2, rank, "127.0.0.1", port))
    report: dict[str, Any] = {"installed": parallel_state._ONE_SHOT is not None, "checks": []}
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN, device="cuda", dtype=dtype, generator=gen)
            ref = x.clone()
            dist.all_reduce(ref)  # NCCL
            kind = parallel_state.all_reduce_kind(x)
            got = parallel_state.tp_all_reduce(x.clone())
            # the same inside a captured graph, replayed on fresh data
            static = torch.zeros_like(x)
            graph = torch.cuda.CUDAGraph()
            parallel_state.tp_all_reduce(static.clone())  # warm-up outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                static_out = parallel_state.tp_all_reduce(static)
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            report["checks"].append({"dtype": str(dtype), "rows": rows, "kind": kind,
                                     "eager_equal": bool(torch.equal(got, ref)),
                                     "graph_equal": bool(torch.equal(static_out, ref))})
    big = torch.ones(2048, HIDDEN, device="cuda", dtype=torch.bfloat16)  # 16 MiB > the 8 MiB buffer
    report["big_kind"] = parallel_state.all_reduce_kind(big)
    report["big_ok"] = bool(torch.all(parallel_state.tp_all_reduce(big) == 2).item())
    Path(out).write_text(json.dumps(report))
    shutdown_distributed()


def test_one_shot_equals_nccl_on_two_gpus(tmp_path: Path) -> None:
    from appliance.runtime.topology import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]))}
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(outs[r])], env=env) for r in range(2)]
    try:
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for out in outs:
        rep = json.loads(out.read_text())
        assert rep["installed"], "the one-shot all-reduce was not set up on 2 GPUs of one host"
        assert all(c["kind"] == "one_shot" for c in rep["checks"]), rep["checks"]
        bad = [c for c in rep["checks"] if not (c["eager_equal"] and c["graph_equal"])]
        assert not bad, bad  # two ranks: a + b in either order, so equal to NCCL bit for bit
        assert rep["big_kind"] == "torch" and rep["big_ok"]


def test_tp2_with_graphs_and_one_shot_matches_tp1(make_tiny_model: Any, capfd: pytest.CaptureFixture[str]) -> None:
    from appliance.engine.sampling_params import SamplingParams
    from appliance.entrypoints.llm import LLM

    model = str(make_tiny_model("llama"))
    prompts = [{"prompt_token_ids": [5 + i, 6 + i, 7 + i, 8]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def tokens(**kw: Any) -> list[list[int]]:
        llm = LLM(model=model, max_total_tokens=4096, device="cuda", skip_tokenizer_init=True, dtype="float32",
                  cuda_graph_max_bs=4, **kw)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()

    expected = tokens()
    assert tokens(tensor_parallel_size=2) == expected
    err = capfd.readouterr().err
    assert "one-shot over CUDA IPC" in err, "workers did not report the one-shot all-reduce"
    assert tokens(tensor_parallel_size=2, disable_custom_all_reduce=True) == expected
    err = capfd.readouterr().err
    assert "NCCL for every message (disabled" in err, "parallelism.disable_custom_all_reduce did not reach workers"


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
