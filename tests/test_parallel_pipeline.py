"""The real pipeline on the CPU with tensor parallelism (2 worker processes, gloo) and data parallelism (2
replicas behind one HTTP front): greedy tokens equal the single-process engine's, KV pools are whole afterwards,
and killing one tensor-parallel worker ends the pipeline non-zero with no process left behind."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pipeline_server import (
    alive,
    free_port,
    stage_children,
    start_run,
    stop,
    survivors,
    wait_healthy,
)

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Hello world! Hello there,", "def main():\n", "Numbers 0123", "Emoji time"]
MAX_TOKENS = 12


def _free_port_block(n: int) -> int:
    """A port P with P .. P + n - 1 all free now (multi-node derives its socket ports from P)."""
    for _ in range(50):
        base = free_port()
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


class Pipeline:
    def __init__(self, model: Path, tmp: Path, device: str = "cpu", port: int | None = None, wait: bool = True,
                 **parallelism: Any) -> None:
        port = port or free_port()
        cfg = tmp / f"serve{parallelism.get('node_rank', '')}.toml"
        par = "\n".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in parallelism.items())
        cfg.write_text(f'[model]\npath = "{model}"\ndevice = "{device}"\n[parallelism]\n{par}\n'
                       f'[cache]\nmax_total_tokens = 2048\n[api]\nport = {port}\nserved_model_name = "tiny"\n'
                       '[observability]\nlog_level = "warning"\n')
        self.proc = start_run(cfg)
        self.base = f"http://127.0.0.1:{port}"
        self.stages: dict[int, str] = {}
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        wait_healthy(self.proc, self.base, timeout_s=120)
        self.stages = stage_children(self.proc.pid)

    def post(self, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{self.base}/v1/completions", timeout=60, json={"model": "tiny", **body})
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        return self.post(body)["choices"][0]["text"]

    def complete_all(self) -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: the replicas share them
            return list(pool.map(self.complete, PROMPTS))

    def idle_stats(self) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            s = httpx.get(f"{self.base}/v1/internal/stats", timeout=10).json()
            if (s["num_running"], s["kv_blocks_owned"]) == (0, 0) or time.monotonic() > deadline:
                return s
            time.sleep(0.1)

    def stop(self) -> int:
        return stop(self, expect_clean_exit=False)  # the callers assert the exit code


@pytest.fixture(scope="module")
def reference(make_tiny_model: Any) -> list[str]:
    """Greedy texts of the single-process engine (tp = 1) on the CPU, the oracle."""
    return _single_process_texts(make_tiny_model("llama"), "cpu")


def _single_process_texts(model: Path, device: str) -> list[str]:
    from appliance.engine.sampling_params import SamplingParams
    from appliance.entrypoints.llm import LLM

    llm = LLM(model=str(model), max_total_tokens=2048, device=device)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    llm.shutdown()
    return texts


def _assert_pools_whole(s: dict[str, Any]) -> None:
    assert (s["num_running"], s["num_waiting"], s["kv_blocks_owned"]) == (0, 0, 0), s
    assert s["kv_blocks_free"] + s["kv_blocks_cached"] == s["kv_blocks_total"] and s["accounting_ok"], s


def test_tp2_matches_tp1_and_dies_cleanly(make_tiny_model: Any, reference: list[str], tmp_path: Path) -> None:
    pipe = Pipeline(make_tiny_model("llama"), tmp_path, tp=2)
    try:
        assert sorted(pipe.stages.values()) == ["scheduler", "tokenizer", "worker0", "worker1"]
        assert pipe.complete_all() == reference
        # random sampling: the ranks keep identical sampler seeds, so they agree (the scheduler checks every step)
        sampled = [pipe.post({"prompt": p, "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "n": 2})
                   for p in PROMPTS[:3]]
        assert all(len(r["choices"]) == 2 for r in sampled)
        _assert_pools_whole(pipe.idle_stats())
        worker1 = next(pid for pid, name in pipe.stages.items() if name == "worker1")
        os.kill(worker1, signal.SIGKILL)  # rank 0 is left waiting in a collective: it must be stopped too
        code = pipe.proc.wait(timeout=30)
        assert code != 0
    finally:
        if pipe.proc.poll() is None:
            pipe.proc.kill()
        pipe.proc.wait(timeout=30)
    assert not survivors(pipe.stages, within_s=10), "orphaned stages"


def test_dp2_matches_tp1_and_balances(make_tiny_model: Any, reference: list[str], tmp_path: Path) -> None:
    pipe = Pipeline(make_tiny_model("llama"), tmp_path, dp=2)
    try:
        assert sorted(pipe.stages.values()) == ["dp0.worker0", "dp1.worker0", "scheduler0", "scheduler1",
                                                "tokenizer"]
        assert pipe.complete_all() == reference
        assert [pipe.complete(p) for p in PROMPTS[:2]] == reference[:2]  # sequential requests alternate too
        s = pipe.idle_stats()
        _assert_pools_whole(s)
        steps = [r["num_steps"] for r in s["replicas"]]
        assert len(steps) == 2 and all(n > 0 for n in steps), s  # both replicas served requests
        assert s["kv_blocks_total"] == sum(r["kv_blocks_total"] for r in s["replicas"])
    finally:
        assert pipe.stop() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_two_gpus_with_nccl(make_tiny_model: Any, tmp_path: Path) -> None:
    model = make_tiny_model("llama")
    expected = _single_process_texts(model, "cuda")
    pipe = Pipeline(model, tmp_path, device="cuda", tp=2, devices=[1, 0])  # devices: rank 0 on GPU 1
    try:
        assert pipe.complete_all() == expected
        _assert_pools_whole(pipe.idle_stats())
    finally:
        assert pipe.stop() == 0


def test_two_nodes_over_loopback(make_tiny_model: Any, reference: list[str], tmp_path: Path) -> None:
    """tp = 2 over two "nodes" (two supervisors, one worker each, tcp between them): node 0 serves HTTP; when
    the head stops, the other node's worker loses its scheduler and that node ends non-zero, leaving nothing."""
    model, port = make_tiny_model("llama"), free_port()
    rendezvous = _free_port_block(5)  # P: torch rendezvous, P+1, P+2: plan sockets, P+3: results
    common = {"tp": 2, "nnodes": 2, "dist_init_addr": f"127.0.0.1:{rendezvous}"}
    other = Pipeline(model, tmp_path, port=port, wait=False, node_rank=1, **common)
    head = Pipeline(model, tmp_path, port=port, wait=False, node_rank=0, **common)
    try:
        head.wait_ready()
        other.stages = stage_children(other.proc.pid)
        assert sorted(head.stages.values()) == ["scheduler", "tokenizer", "worker0"]
        assert sorted(other.stages.values()) == ["worker1"]
        assert head.complete_all() == reference
        _assert_pools_whole(head.idle_stats())
        assert head.stop() == 0
        assert other.proc.wait(timeout=30) != 0
    finally:
        for p in (head, other):
            if p.proc.poll() is None:
                p.proc.kill()
            p.proc.wait(timeout=30)
    assert not [n for pid, n in other.stages.items() if alive(pid)], "orphaned stages"


def test_offline_llm_with_two_tensor_parallel_workers(make_tiny_model: Any, reference: list[str]) -> None:
    from appliance.engine.sampling_params import SamplingParams
    from appliance.entrypoints.llm import LLM

    llm = LLM(model=str(make_tiny_model("llama")), max_total_tokens=2048, tensor_parallel_size=2)
    procs = list(llm.executor._procs)
    try:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert [o.outputs[0].text for o in llm.generate(PROMPTS, params)] == reference
        os.kill(procs[1].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="worker"):  # a dead rank fails the call, it does not hang
            llm.generate(PROMPTS[:1], params)
    finally:
        llm.shutdown()
    assert not [p.pid for p in procs if alive(p.pid)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_offline_moe_tp2_on_two_gpus(tmp_path: Path, expert_parallel: bool) -> None:
    """Mixtral with its experts tensor-split, or whole on their rank (ep = tp), over NCCL: same greedy tokens."""
    from test_moe_models import build_family

    from appliance.engine.sampling_params import SamplingParams
    from appliance.entrypoints.llm import LLM

    model = build_family("mixtral", tmp_path / "mixtral")
    prompts = [{"prompt_token_ids": [5 + i, 6 + i, 7 + i, 8]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def tokens(**kw: Any) -> list[list[int]]:
        llm = LLM(model=str(model), max_total_tokens=2048, device="cuda", skip_tokenizer_init=True, **kw)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()

    assert tokens(tensor_parallel_size=2, enable_expert_parallel=expert_parallel) == tokens()
