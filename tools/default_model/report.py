"""What report.json says about the trained model: samples and the fraction of sampled function bodies that
parse, generated from the saved files through transformers (the shipped artefact, not the training module)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    ", "    def __repr__(self):"]


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
