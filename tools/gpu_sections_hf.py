"""The `hf` section of tools/bench_gpu.py: transformers' own continuous batching (`model.generate_batch`) on the
same GPU in the same run, random weights (`from_config`), bf16:
  (a) the Llama-3.1-8B shape, batch 1, a 1024-token prompt, --hf-out tokens: ms per output token (the mean gap
      between the token timestamps generate_batch records, i.e. decode steps only)
  (b) the Qwen3-0.6B shape, the first --hf-seqs sequences of the qwen section's 256-sequence [100, 1024] workload
      (same seed, same prompts): output tok/s from the first request's creation to the last token (the manager's
      set-up and warm-up excluded; the wall time of the whole call is recorded too)
generate_batch takes one max_new_tokens for the batch, so (b) generates the subset's mean output length for every
sequence (the JSON says which). Sampling: temperature 1.0, top_p 1.0, top_k off, EOS off (eos_token_id -1).
If generate_batch fails, plain `generate` on a padded batch is timed instead and the JSON says so ("api").
bench_gpu's table gives the speed-up appliance / transformers from the same run's llama and qwen sections.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any


def _model(cfg: dict[str, Any], device: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                       if k not in ("model_type", "architectures", "torch_dtype")})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    return model.eval()


def _smoke_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same architecture (rope scaling, tied embeddings, head_dim) at a CPU-sized width, depth and vocab."""
    small = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 4096, "bos_token_id": 1, "eos_token_id": 2}
    return {**cfg, **small, **({"head_dim": 64} if "head_dim" in cfg else {})}


def _gen_config(max_new: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                            eos_token_id=-1)


def _generate_batch(model: Any, inputs: list[list[int]], max_new: int) -> dict[str, Any]:
    """generate_batch with per-token timestamps: decode ms per token (mean and median gap), tokens, span."""
    t = time.perf_counter()
    outs = list(model.generate_batch(inputs=inputs, generation_config=_gen_config(max_new), record_timestamps=True,
                                     progress_bar=False).values())
    wall = time.perf_counter() - t
    errors = [o.error for o in outs if o.error]
    if len(outs) != len(inputs) or errors:
        raise RuntimeError(f"generate_batch returned {len(outs)} of {len(inputs)} results; errors: {errors[:3]}")
    tokens = sum(len(o.generated_tokens) for o in outs)
    gaps = [b - a for o in outs for a, b in zip(o.timestamps, o.timestamps[1:])]
    span = max(o.timestamps[-1] for o in outs) - min(o.created_time for o in outs)
    return {"api": "generate_batch", "wall_s": round(wall, 2), "output_tokens": tokens,
            "span_s": round(span, 2), "output_tok_s": round(tokens / span, 1),
            "output_tok_s_wall": round(tokens / wall, 1),
            "ttft_ms": round(statistics.mean(o.timestamps[0] - o.created_time for o in outs) * 1e3, 2),
            "tpot_ms": round(statistics.mean(gaps) * 1e3, 3) if gaps else None,
            "tpot_p50_ms": round(statistics.median(gaps) * 1e3, 3) if gaps else None,
            "attn_implementation": getattr(model.config, "_attn_implementation", None)}


def _generate(model: Any, inputs: list[list[int]], max_new: int) -> dict[str, Any]:
    """The fallback: plain generate on a left-padded batch, timed at 1 and at max_new new tokens (the difference is
    the decode steps)."""
    import torch

    width = max(len(x) for x in inputs)
    dev = next(model.parameters()).device
    ids = torch.tensor([[0] * (width - len(x)) + x for x in inputs], device=dev)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in inputs], device=dev)

    def timed(n: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=_gen_config(n), pad_token_id=0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    first, whole = timed(1), timed(max_new)
    tokens = len(inputs) * max_new
    return {"api": "generate (padded batch; generate_batch failed)", "wall_s": round(whole, 2),
            "output_tokens": tokens, "output_tok_s": round(tokens / whole, 1), "ttft_ms": round(first * 1e3, 2),
            "tpot_ms": round((whole - first) / max(max_new - 1, 1) * 1e3, 3)}


def _run(model: Any, inputs: list[list[int]], max_new: int) -> dict[str, Any]:
    try:
        return _generate_batch(model, inputs, max_new)
    except Exception as exc:  # noqa: BLE001 - any failure of generate_batch on the box: time generate instead
        print(f"  generate_batch failed ({type(exc).__name__}: {exc}); falling back to generate", flush=True)
        res = _generate(model, inputs, max_new)
        res["generate_batch_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return res


def _free(model: Any) -> None:
    import torch

    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section_hf(rec: Any, args: argparse.Namespace) -> None:
    import torch
    import transformers
    from bench_offline import PRESETS
    from gpu_measure import qwen_workload

    shape = _smoke_shape if args.smoke else dict
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    k = 16 if args.smoke else 1
    deadline = time.monotonic() + args.section_budget
    rec["transformers"] = transformers.__version__
    reduced = []
    # (a) Llama-3.1-8B shape, batch 1
    cfg = shape(PRESETS["llama-3.1-8b"])
    out_n = max(4, args.hf_out // k)
    if out_n != 256 // k:
        reduced.append(f"8B batch 1: {out_n} output tokens (the appliance's figure: 256)")
    t = time.perf_counter()
    model = _model(cfg, dev)
    rec["llama_init_s"] = round(time.perf_counter() - t, 1)
    rng = random.Random(2)
    rec["llama_b1"] = {"prompt": 1024 // k, "out": out_n,
                       **_run(model, [[rng.randrange(cfg["vocab_size"]) for _ in range(1024 // k)]], out_n)}
    _free(model)
    # (b) Qwen3-0.6B shape, a subset of the qwen section's workload (same seed and draw order)
    left = deadline - time.monotonic()
    if left < 30:
        rec["qwen_subset"] = f"skipped ({left:.0f} s left)"
        rec["reduced"] = reduced
        return
    cfg = shape(PRESETS["qwen3-0.6b"])
    n = 256 // k
    prompts, out_lens = qwen_workload(cfg["vocab_size"], n, k)
    s = max(1, min(args.hf_seqs // (4 if args.smoke else 1), n))
    out_mean = round(statistics.mean(out_lens[:s]))
    reduced.append(f"Qwen3-0.6B: the first {s} of {n} sequences, each {out_mean} output tokens (their mean; "
                   f"generate_batch takes one max_new_tokens)")
    model = _model(cfg, dev)
    rec["qwen_subset"] = {"sequences": s, "of": n, "out_each": out_mean, **_run(model, prompts[:s], out_mean)}
    _free(model)
    rec["reduced"] = reduced  # the Recorder prints it


def ratios(hf: dict[str, Any], llama: dict[str, Any], qwen: dict[str, Any]) -> dict[str, Any]:
    """Speed-up appliance / transformers from one run (None where either side did not run): batch-1 time per
    token (transformers ms / appliance ms) and throughput (appliance tok/s / transformers tok/s). The appliance's
    Qwen figure is over all 256 sequences with their own output lengths, transformers' over its subset."""
    def get(d: Any, *keys: str) -> Any:
        for key in keys:
            d = d.get(key) if isinstance(d, dict) else None
        return d

    hf_ms, app_ms = get(hf, "llama_b1", "tpot_ms"), get(llama, "b1_graphs", "tpot_ms")
    hf_tps, app_tps = get(hf, "qwen_subset", "output_tok_s"), get(qwen, "tput_graphs", "output_tok_s")
    return {"b1_ms_per_token": round(hf_ms / app_ms, 2) if hf_ms and app_ms else None,
            "qwen_tok_s": round(app_tps / hf_tps, 2) if hf_tps and app_tps else None}


def table_rows(hf: dict[str, Any], llama: dict[str, Any], qwen: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    if not hf:
        return []
    r = ratios(hf, llama, qwen)
    b1, q = hf.get("llama_b1"), hf.get("qwen_subset")
    api = b1.get("api") if isinstance(b1, dict) else "-"
    rows = [(f"transformers {hf.get('transformers', '?')} ({api}): Llama-3.1-8B b1 ms per token",
             str(b1.get("tpot_ms")) if isinstance(b1, dict) else hf.get("status", "-"),
             f"appliance = {r['b1_ms_per_token']}x its speed" if r["b1_ms_per_token"] else "", "vLLM box: 41.4 ms")]
    if isinstance(q, dict):
        rows.append((f"transformers: Qwen3-0.6B {q.get('sequences')} seqs x {q.get('out_each')} out, output tok/s",
                     str(q.get("output_tok_s")),
                     f"appliance = {r['qwen_tok_s']}x its speed" if r["qwen_tok_s"] else "", "vLLM box: 300-750"))
    else:
        rows.append(("transformers: Qwen3-0.6B subset, output tok/s", str(q or hf.get("status", "-")), "", ""))
    return rows
