"""Train appliance's embedded default model: a small Llama on the Python standard library.

The corpus is text every machine with Python has: the stdlib's .py sources and its pydoc topics
(`pydoc_data.topics.topics`), plus chat-formatted examples derived from them (function-writing requests and
docstring questions), so that both the completion and the chat endpoints have something real to serve.

Phases, all seeded: collect documents (validation split by a hash of each file's path, so it never depends on
ordering or on the machine) -> train a byte-level BPE tokenizer on the training split -> train LlamaForCausalLM
(bf16 autocast on CUDA, AdamW, warmup + cosine LR, best-validation checkpoint kept) -> write the HF layout
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json) and report.json (corpus stats, loss curve, samples, parse fraction).
Each phase is a module of tools/default_model/ (chat_format, corpus, tokenizer, training, export, report);
this script is the command line and the order of the phases.

    python -m tools.train_default_model --out /tmp/default_model --minutes 7.5        # one H100
    python -m tools.train_default_model --out /tmp/dm --device cpu --max-steps 20 --tiny  # CPU smoke test
    python -m tools.train_default_model --tokenizer-only --out /tmp/tok
    python -m tools.train_default_model --merge-shards DIR   # re-join a sharded model.safetensors

Without --max-steps the step count is derived from --minutes and the measured step time and printed, so a
run is repeated exactly by passing that count back as --max-steps (GPU kernels may still differ in the last bits).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from tools.default_model.chat_format import BOS, CHAT_TEMPLATE, EOS, IM_END, IM_START, PAD, render_chat
from tools.default_model.corpus import chat_examples_from_source, collect_corpus, is_validation
from tools.default_model.export import merge_shards, save_weights, write_configs
from tools.default_model.report import first_block, parses, sample_report
from tools.default_model.tokenizer import encode_stream, train_tokenizer, write_tokenizer
from tools.default_model.training import model_config, train_model

__all__ = ["BOS", "CHAT_TEMPLATE", "EOS", "IM_END", "IM_START", "PAD", "chat_examples_from_source", "first_block",
           "is_validation", "main", "parse_args", "parses", "render_chat"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output directory (the HF layout)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=7.0, help="training-loop time budget without --max-steps")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--tokenizer-only", action="store_true")
    p.add_argument("--merge-shards", type=Path, default=None, metavar="DIR")
    p.add_argument("--tiny", action="store_true", help="a toy model and corpus for a CPU smoke test")
    p.add_argument("--max-files", type=int, default=None, help="per stdlib tree")
    p.add_argument("--extra-stdlib", type=Path, action="append", default=[], metavar="DIR",
                   help="another Python version's Lib/ directory to add to the corpus (repeatable)")
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dropout", type=float, default=0.1, help="attention and residual dropout while training")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--max-epochs", type=float, default=12.0,
                   help="cap on passes over the training tokens (the corpus is small; see docs/default_model.md)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--max-file-mb", type=float, default=None, help="shard model.safetensors above this size")
    p.add_argument("--parse-samples", type=int, default=20)
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab_size, args.hidden, args.layers, args.heads, args.kv_heads = 512, 64, 2, 4, 2
        args.intermediate, args.seq_len, args.batch, args.eval_every, args.warmup = 128, 128, 8, 10, 5
        args.max_files = args.max_files or 40
        args.parse_samples = min(args.parse_samples, 4)
    if args.merge_shards is None and args.out is None:
        p.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge_shards is not None:
        merge_shards(args.merge_shards)
        return
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    random.seed(args.seed)
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = collect_corpus(args.max_files, args.extra_stdlib)
    print("corpus:", json.dumps(corpus.stats), flush=True)
    tok = train_tokenizer(corpus.train, args.vocab_size)
    write_tokenizer(tok, args.out, args.seq_len)
    print(f"tokenizer: {tok.get_vocab_size()} tokens ({time.time() - t0:.1f}s)", flush=True)
    if args.tokenizer_only:
        return
    train_ids, val_ids = encode_stream(tok, corpus.train), encode_stream(tok, corpus.val)
    stats = dict(corpus.stats, train_tokens=len(train_ids), val_tokens=len(val_ids),
                 bytes_per_token=round(sum(len(d.encode()) for d in corpus.train) / len(train_ids), 3))
    print("tokens:", json.dumps(stats), flush=True)
    config = model_config(args, tok.get_vocab_size())
    log: list[dict] = []
    (best_loss, best_step, state), steps, train_s = train_model(args, config, train_ids, val_ids, log)
    n_params = sum(v.numel() for k, v in state.items() if k != "lm_head.weight")
    save_weights(state, args.out, args.max_file_mb)
    write_configs(args.out, config)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"trained {steps} steps in {train_s:.0f}s on {device_name}; best val loss {best_loss:.4f} at step "
          f"{best_step}; {n_params} parameters", flush=True)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "corpus": stats, "parameters": n_params,
              "steps": steps, "tokens_per_step": args.batch * args.seq_len, "train_seconds": round(train_s, 1),
              "device": device_name, "torch": torch.__version__, "best_val_loss": round(best_loss, 4),
              "best_step": best_step, "log": log}
    report.update(sample_report(args.out, args.parse_samples, args.seed))
    report["total_seconds"] = round(time.time() - t0, 1)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    for prompt, text in report["samples"].items():
        print(f"--- {prompt!r}\n{text}")
    print(f"fibonacci parse fraction: {report['fibonacci_parse_fraction']:.2f} "
          f"({report['fibonacci_parse_n']} samples); total {report['total_seconds']}s")


if __name__ == "__main__":
    main()
