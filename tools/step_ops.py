"""Count what one decode step launches, per decoder layer and per step, on the CPU: torch ops (aten calls that
compute: views and allocations left out) and Triton kernel launches (under Triton's interpreter), for a preset's
layer structure at a tiny size. Launch counts do not depend on the size, so they stand for the GPU's.

    python -m tools.step_ops                       # gemma-3-12b and llama-3.1-8b, triton backend
    python -m tools.step_ops --model gemma-3-12b --backend torch --json

Per model: a decode step of --batch requests (contexts past the sliding window), counted three ways: one decoder
layer (the second; a Gemma layer ends in the next layer's input norm), the forward, and the whole step
(`ModelRunner.launch` + `finish`: inputs, forward, LM head, sampling). Each count lists its ops by name.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's first import; this process is the tool's

import argparse
import json
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# a tiny size of each family's layer structure: six layers (Gemma: five sliding to one global)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "query_pre_attn_scalar": 16,
        "sliding_window": 8, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "max_position_embeddings": 4096, "torch_dtype": "float32", "bos_token_id": 2, "eos_token_id": 1,
        "pad_token_id": 0}
# aten ops that launch nothing on a GPU (views, metadata, allocations)
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "slice", "select", "t", "transpose", "expand", "as_strided",
             "split", "split_with_sizes", "chunk", "unsqueeze", "squeeze", "permute", "detach", "alias", "empty",
             "empty_like", "empty_strided", "narrow", "unbind", "lift_fresh", "_to_copy_noop", "set_", "resize_",
             "is_nonzero", "_local_scalar_dense", "item", "sym_size", "sym_stride", "dim", "size", "stride",
             "_reshape_alias", "new_empty", "new_empty_strided", "flatten", "unflatten", "view_as", "promote_types",
             "resolve_conj", "resolve_neg", "detach_", "expand_as"}


class Counts:
    """Launches seen while counting is on: aten ops by name ("aten.<op>") and Triton kernels ("triton.<name>")."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.on = False
        self.in_triton = 0  # the interpreter's own tensor work inside a launch is not a launch

    def total(self) -> int:
        return sum(self.ops.values())


class _AtenCounter(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # an op that hands back its input unchanged (a `to` to the dtype it has) launches nothing
        same = bool(args) and out is args[0] and not name.endswith("_")
        if self.counts.on and not self.counts.in_triton and name not in NO_LAUNCH and not same:
            self.counts.ops[f"aten.{name}"] += 1
        return out


@contextmanager
def counting(counts: Counts) -> Iterator[None]:
    """Count aten ops and interpreted Triton launches inside the block (while counts.on)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if counts.on and not counts.in_triton:
            counts.ops[f"triton.{self.fn.__name__}"] += 1
        counts.in_triton += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counts.in_triton -= 1

    InterpretedFunction.run = counted_run  # type: ignore[method-assign]
    try:
        with _AtenCounter(counts):
            yield
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]


def model_dir(name: str, out: Path) -> Path:
    from appliance.bench.presets import write_model_dir

    path = write_model_dir(name, out / name)
    config = json.loads((path / "config.json").read_text())
    config.update({k: v for k, v in TINY.items() if k in config or k == "torch_dtype"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def measure(name: str, backend: str, batch: int, workdir: Path) -> dict[str, Any]:
    """Counts of one decode step of `batch` requests: one layer, the forward, the whole step."""
    from appliance import LLM, SamplingParams

    llm = LLM(model=str(model_dir(name, workdir)), load_format="dummy", skip_tokenizer_init=True, device="cpu",
              dtype="float32", attention_backend=backend, max_model_len=256, max_num_seqs=batch,
              enable_prefix_caching=False)
    runner = llm.executor.runner
    layer, forward, step = Counts(), Counts(), Counts()
    model = runner.model.model
    target = model.layers[1]
    target.register_forward_pre_hook(lambda *_: setattr(layer, "on", decoding[0]))
    target.register_forward_hook(lambda *_: setattr(layer, "on", False))
    model.register_forward_pre_hook(lambda *_: setattr(forward, "on", decoding[0]))
    model.register_forward_hook(lambda *_: setattr(forward, "on", False))
    decoding = [False]
    launch, finish = runner.launch, runner.finish

    def counted_launch(plan: Any) -> Any:
        # the last step of the generate below: every request decodes its last token
        decoding[0] = step.on = all(s.num_tokens == 1 for s in plan.scheduled) and not plan.new_requests
        if decoding[0]:
            for c in (layer, forward, step):
                c.ops.clear()
        return launch(plan)

    def counted_finish(handle: Any) -> Any:
        try:
            return finish(handle)
        finally:
            step.on = False

    runner.launch, runner.finish = counted_launch, counted_finish  # type: ignore[method-assign]
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 400 for j in range(20 + i)]} for i in range(batch)]
    with counting(layer), counting(forward), counting(step):
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    llm.shutdown()
    return {"model": name, "backend": backend, "batch": batch,
            **{k: {"total": c.total(), "ops": dict(sorted(c.ops.items()))}
               for k, c in (("layer", layer), ("forward", forward), ("step", step))}}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="a preset (repeatable); default gemma-3-12b, llama-3.1-8b")
    p.add_argument("--backend", default="triton", choices=("triton", "torch"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--json", action="store_true", help="one JSON line per model instead of the table")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.model or ["gemma-3-12b", "llama-3.1-8b"]:
            rows.append(measure(name, args.backend, args.batch, Path(tmp)))
    for r in rows:
        if args.json:
            print(json.dumps(r))
            continue
        print(f"{r['model']} ({r['backend']}, decode batch {r['batch']}): layer {r['layer']['total']}, "
              f"forward {r['forward']['total']}, step {r['step']['total']} launches")
        for part in ("layer", "step"):
            print(f"  {part}: " + ", ".join(f"{k} x{v}" for k, v in r[part]["ops"].items()))
    return rows


if __name__ == "__main__":
    main()
