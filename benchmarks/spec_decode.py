"""Speculative decoding against plain decoding of the same build, in one process.

    python -m benchmarks.spec_decode                 # Llama-3.1-8B shape, dummy weights, one GPU (~5 min)
    python -m benchmarks.spec_decode --quick         # tiny shapes on the CPU (a smoke test)
    python -m benchmarks.spec_decode --output-json results.json
    python -m benchmarks.spec_decode --eagle-only   # plain and EAGLE-3 only (the targets' first three rows)

Runs (dummy weights: drafts are never right, so the EAGLE-3 runs force the accept decision with
speculative.synthetic_acceptance_length; the drafter and the verify forward still run):
- EAGLE-3 (a one-layer head of the published layout, 32k draft vocabulary), 3 draft tokens, batch 1,
  1024 in / 256 out, forced acceptance length 2.6 and 1 (every draft rejected), each against plain decoding;
  the chain runs with scheduler.enable_overlap on (plain decoding has it on by default);
- the same at batch 32 with 2.6;
- an EAGLE-3 draft tree (eagle_topk 4, num_steps 3, num_draft_tokens 8: the best 7 of the search's candidates),
  forced acceptance length 2.6 along its longest path, batch 1 and 32 (trees run eagerly, without overlap);
- n-gram prompt lookup on a synthetic code-editing workload (a source file, then a request to repeat it with one
  change: outputs copy spans of the prompt), real acceptance: on the embedded default model (trained weights,
  so the acceptance is a model's), and on the 8B shape (dummy weights: their outputs repeat, so that acceptance
  only shows the cost of verification at this size), with the lookup on the host and on the device.
Each run first generates a few tokens of its prompts (first uses, and the prompts into the prefix cache), so the
timed call is the decode: the targets compare decode speed. Prints output tok/s, ms per output token (wall time
of the generate call over the tokens each request produced), mean acceptance length and the speed-up over plain
decoding. Verify steps, the drafter's catch-up and draft chains replay CUDA graphs (executor/verify_graphs.py,
catch_up_graphs.py, draft_graphs.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from appliance import LLM, SamplingParams
from appliance.bench.presets import SHAPES
from appliance.config import resolve_model_path

GROUPS = ("plain", "eagle", "code", "tree", "ngram")  # engines of plain decoding, EAGLE-3 chains, the default model
# (plain and n-gram, trained weights), EAGLE-3 trees, n-gram on dummy weights (host and device lookup)
EAGLE3_LLAMA_8B = {  # the published Llama-3.1-8B EAGLE-3 heads' shape
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "draft_vocab_size": 32000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1}
CODE = '''def parse_config(path):
    """Read a key = value file into a dict, skipping comments."""
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def merge(base, override):
    out = dict(base)
    for key, value in override.items():
        out[key] = value
    return out
'''


@dataclass
class Run:
    name: str
    batch: int
    output_tokens: int
    seconds: float
    mean_acceptance_length: float | None = None
    baseline: str | None = None
    speedup: float | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.seconds / (self.output_tokens / self.batch)


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def timed(llm: LLM, prompts: list[Any], params: SamplingParams) -> tuple[float, int, float | None]:
    """Seconds of one generate call, the tokens it produced, and the mean acceptance length of its verifications."""
    before = llm.engine.stats()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    after = llm.engine.stats()
    n = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), (1 + accepted / n) if n else None


def release() -> None:
    """After the caller shut its engine down and dropped every name for it: collect it and return its memory.
    (A name still bound to the engine, or to anything of its runner's, keeps the weights and the KV cache.)"""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            held = torch.cuda.memory_allocated() / 2**30
            print(f"released: {held:.2f} GiB still allocated", flush=True)
            if held > 1.0:
                print_holders()
    except ImportError:
        pass


def print_holders() -> None:
    """What keeps an engine's memory after its release: the live models (nn.Modules with no parent left) and the
    types of what refers to each."""
    from torch import nn

    modules = [o for o in gc.get_objects() if isinstance(o, nn.Module)]
    children = {id(c) for m in modules for c in m.children()}
    for m in (m for m in modules if id(m) not in children):
        size = sum(p.numel() * p.element_size() for p in m.parameters()) / 2**30
        if size > 0.1:
            holders = sorted({type(r).__qualname__ for r in gc.get_referrers(m)} - {"list"})
            print(f"  held: {type(m).__qualname__} ({size:.2f} GiB of parameters), referred to by {holders}", flush=True)


def guarded(what: str, build: Callable[[], LLM], body: Callable[[LLM], None]) -> None:
    """Build an engine, run its measurements, shut it down and release it. A failure is printed and the next
    engine runs: one engine's error (or its memory) does not cost the rows after it."""
    llm = None
    try:
        llm = build()
        body(llm)
    except Exception:  # noqa: BLE001 - reported, and the remaining runs go on
        traceback.print_exc()
        print(f"{what}: failed (traceback above); the remaining runs go on", flush=True)
    finally:
        if llm is not None:
            llm.shutdown()
        llm = None
        release()


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(batch)]


def code_edit_text() -> str:
    return (f"Here is a Python file:\n\n{CODE}\nRewrite the file with `settings` renamed to `options`. Keep "
            f"everything else as it is.\n\n{CODE[:120]}")


def main(argv: list[str] | None = None) -> list[Run]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    p.add_argument("--output-json", help="write the runs here")
    p.add_argument("--eagle-only", action="store_true",
                   help="plain and EAGLE-3 runs only (the n-gram runs load three more models)")
    p.add_argument("--only", action="append", choices=GROUPS,
                   help="run these groups of engines in this process (default on a GPU: each group in a process of "
                        "its own, since an engine's GPU memory is only certainly back when its process ends)")
    a = p.parse_args(argv)
    groups = [g for g in GROUPS if not a.eagle_only or g in ("plain", "eagle")]
    if a.only is None and not a.quick:
        return in_processes(groups, a.output_json)
    groups = a.only or groups
    quick = a.quick
    input_len, output_len, big_batch = (32, 8, 4) if quick else (1024, 256, 32)
    work = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    target_cfg = TINY if quick else SHAPES["llama-3.1-8b"]
    head_cfg = ({**EAGLE3_LLAMA_8B, **{k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                          "num_key_value_heads", "vocab_size")},
                 "draft_vocab_size": 128, "torch_dtype": "float32"} if quick else EAGLE3_LLAMA_8B)
    target = write_config(work / "target", target_cfg)
    head = write_config(work / "eagle3", head_cfg)
    vocab = int(target_cfg["vocab_size"])
    common: dict[str, Any] = {"load_format": "dummy", "skip_tokenizer_init": True, "max_model_len": 2048,
                              "max_num_seqs": big_batch, "enable_prefix_caching": True}
    common.update({"device": "cpu", "dtype": "float32", "max_total_tokens": 8192} if quick else
                  {"gpu_memory_utilization": 0.85})
    one = random_prompts(1, input_len, vocab, 0)
    many = random_prompts(big_batch, input_len, vocab, 1)
    code_ids = [{"prompt_token_ids": ([5 + i % (vocab - 8) for i in range(input_len // 2)] * 2)}]
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs: list[Run] = []

    def measure(llm: LLM, name: str, prompts: list[Any], baseline: str | None = None) -> Run:
        # first uses outside the timing, and every prompt into the prefix cache: the timed call is the decode
        llm.generate(prompts, warm, use_tqdm=False)
        seconds, tokens, mal = timed(llm, prompts, greedy)
        return record(runs, Run(name, len(prompts), tokens, seconds, mal, baseline))

    def plain_runs(llm: LLM) -> None:
        measure(llm, "plain b1", one)
        measure(llm, f"plain b{big_batch}", many)
        measure(llm, "plain code-edit b1", code_ids)

    def eagle_runs(llm: LLM) -> None:
        measure(llm, "eagle3 acc2.6 b1", one, "plain b1")
        measure(llm, f"eagle3 acc2.6 b{big_batch}", many, f"plain b{big_batch}")
        spec = llm.executor.runner.spec
        assert spec is not None and spec.forced is not None
        spec.forced.length = 1.0  # the same engine, every draft rejected (the decision is all that changes)
        measure(llm, "eagle3 acc1 b1", one, "plain b1")

    def tree_runs(llm: LLM) -> None:
        measure(llm, "eagle3 tree k4 n8 acc2.6 b1", one, "plain b1")
        measure(llm, f"eagle3 tree k4 n8 acc2.6 b{big_batch}", many, f"plain b{big_batch}")

    eagle3 = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head), "speculative_num_steps": 3,
              "speculative_enable_synthetic_acceptance": True, "speculative_synthetic_acceptance_length": 2.6}
    if "plain" in groups:
        guarded("plain", lambda: LLM(model=str(target), **common), plain_runs)
    if "eagle" in groups:  # chains run with overlap on, as plain decoding does by default (trees refuse it)
        guarded("eagle3", lambda: LLM(model=str(target), **eagle3, enable_overlap_schedule=True, **common),
                eagle_runs)
    if "code" in groups:  # the real-acceptance n-gram rows before the extras, should a time limit cut the run
        code_runs(runs, quick, output_len)
    if "tree" in groups:  # top 4 per step over 3 steps, the best 7 nodes verified with the root (eager)
        guarded("eagle3 tree", lambda: LLM(model=str(target), **eagle3, speculative_eagle_topk=4,
                                           speculative_num_draft_tokens=8, **common), tree_runs)
    for proposer, name in (("host", "ngram code-edit b1 (dummy weights)"),
                           ("device", "ngram on the device code-edit b1 (dummy weights)"))[: 2 * ("ngram" in groups)]:
        guarded(name, lambda p=proposer: LLM(model=str(target), speculative_algorithm="NGRAM", speculative_num_steps=3,
                                             speculative_ngram_proposer=p, **common),
                lambda llm, n=name: measure(llm, n, code_ids, "plain code-edit b1"))
    return finish(runs, a.output_json)


def finish(runs: list[Run], output_json: str | None) -> list[Run]:
    """Speed-ups against each run's baseline (where it ran), the table, and the JSON."""
    for r in runs:
        base = next((b for b in runs if b.name == r.baseline), None)
        r.speedup = r.tok_s / base.tok_s if base is not None else None
    print_table(runs)
    if output_json:
        Path(output_json).write_text(json.dumps([{**asdict(r), "tok_s": r.tok_s, "ms_per_token": r.ms_per_token}
                                                 for r in runs], indent=1))
    return runs


def in_processes(groups: list[str], output_json: str | None) -> list[Run]:
    """Each group of engines in a process of its own (this module with --only); their runs in one table."""
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        for g in groups:
            out = Path(tmp) / f"{g}.json"
            rc = subprocess.run([sys.executable, "-m", "benchmarks.spec_decode", "--only", g, "--output-json",
                                 str(out)], check=False).returncode
            if rc != 0 or not out.exists():
                print(f"group {g}: exit status {rc}; the remaining groups go on", flush=True)
                continue
            fields = {f.name for f in dataclass_fields(Run)}
            runs += [Run(**{k: v for k, v in row.items() if k in fields}) for row in json.loads(out.read_text())]
    return finish(runs, output_json)


def code_runs(runs: list[Run], quick: bool, output_len: int) -> None:
    """N-gram on the embedded default model (trained weights): real acceptance on the code-editing prompt."""
    kw: dict[str, Any] = {"model": resolve_model_path(None), "max_model_len": 1024}
    kw.update({"device": "cpu", "dtype": "float32", "max_total_tokens": 4096} if quick else
              {"gpu_memory_utilization": 0.3})
    prompt = [code_edit_text()]
    params = SamplingParams(temperature=0.0, max_tokens=min(output_len, 200), ignore_eos=True)

    def one_run(name: str, baseline: str | None) -> Callable[[LLM], None]:
        def body(llm: LLM) -> None:
            llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
            seconds, tokens, mal = timed(llm, prompt, params)
            record(runs, Run(name, 1, tokens, seconds, mal, baseline))
        return body

    guarded("plain code-edit default model", lambda: LLM(**kw), one_run("plain code-edit default model", None))
    guarded("ngram code-edit default model",
            lambda: LLM(**kw, speculative_algorithm="NGRAM", speculative_num_steps=3),
            one_run("ngram code-edit default model", "plain code-edit default model"))


def record(runs: list[Run], run: Run) -> Run:
    """The run, its speed-up over its baseline where that ran, added to the runs and printed."""
    base = next((r for r in runs if r.name == run.baseline), None)
    if base is not None:
        run.speedup = run.tok_s / base.tok_s
    runs.append(run)
    print(report_line(run), flush=True)
    return run


def report_line(r: Run) -> str:
    mal = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "-"
    ratio = f"{r.speedup:.2f}x vs {r.baseline}" if r.speedup is not None else ""
    return (f"{r.name:40s} batch {r.batch:3d}  {r.tok_s:9.1f} tok/s  {r.ms_per_token:8.2f} ms/token  "
            f"accept len {mal:>5s}  {ratio}")


def print_table(runs: list[Run]) -> None:
    print("\n| run | batch | tok/s | ms/token | mean acceptance length | speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in runs:
        mal = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "-"
        ratio = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        print(f"| {r.name} | {r.batch} | {r.tok_s:.1f} | {r.ms_per_token:.2f} | {mal} | {ratio} |")


if __name__ == "__main__":
    main()
