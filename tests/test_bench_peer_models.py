"""benchmarks/peer_models.py and its helpers on the CPU, without vLLM: the peer's modules import only what the peer
kit's Python path has, our benchmarks write the exact prompts they run, the peer's measurements (against a stand-in
for vLLM's LLM) run those prompts and report our keys, a model that cannot run is a row with its cause, and the
summary puts both side by side."""
from __future__ import annotations

import ast
import enum
import importlib.util
import json
import random
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.bench.workloads import random_workload
from benchmarks import hybrid, models, peer_kv, peer_measure, peer_models
from benchmarks.summary import table

ROOT = Path(__file__).resolve().parents[1]
PEER_MODULES = ("peer_models", "peer_measure", "peer_kv")
ALLOWED = {"vllm", "torch", "numpy", "benchmarks", "__future__"} | set(sys.stdlib_module_names)


def test_peer_modules_import_only_what_the_peer_path_has() -> None:
    """Every import (nested ones too) is the standard library, vllm, torch, numpy or another peer module; importing
    them loads none of appliance, vllm or torch."""
    for name in PEER_MODULES:
        tree = ast.parse((ROOT / "benchmarks" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [node.module or ""]
                if roots[0] == "benchmarks" or roots[0].startswith("benchmarks."):
                    assert roots[0].split(".")[-1] in PEER_MODULES, (name, roots)
            else:
                continue
            assert all(r.split(".")[0] in ALLOWED for r in roots), (name, roots)
    code = ("import sys; import benchmarks.peer_models, benchmarks.peer_measure, benchmarks.peer_kv; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'appliance', 'vllm', 'torch', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def spec_of(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / peer_models.WORKLOAD).read_text())


def test_models_write_the_prompts_they_run(tmp_path: Path) -> None:
    assert models.main(["--quick", "--write-configs", str(tmp_path)]) == []
    dirs = peer_models.model_dirs(tmp_path)
    assert [d.name for d in dirs] == list(models.QUICK_MODELS)  # in the order written
    for d in dirs:
        config = json.loads((d / "config.json").read_text())
        assert config == json.loads((models.model_dir(d.name, tmp_path / "again" / d.name, True) / "config.json")
                                    .read_text())
        spec = spec_of(d)
        assert spec["kind"] == "models" and spec["model"] == d.name and spec["kv_context"] == 64
        assert spec["engine"] == {"max_model_len": 128, "max_num_seqs": 8, "enforce_eager": False}
        vocab = config["vocab_size"]
        assert spec["batch1"] == {"prompts": random_workload(vocab, 2, (24, 24), (8, 8), seed=1).prompts,
                                  "output_len": 8}
        work = random_workload(vocab, 4, (24, 24), (8, 8), seed=2)
        assert spec["throughput"] == {"prompts": work.prompts, "output_lens": [8] * 4, "input_len": 24,
                                      "output_len": 8}
        assert "quantization_config" not in config


def test_an_mxfp4_row_tells_the_peer_to_keep_its_experts_in_mxfp4(tmp_path: Path) -> None:
    models.main(["--quick", "--only", "gpt-oss-20b-mxfp4", "--write-configs", str(tmp_path)])
    config = json.loads((tmp_path / "gpt-oss-20b-mxfp4" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert spec_of(tmp_path / "gpt-oss-20b-mxfp4")["model"] == "gpt-oss-20b-mxfp4"


def test_hybrid_writes_the_prompts_it_runs(tmp_path: Path) -> None:
    hybrid.main(["--quick", "--write-configs", str(tmp_path)])
    (d,) = peer_models.model_dirs(tmp_path)
    spec = spec_of(d)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    assert spec["kind"] == "hybrid" and spec["layers"] == 4
    assert spec["batch1"]["prompts"] == random_workload(vocab, 2, (24, 24), (4, 4), seed=1).prompts
    rng = random.Random(0)
    assert spec["throughput"]["prompts"] == [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(4)]
    turns = spec["multi_turn"]  # turn_len 64: 57 shared (a 43-token prompt and a 14-token answer), 7 new
    assert (turns["turn_len"], turns["shared"], turns["answer"]) == (64, 57, 14)
    assert [len(f) for f in turns["firsts"]] == [43, 43] and [len(t) for t in turns["tails"]] == [7, 7]
    work = hybrid.make_prompts(hybrid.parse_args(["--quick"]), vocab)
    assert (turns["firsts"], turns["tails"]) == (work.turns.firsts, work.turns.tails)


def test_arguments() -> None:
    args = peer_models.parse_args(["DIR", "--only", "a", "--only", "b", "--deadline-s", "400"])
    assert (args.dir, args.only, args.deadline_s, args.child) == (Path("DIR"), ["a", "b"], 400.0, None)
    with pytest.raises(SystemExit):
        peer_models.parse_args(["DIR", "--child", "measure"])  # a child needs its result file
    with pytest.raises(SystemExit):
        peer_models.parse_args(["DIR", "--child", "nope", "--result", "r.json"])


def test_model_dirs_refuse_what_is_not_there(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no workload.json"):
        peer_models.model_dirs(tmp_path)
    models.main(["--quick", "--only", "gemma-3-12b", "--write-configs", str(tmp_path)])
    with pytest.raises(SystemExit, match="no workload for gpt-oss-20b"):
        peer_models.model_dirs(tmp_path, ["gpt-oss-20b"])
    assert peer_models.model_dirs(tmp_path / "gemma-3-12b") == [tmp_path / "gemma-3-12b"]
    with pytest.raises(ValueError, match="kind"):
        peer_models.write_workload(tmp_path, {"kind": "other"})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the rows of a missing vLLM")
def test_a_model_the_peer_cannot_run_is_a_row_with_its_cause(tmp_path: Path) -> None:
    models.main(["--quick", "--only", "gemma-3-12b", "--write-configs", str(tmp_path / "m")])
    out = tmp_path / "peer.json"
    records = peer_models.main([str(tmp_path / "m"), "--output-json", str(out), "--log-dir", str(tmp_path)])
    assert json.loads(out.read_text()) == records
    (r,) = records
    assert r["model"] == "gemma-3-12b" and r["error"] == "exit status 1"
    assert r["cause"] == "ModuleNotFoundError: No module named 'vllm'"
    assert Path(r["log"]).is_file() and r["log_tail"][-1] == r["cause"]


def test_the_time_limit_reports_what_it_leaves_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hybrid.main(["--quick", "--write-configs", str(tmp_path)])
    records = peer_models.main([str(tmp_path), "--deadline-s", "1"])
    assert [(r["phase"], r["layers"]) for r in records] == [("plain", 4), ("snapshots", 4)]
    assert all(r["error"].startswith("not run: the run's time limit") for r in records)
    hang = tmp_path / "hang.sh"  # a child that never ends: stopped at its timeout, with its process group
    hang.write_text("#!/bin/sh\nsleep 60\n")
    hang.chmod(0o755)
    monkeypatch.setattr(peer_models.sys, "executable", str(hang))
    t = time.monotonic()
    (r,) = peer_models.run_child(tmp_path / "qwen3-next", "plain", 1.0, tmp_path)
    assert time.monotonic() - t < 30 and r["error"] == "not finished in 1 s"


def test_tpot_is_ours() -> None:
    assert peer_models.tpot_ms([10.0, 10.004, 10.008, 10.012]) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        peer_models.tpot_ms([1.0])


def test_kv_per_sequence_from_vllms_groups() -> None:
    """Gemma 3's layout as vLLM groups it: five groups of 8 sliding layers and one of 8 full ones (and a recurrent
    state group, which holds no KV of the context)."""
    page, ctx = 4096, 32768
    full = {"spec": "FullAttentionSpec", "layers": 8, "block_size": 16, "page_bytes": page, "sliding_window": None,
            "request_bytes": ctx // 16 * page}
    window = {**full, "spec": "SlidingWindowSpec", "sliding_window": 1024, "request_bytes": 577 * page}
    state = {**full, "spec": "MambaSpec", "layers": 3, "request_bytes": 2 * page}
    facts = {"num_blocks": 10_000, "kv_bytes": 10_000 * 8 * page, "max_model_len": ctx,
             "groups": [window] * 5 + [full, state], "max_concurrency": 4.0, "attention_backends": ["FLASH_ATTN"]}
    kv = peer_kv.kv_per_sequence(facts, ctx)
    assert kv["group_blocks"] == {"window_1024": {"layers": 40, "blocks": 577}, "full": {"layers": 8, "blocks": 2048}}
    assert kv["blocks_per_sequence"] == {"window_1024": 577, "full": 2048}
    assert kv["ratio"] == kv["allocated_ratio"] == pytest.approx((40 * 577 + 8 * 2048) / (48 * 2048))
    assert kv["allocated_gib"] == pytest.approx((40 * 577 + 8 * 2048) * page / 2**30)
    assert kv["max_len_request_gib"] == pytest.approx(10_000 * 8 * page / 4.0 / 2**30)
    assert (kv["context"], kv["block_size"], kv["kv_groups"], kv["layers"], kv["sliding_layers"]) == \
        (ctx, 16, True, 48, 40)
    short = peer_kv.kv_per_sequence(facts, 4096)  # below the window's reservation: the context's blocks
    assert short["group_blocks"] == {"window_1024": {"layers": 40, "blocks": 256}, "full": {"layers": 8, "blocks": 256}}
    assert short["ratio"] == 1.0 and short["context"] == 4096


class FakeLLM:
    """vLLM's LLM as the peer's measurements use it: every request makes max_tokens tokens; with prefix caching, a
    prompt's cached tokens are its longest common prefix with an earlier prompt."""

    def __init__(self, prefix_caching: bool = False, stream_fails: bool = False) -> None:
        self.seen: list[list[int]] = []
        self.prefix_caching = prefix_caching
        cache = SimpleNamespace(mamba_block_size=16 if prefix_caching else None,
                                mamba_cache_mode="all" if prefix_caching else "none")
        self.llm_engine = FakeEngine(self, stream_fails, SimpleNamespace(cache_config=cache))

    def cached(self, prompt: list[int]) -> int:
        def common(a: list[int], b: list[int]) -> int:
            return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

        hit = max((common(prompt, p) for p in self.seen), default=0) if self.prefix_caching else 0
        self.seen.append(prompt)
        return hit

    def generate(self, prompts: list[dict], params: Any, use_tqdm: bool = True) -> list[Any]:
        per = params if isinstance(params, list) else [params] * len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5] * p.max_tokens)],
                                num_cached_tokens=self.cached(q["prompt_token_ids"])) for q, p in zip(prompts, per)]

    def collective_rpc(self, method: Any) -> list[dict[str, Any]]:
        assert method is peer_kv.kv_facts
        group = {"spec": "FullAttentionSpec", "layers": 2, "block_size": 16, "page_bytes": 64,
                 "sliding_window": None, "request_bytes": 8 * 64}
        return [{"num_blocks": 80, "kv_bytes": 80 * 2 * 64, "max_model_len": 128, "groups": [group],
                 "max_concurrency": 10.0, "attention_backends": ["FLASH_ATTN"]}]


class FakeEngine:
    def __init__(self, llm: FakeLLM, fails: bool, vllm_config: Any) -> None:
        self.llm, self.fails, self.vllm_config, self.left, self.hit = llm, fails, vllm_config, 0, 0

    def add_request(self, request_id: str, prompt: dict, params: Any) -> None:
        assert params.output_kind.name == "DELTA"
        self.hit = self.llm.cached(prompt["prompt_token_ids"])
        self.left = params.max_tokens

    def has_unfinished_requests(self) -> bool:
        return self.left > 0

    def abort_request(self, request_ids: list[str]) -> None:
        self.left = 0

    def step(self) -> list[Any]:
        if self.fails:
            raise RuntimeError("no stepping here")
        self.left -= 1
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5])], num_cached_tokens=self.hit)]


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.26.0"
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = enum.Enum("RequestOutputKind", "CUMULATIVE DELTA FINAL_ONLY")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)


def test_the_peer_runs_our_prompts_and_reports_our_keys(tmp_path: Path, fake_vllm: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    models.main(["--quick", "--only", "gemma-3-12b", "--write-configs", str(tmp_path)])
    llm = FakeLLM()
    monkeypatch.setattr(peer_measure, "make_llm", lambda *a, **k: llm)
    (record,) = peer_measure.measure(tmp_path / "gemma-3-12b", "measure")
    spec = spec_of(tmp_path / "gemma-3-12b")
    # the batch-1 pair, the warm-up's first 16 (here 4) prompts, then the whole workload, all as written
    assert llm.seen == spec["batch1"]["prompts"] + spec["throughput"]["prompts"] * 2
    (ours,) = models.main(["--quick", "--only", "gemma-3-12b"])
    assert set(ours) <= set(record) and set(ours["kv_per_sequence"]) <= set(record["kv_per_sequence"])
    assert set(record["throughput"]) == set(ours["throughput"])
    tp = record["throughput"]
    assert tp["output_tok_s"] == pytest.approx(4 * 8 / tp["seconds"])
    assert record["batch1_method"] == "token arrival times" and record["batch1_decode_ms_per_token"] > 0
    assert record["engine"] == "vllm 0.26.0" and record["backend"] == "FLASH_ATTN"
    kv = record["kv_per_sequence"]  # the stand-in's two full layers reserve 8 blocks; the context (64) needs 4
    assert kv["allocated_gib"] == pytest.approx(2 * 4 * 64 / 2**30) and kv["context"] == 64
    assert kv["max_len_request_gib"] == pytest.approx(80 * 2 * 64 / 10.0 / 2**30)
    broken = FakeLLM(stream_fails=True)
    broken.collective_rpc = lambda method: {}[0]  # a worker that cannot answer: the KV cell says why
    monkeypatch.setattr(peer_measure, "make_llm", lambda *a, **k: broken)
    (fallback,) = peer_measure.measure(tmp_path / "gemma-3-12b", "measure")
    assert fallback["batch1_method"].startswith("difference of runs (stepping failed: RuntimeError")
    assert fallback["kv_per_sequence"] == {"error": "KeyError: 0"} and fallback["backend"] is None
    assert fallback["throughput"]["output_tok_s"] > 0


def test_the_peer_hybrid_phases(tmp_path: Path, fake_vllm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    hybrid.main(["--quick", "--write-configs", str(tmp_path)])
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(peer_measure, "make_llm",
                        lambda d, e, **k: made.append(k) or FakeLLM(prefix_caching=k["enable_prefix_caching"]))
    plain = peer_measure.measure(tmp_path / "qwen3-next", "plain")
    snap = peer_measure.measure(tmp_path / "qwen3-next", "snapshots")
    assert made == [{"enable_prefix_caching": False}, {"enable_prefix_caching": True}]
    by = {(r["metric"], r.get("snapshots")): r for r in plain + snap}
    assert set(by) == {("batch1_decode", None), ("throughput", None), ("multi_turn_ttft", False),
                       ("multi_turn_ttft", True)}
    ours_keys = {"layers", "device", "gated_delta", "decode_graphs", "metric"}
    assert all(ours_keys <= set(r) for r in by.values())
    assert by[("multi_turn_ttft", False)]["prefix_hit_tokens"] == 0
    # each second turn repeats its first turn's 43 prompt tokens (the stand-in's answer differs from the next turn)
    assert by[("multi_turn_ttft", True)]["prefix_hit_tokens"] >= 2 * 43
    for snapshots in (False, True):  # the warm-up session untimed, then each second turn's TTFT
        turn = by[("multi_turn_ttft", snapshots)]
        assert len(turn["ttft_ms"]) == turn["sessions"] == 2 and turn["warmup_sessions"] == 1
        assert turn["ttft_method"] == "token arrival times"
    monkeypatch.setattr(peer_measure, "make_llm", lambda d, e, **k: FakeLLM(prefix_caching=True, stream_fails=True))
    (*_, fallback) = peer_measure.measure(tmp_path / "qwen3-next", "snapshots")
    assert fallback["ttft_method"].startswith("generate wall time (stepping failed: RuntimeError")
    assert len(fallback["ttft_ms"]) == 2 and fallback["prefix_hit_tokens"] >= 2 * 43
    assert by[("throughput", None)]["num_prompts"] == 4 and by[("batch1_decode", None)]["input_len"] == 24


def test_summary_puts_the_families_side_by_side(tmp_path: Path) -> None:
    kv = {"allocated_gib": 2.3, "context": 32768, "allocated_ratio": 0.19}
    ours = {"model": "gemma-3-12b", "batch1_decode_ms_per_token": 9.79, "kv_per_sequence": kv,
            "throughput": {"num_prompts": 256, "input_len": 1024, "output_len": 1024, "output_tok_s": 4000.0}}
    (tmp_path / "models.jsonl").write_text("a log line\n" + json.dumps(ours) + "\n")
    peer = {**ours, "batch1_decode_ms_per_token": 10.5, "kv_per_sequence": {**kv, "allocated_gib": 4.6,
                                                                            "allocated_ratio": 0.38}}
    failed = {"model": "gpt-oss-20b-mxfp4", "engine": "vllm", "phase": "measure", "error": "exit status 1",
              "cause": "NotImplementedError: No MXFP4 MoE backend | supports it"}
    unknown = {**ours, "model": "gpt-oss-20b", "kv_per_sequence": {"error": "AttributeError: no | kv_cache_config"}}
    (tmp_path / "peer_models.json").write_text(json.dumps([peer, unknown]))
    (tmp_path / "peer_mxfp4.json").write_text(json.dumps([failed]))
    (tmp_path / "hybrid.json").write_text(json.dumps([
        {"layers": 8, "metric": "batch1_decode", "tpot_ms": 5.1, "input_len": 1024, "output_len": 1024},
        {"layers": 8, "metric": "multi_turn_ttft", "snapshots": True, "mean_ttft_ms": 80.0, "turn_len": 8192,
         "prefix_hit_tokens": 50000}]))
    (tmp_path / "peer_hybrid.json").write_text(json.dumps([
        {"layers": 8, "metric": "batch1_decode", "tpot_ms": 6.2, "input_len": 1024, "output_len": 1024},
        {"layers": 8, "phase": "snapshots", "error": "not finished in 200 s"}]))
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in table(tmp_path).splitlines()[2:]}
    assert rows["gemma-3-12b, batch 1: ms per output token"] == ["9.790", "10.500 |"]
    assert rows["gemma-3-12b, throughput: output tok/s"] == ["4,000.0 (256 x 1024 / 1024)",
                                                            "4,000.0 (256 x 1024 / 1024) |"]
    assert rows["gemma-3-12b, KV per sequence (ratio to every layer keeping the context)"] == [
        "2.30 GiB at 32,768 (0.190)", "4.60 GiB at 32,768 (0.380) |"]
    assert rows["gpt-oss-20b-mxfp4, batch 1: ms per output token"] == [
        "-", "not run: NotImplementedError: No MXFP4 MoE backend / supports it |"]
    assert rows["gpt-oss-20b, KV per sequence (ratio to every layer keeping the context)"] == [
        "-", "not measured: AttributeError: no / kv_cache_config |"]
    assert rows["gpt-oss-20b, batch 1: ms per output token"] == ["-", "9.790 |"]
    assert rows["Qwen3-Next shape, 8 layers, batch 1: ms per output token"] == [
        "5.100 (1024 in / 1024 out)", "6.200 (1024 in / 1024 out) |"]
    assert rows["Qwen3-Next shape, 8 layers, the same with prefix caching (state snapshots)"] == [
        "80.0 (50,000 tokens reused)", "not run: not finished in 200 s |"]
    assert rows["Qwen3-Next shape, 8 layers, throughput: output tok/s"] == ["-", "- |"]


def test_the_suite_writes_the_peers_input_before_it_needs_the_kit(tmp_path: Path) -> None:
    """Without .peer/ the part fails with the kit named, after our directories are written (a CPU dry run)."""
    if (ROOT / ".peer").exists():
        pytest.skip("the peer kit is here")
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "peer-mxfp4"], check=False,
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PYTHON": sys.executable,
                            "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and ".peer/run_vllm.sh is missing" in r.stderr
    assert spec_of(tmp_path / "peer_mxfp4_dirs" / "gpt-oss-20b-mxfp4")["model"] == "gpt-oss-20b-mxfp4"


@pytest.mark.parametrize("line, cause", [
    ("(EngineCore_DP0 pid=12) ValueError: bad shape", "ValueError: bad shape"),
    ("[rank0]: torch.OutOfMemoryError: CUDA out of memory", "torch.OutOfMemoryError: CUDA out of memory"),
    ("NotImplementedError: No MXFP4 MoE backend", "NotImplementedError: No MXFP4 MoE backend"),
    ("ERROR 11-28 [core.py:1] EngineCore failed to start.", None),
    ("INFO a line that mentions an Error: in passing", None),
])
def test_the_cause_is_an_exceptions_line(line: str, cause: str | None) -> None:
    match = peer_models.EXCEPTION.search(line)
    assert (match.group(1) if match else None) == cause
