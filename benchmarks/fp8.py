"""FP8 on one GPU, dummy weights: FP8 weights (w8a8_fp8: per-channel e4m3 weights, per-token e4m3 activations) with
an FP8 (e4m3) KV cache against the 16-bit cache.

    python -m benchmarks.fp8                        # every section on the GPU (Llama-3.1-8B, Qwen3-0.6B shapes)
    python -m benchmarks.fp8 --num-prompts 300      # fewer throughput prompts, to fit a time limit
    python -m benchmarks.fp8 --sections capacity,qwen3 --output-json fp8.json
    python -m benchmarks.fp8 --quick                # a tiny model on the CPU (the test of this script)

Sections:
- throughput: Llama-3.1-8B, FP8 weights + FP8 KV, N x 1024 in / 1024 out, ignore_eos: output tokens/s.
- batch1: the same engine, one request of 1024 in / 256 out alone: ms per output token.
- capacity: KV blocks at the same gpu_memory_utilization, FP8 KV against the 16-bit KV (same FP8 weights).
- gemv: Llama-3.1-8B's projections at one row: the Triton FP8 GEMV (the decode-batch path of scaled_linear;
  `triton_gemv`, x quantized by act_quant.py's launch first) against the activation quantization + cuBLASLt
  scaled GEMM it replaces, and the 16-bit GEMV on the same weight in bf16 (twice the bytes), microseconds each
  (--quick: the torch reference on tiny shapes).
- producers: the residual add + RMSNorm and SiLU-and-mul at one row writing e4m3 in their own launch (what an FP8
  linear with per-token scales reads at decode) against the 16-bit op and act_quant.py's launch, microseconds.
- qwen3: Qwen3-0.6B shape, 256 requests of input and output lengths uniform in [100, 1024], FP8 KV against 16-bit
  KV (16-bit weights): output tokens/s of each and the ratio.
Prints one JSON object per section and, with --output-json, writes them all.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from appliance.bench.floor import weight_read_floor
from appliance.bench.presets import SHAPES

SECTIONS = ("throughput", "batch1", "capacity", "gemv", "producers", "qwen3")
TINY = {  # --quick: a tiny Llama shape, CPU
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--num-prompts", type=int, default=1000, help="throughput section's requests")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--quick", action="store_true", help="a tiny model on the CPU, a few requests")
    p.add_argument("--output-json")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown or args.num_prompts < 1:
        p.error(f"unknown sections {sorted(unknown)}" if unknown else "--num-prompts must be >= 1")
    return args


class Bench:
    """The shapes and engine settings of a run: the real ones, or --quick's tiny CPU stand-ins."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.quick, self.tmp, self.util = args.quick, tmp, args.gpu_memory_utilization
        scale = 1 / 64 if args.quick else 1.0  # --quick: lengths / 64 (1024 -> 16)
        self.n = 8 if args.quick else args.num_prompts
        self.length = lambda n: max(2, int(n * scale))

    def engine(self, preset: str, **kw: Any) -> Any:
        from appliance import LLM

        cfg = TINY if self.quick else SHAPES[preset]
        path = self.tmp / preset
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps(cfg))
        device = {"device": "cpu", "dtype": "bfloat16", "max_total_tokens": 4096} if self.quick else {
            "gpu_memory_utilization": self.util}
        return LLM(model=str(path), load_format="dummy", skip_tokenizer_init=True, seed=0, **device, **kw)


def _release() -> None:
    """After the caller dropped its engine: collect it (its KV cache goes with its runner) and return the memory."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate(llm: Any, in_lens: list[int], out_lens: list[int], seed: int = 0) -> dict[str, float]:
    """Random-token prompts, ignore_eos: every request produces exactly its output length."""
    from appliance import SamplingParams

    rng = random.Random(seed)
    vocab = int(llm.executor.hf_config.vocab_size)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]} for n in in_lens]
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in out_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(outs), "output_tokens": n_out, "elapsed_s": elapsed, "output_tok_s": n_out / elapsed,
            "preemptions": llm.engine.scheduler.num_preemptions}


def batch1(llm: Any, input_len: int, output_len: int) -> dict[str, float]:
    """One request alone: the mean wall time of its decode steps (each returns its token to the host), and how
    that compares with the time to read the weights once (appliance/bench/floor.py)."""
    from appliance import SamplingParams

    engine = llm.engine
    engine.add_request(f"batch1-{time.monotonic_ns()}", [3] * input_len,
                       SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True))
    times = []
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    ms = sum(times[1:]) / max(1, len(times) - 1) * 1e3  # the first step is the prefill
    return {"ms_per_token": ms, **weight_read_floor(llm, ms, 1 << 24 if llm.executor.runner.device.type == "cpu"
                                                    else 1 << 30)}


def _gemv_paths(x: Any, wq: Any, scale: Any, quick: bool) -> dict[str, Any]:
    """The ways one row goes through an e4m3 weight: the reference (--quick), else the Triton GEMV and the
    activation quantization + torch._scaled_mm (cuBLASLt) it replaces at small M."""
    import torch

    from appliance.kernels.fp8_gemm import fp8_gemv

    if quick:
        return {"reference": lambda: fp8_gemv(x, wq, scale, None)}
    from appliance.kernels.triton.act_quant import quant_act
    from appliance.kernels.triton.fp8_gemv import fp8_gemv as triton_fp8_gemv

    def cublas() -> torch.Tensor:
        xq, xs = quant_act(x, None)
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=scale.reshape(1, -1), out_dtype=x.dtype)

    from appliance.kernels.triton.gemv import gemv

    w16 = (wq.to(x.dtype) * scale[:, None].to(x.dtype)).contiguous()
    return {"triton_gemv": lambda: triton_fp8_gemv(x, wq, scale, None),
            "cublaslt": cublas, "bf16_weight_gemv": lambda: gemv(x, w16)}


def gemv_times(quick: bool) -> dict[str, Any]:
    """Per projection shape, one row through each path: microseconds per call (on a GPU triton's
    do_bench_cudagraph: Python's launch of a Triton kernel costs tens of microseconds, as much as these kernels
    take, and a plain do_bench timed that)."""
    import torch

    from appliance.kernels.fp8_gemm import FP8, FP8_MAX

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    if quick:
        shapes = {name: (n // 64, k // 64) for name, (n, k) in shapes.items()}
    device = "cpu" if quick else "cuda"
    row: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device) * 0.02
        scale = w.abs().amax(dim=1) / FP8_MAX
        wq, x = (w / scale[:, None]).to(FP8), torch.randn(1, k, device=device, dtype=torch.bfloat16)
        for path, fn in _gemv_paths(x, wq, scale, quick).items():
            row[f"{name}_{path}_us"] = _micros(fn, quick)
    return row


def _micros(fn: Any, quick: bool) -> float:
    """Microseconds per call: on a GPU replayed from a CUDA graph, as decode steps run (the launches' host cost is
    not timed); --quick: ten calls on the CPU."""
    if quick:
        t = time.perf_counter()
        for _ in range(10):
            fn()
        return (time.perf_counter() - t) / 10 * 1e6
    from triton.testing import do_bench_cudagraph

    fn()  # compiled before the capture
    return do_bench_cudagraph(fn, rep=200) * 1e3


def producer_times(quick: bool) -> dict[str, Any]:
    """Llama-3.1-8B's producers of an FP8 linear's input at one row: the residual add + RMSNorm and SiLU-and-mul
    writing e4m3 in their own launch (rms_norm_quant, silu_and_mul_quant) against the 16-bit op followed by
    act_quant.py's launch, microseconds each (--quick: the torch references on tiny shapes)."""
    import torch

    from appliance.kernels import registry

    backend, device = ("torch", "cpu") if quick else ("triton", "cuda")
    hidden, inter = (64, 224) if quick else (4096, 14336)
    bf = {"device": device, "dtype": torch.bfloat16}
    x, res, w = torch.randn(1, hidden, **bf), torch.randn(1, hidden, **bf), torch.rand(hidden, **bf) + 0.5
    gate_up = torch.randn(1, 2 * inter, **bf)
    op = {name: registry.get(name, backend) for name in ("rms_norm", "rms_norm_quant", "silu_and_mul",
                                                          "silu_and_mul_quant", "fp8_quant_act")}
    paths = {"norm_then_quant_act": lambda: op["fp8_quant_act"](op["rms_norm"](x, w, 1e-6, res)[0], None),
             "rms_norm_quant": lambda: op["rms_norm_quant"](x, w, 1e-6, res),
             "silu_then_quant_act": lambda: op["fp8_quant_act"](op["silu_and_mul"](gate_up), None),
             "silu_and_mul_quant": lambda: op["silu_and_mul_quant"](gate_up)}
    return {"hidden": hidden, "intermediate": inter, **{f"{k}_us": _micros(fn, quick) for k, fn in paths.items()}}


def run(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse_args(argv)
    sections = args.sections.split(",")
    results: dict[str, dict[str, Any]] = {}

    def report(name: str, row: dict[str, Any]) -> None:
        results[name] = row
        print(json.dumps({"section": name, **row}), flush=True)
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(results, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        b = Bench(args, Path(tmp))
        fp8 = {"quantization": "w8a8_fp8", "kv_cache_dtype": "fp8"}
        if {"throughput", "batch1", "capacity"} & set(sections):
            llm = b.engine("llama-3.1-8b", **fp8)
            blocks_fp8 = llm.engine.config.num_blocks
            if "throughput" in sections:
                n, length = b.n, b.length(1024)
                report("throughput", {"model": "llama-3.1-8b", **fp8, "input_len": length, "output_len": length,
                                      **generate(llm, [length] * n, [length] * n)})
            if "batch1" in sections:
                report("batch1", {"model": "llama-3.1-8b", **fp8, "input_len": b.length(1024),
                                  "output_len": b.length(256), **batch1(llm, b.length(1024), b.length(256))})
            bytes_fp8 = llm.executor.runner.kv_spec.bytes_per_block
            del llm
            _release()
            if "capacity" in sections:
                llm = b.engine("llama-3.1-8b", quantization="w8a8_fp8")
                blocks_16, bytes_16 = llm.engine.config.num_blocks, llm.executor.runner.kv_spec.bytes_per_block
                del llm
                _release()
                report("capacity", {"model": "llama-3.1-8b", "gpu_memory_utilization": b.util,
                                    "blocks_fp8": blocks_fp8, "blocks_16bit": blocks_16,
                                    "blocks_ratio": blocks_fp8 / blocks_16, "bytes_per_block_fp8": bytes_fp8,
                                    "bytes_per_block_16bit": bytes_16})
        if "gemv" in sections:
            report("gemv", {"rows": 1, **gemv_times(b.quick)})
        if "producers" in sections:
            report("producers", {"rows": 1, **producer_times(b.quick)})
        if "qwen3" in sections:
            rng = random.Random(0)
            lo, hi = b.length(100), b.length(1024)
            n = 16 if b.quick else 256
            in_lens, out_lens = ([rng.randint(lo, hi) for _ in range(n)] for _ in range(2))
            row: dict[str, Any] = {"model": "qwen3-0.6b", "requests": n, "lengths": [lo, hi]}
            for kv in ("auto", "fp8"):
                llm = b.engine("qwen3-0.6b", kv_cache_dtype=kv)
                row[f"output_tok_s_{kv}"] = generate(llm, in_lens, out_lens)["output_tok_s"]
                row[f"blocks_{kv}"] = llm.engine.config.num_blocks
                del llm
                _release()
            row["fp8_over_16bit"] = row["output_tok_s_fp8"] / row["output_tok_s_auto"]
            report("qwen3", row)
    return results


if __name__ == "__main__":
    run()
