"""Train appliance's embedded default model: a small Llama on the Python standard library.

The corpus is text every machine with Python has: the stdlib's .py sources and its pydoc topics
(`pydoc_data.topics.topics`), plus chat-formatted examples derived from them (function-writing requests and
docstring questions), so that both the completion and the chat endpoints have something real to serve.

Phases, all seeded: collect documents (validation split by a hash of each file's path, so it never depends on
ordering or on the machine) -> train a byte-level BPE tokenizer on the training split -> train LlamaForCausalLM
(bf16 autocast on CUDA, AdamW, warmup + cosine LR, best-validation checkpoint kept) -> write the HF layout
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json) and report.json (corpus stats, loss curve, samples, parse fraction).

    python3 tools/train_default_model.py --out /tmp/default_model --minutes 7.5        # one H100
    python3 tools/train_default_model.py --out /tmp/dm --device cpu --max-steps 20 --tiny  # CPU smoke test
    python3 tools/train_default_model.py --tokenizer-only --out /tmp/tok
    python3 tools/train_default_model.py --merge-shards DIR   # re-join a sharded model.safetensors

Without --max-steps the step count is derived from --minutes and the measured step time and printed, so a
run is repeated exactly by passing that count back as --max-steps (GPU kernels may still differ in the last bits).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import math
import os
import random
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_FILE_BYTES = 400_000  # larger stdlib files are generated tables (unicode data, encodings), not prose or code
VAL_PER_MILLE = 40
SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    ", "    def __repr__(self):"]


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    val: list[str]
    stats: dict[str, int | str]


def is_validation(key: str) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < VAL_PER_MILLE


def render_chat(user: str, assistant: str) -> str:
    """The chat template's rendering of one exchange (without bos, which encode() adds)."""
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n"


def chat_examples_from_source(module: str, source: str) -> list[str]:
    """Function-writing requests and docstring questions from a module's top-level functions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out: list[str] = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        segment = ast.get_source_segment(source, node)
        if not doc or not segment or segment.count("\n") > 40:
            continue
        summary = inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ").strip()
        args = ast.unparse(node.args)
        out.append(render_chat(f"Write a Python function `{node.name}({args})`: {summary}",
                               f"```python\n{textwrap.dedent(segment)}\n```"))
        out.append(render_chat(f"What does `{module}.{node.name}` do?", inspect.cleandoc(doc)))
    return out


def stdlib_files(root: Path, max_files: int | None) -> list[tuple[Path, str]]:
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts)
                   and p.name != "topics.py" and p.stat().st_size <= MAX_FILE_BYTES)
    return [(p, p.relative_to(root).as_posix()) for p in files[:max_files]]


def collect_corpus(max_files: int | None, extra_roots: list[Path]) -> Corpus:
    """The running Python's stdlib, then any extra stdlib trees (other versions); exact duplicates once."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), *extra_roots]
    files = [f for root in roots for f in stdlib_files(root, max_files)]
    train: list[str] = []
    val: list[str] = []
    seen: set[bytes] = set()
    n_chat = n_bytes = n_skipped = n_dup = 0
    for path, rel in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            n_skipped += 1
            continue
        digest = hashlib.sha256(source.encode()).digest()
        if digest in seen:
            n_dup += 1
            continue
        seen.add(digest)
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        chats = chat_examples_from_source(module, source)
        bucket = val if is_validation(rel) else train
        bucket.append(source)
        bucket.extend(chats)
        n_chat += len(chats)
        n_bytes += len(source.encode())
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        bucket = val if is_validation("topic:" + name) else train
        bucket.append(text)
        bucket.append(render_chat(f"Explain the Python topic '{name}'.", text[:3000]))
        n_chat += 1
    stats = {"stdlib": " ".join(map(str, roots)), "python": sys.version.split()[0],
             "files": len(files) - n_skipped - n_dup, "skipped_undecodable": n_skipped, "duplicates": n_dup, "source_bytes": n_bytes, "pydoc_topics": len(topics),
             "chat_examples": n_chat, "train_docs": len(train), "val_docs": len(val)}
    return Corpus(train, val, stats)


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    # Like Llama's tokenizers: encode() prepends bos; the chat template writes bos itself and callers encode
    # templated chats with add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def write_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "pad_token": PAD, "unk_token": None, "add_bos_token": True, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": max_len,
              "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    import torch

    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.append(1)
        ids.extend(enc.ids)
        ids.append(2)
    return torch.tensor(ids, dtype=torch.int32)


def model_config(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads, "hidden_act": "silu", "max_position_embeddings": args.seq_len,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
    }


def add_residual_dropout(model: torch.nn.Module, p: float) -> None:
    """Dropout on each block's two residual branches (HF Llama has only attention dropout); training only,
    so the saved model is plain LlamaForCausalLM. The corpus is small and repeated, so this matters."""
    import torch

    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(output, p, module.training)

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(hook)
        layer.mlp.down_proj.register_forward_hook(hook)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    # A fixed warmup keeps the first steps identical whether or not the total is known yet (see --minutes).
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(model: torch.nn.Module, val: torch.Tensor, seq_len: int, batch: int, device: str,
             max_windows: int = 256) -> float:
    import torch

    n = min(max_windows, (len(val) - 1) // seq_len)
    windows = val[: n * seq_len + 1]
    x_all = windows[:-1].view(n, seq_len).long()
    y_all = windows[1:].view(n, seq_len).long()
    total = 0.0
    model.eval()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        for i in range(0, n, batch):
            x, y = x_all[i:i + batch].to(device), y_all[i:i + batch].to(device)
            logits = model(input_ids=x).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train()
    return total / (n * seq_len)


def train_model(args: argparse.Namespace, config: dict[str, Any], train_ids: torch.Tensor, val_ids: torch.Tensor,
                log: list[dict[str, Any]]) -> tuple[tuple[float, int, dict[str, torch.Tensor]], int, float]:
    """Returns ((best val loss, its step, its float32 state dict on the CPU), steps run, training seconds)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "dtype")})
    cfg.attention_dropout = args.dropout
    model = LlamaForCausalLM(cfg).to(args.device)
    add_residual_dropout(model, args.dropout)
    model.config._attn_implementation = "sdpa"
    fwd = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=args.device == "cuda")
    data = train_ids.to(args.device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    total = args.max_steps or 10**9
    budget = args.minutes * 60
    best = (float("inf"), -1, None)
    start = warm = time.time()
    step = 0
    while step < total:
        if args.max_steps is None and step == 10:
            warm = time.time()  # the first steps pay for CUDA initialisation and would inflate the estimate
        if args.max_steps is None and step == 40:
            per_step = (time.time() - warm) / 30
            epoch_cap = int(args.max_epochs * len(data) / (args.batch * args.seq_len))
            total = max(args.warmup + 40, min(int(budget / per_step * 0.93), epoch_cap))
            print(f"measured {per_step * 1000:.1f} ms/step; epoch cap {epoch_cap} steps -> total_steps={total} "
                  f"(pass --max-steps {total} to repeat)", flush=True)
        lr = lr_at(step, total, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=gen).to(args.device)
        idx = offsets[:, None] + torch.arange(args.seq_len + 1, device=args.device)[None, :]
        chunk = data[idx].long()
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            logits = fwd(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0 or step == total:
            val_loss = evaluate(model, val_ids, args.seq_len, args.batch, args.device)
            entry = {"step": step, "train_loss": round(loss.item(), 4), "val_loss": round(val_loss, 4),
                     "lr": lr, "elapsed_s": round(time.time() - start, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
            if val_loss < best[0]:
                best = (val_loss, step, {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()})
        if args.max_steps is None and time.time() - start > budget * 1.1:
            print(f"stopping at step {step}: over the time budget")
            break
    if best[2] is None:  # fewer steps than one evaluation interval
        best = (evaluate(model, val_ids, args.seq_len, args.batch, args.device), step,
                {k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    return best, step, time.time() - start


def save_weights(state: dict[str, torch.Tensor], out: Path, max_file_mb: float | None) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}  # tied to embed_tokens
    limit = None if max_file_mb is None else int(max_file_mb * 2**20)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if limit is None or size <= limit:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; the file ships in a package
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and used + nbytes > limit:
            shards.append({})
            used = 0
        shards[-1][name] = tensors[name]
        used += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def merge_shards(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {}
    for fname in files:
        tensors.update(load_file(str(directory / fname)))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(directory / "model.safetensors", 0o644)
    for fname in files:
        (directory / fname).unlink()
    index_path.unlink()
    print(f"merged {len(files)} shards into {directory / 'model.safetensors'}")


def first_block(text: str) -> str:
    """A completion cut where the generated function ends: before the first non-blank line back at column 0;
    a sample that never dedents loses its last (possibly unfinished) line instead."""
    lines = text.split("\n")
    for i, line in enumerate(lines[1:], start=1):
        if line.strip() and not line[0].isspace():
            return "\n".join(lines[:i])
    return "\n".join(lines[:-1]) if len(lines) > 1 else text


def parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except SyntaxError:
        return False


def sample_report(out: Path, n_parse: int, seed: int) -> dict[str, Any]:
    """Samples and the parse fraction, from the saved files through transformers (the shipped artefact)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    samples = {}
    for i, prompt in enumerate(SAMPLE_PROMPTS):
        torch.manual_seed(seed + i)
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=96, do_sample=True, temperature=0.8, top_k=0)
        samples[prompt] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a Python function `is_prime(n)`."}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(chat, return_tensors="pt", add_special_tokens=False).input_ids
    gen = model.generate(ids, max_new_tokens=96, do_sample=False)
    samples["<chat> Write a Python function `is_prime(n)`."] = tok.decode(gen[0, ids.shape[1]:],
                                                                        skip_special_tokens=True)
    prompt = "def fibonacci(n):"
    ids = tok(prompt, return_tensors="pt").input_ids
    ok = 0
    for i in range(n_parse):
        torch.manual_seed(seed + 1000 + i)
        gen = model.generate(ids, max_new_tokens=128, do_sample=True, temperature=0.8, top_k=0)
        ok += parses(first_block(prompt + tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)))
    return {"samples": samples, "fibonacci_parse_fraction": ok / n_parse, "fibonacci_parse_n": n_parse}


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
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen_config = {"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 0, "do_sample": True,
                  "temperature": 0.8, "max_new_tokens": 256}
    (args.out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
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
