"""Benchmark workloads: random-token prompts with their output lengths (offline) and random-text requests (HTTP).

Lengths follow vLLM's random dataset: with a range ratio r, a length is uniform in [len * (1 - r), len * (1 + r)].
Every request ignores EOS, so it produces exactly its output length.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

# roughly one token each in any BPE vocabulary: prompts for a server whose tokenizer we do not have
_WORDS = ("the of and to in is was for on that with as by at from his her an be this which have are not they one "
          "all were had but their been has more when who will no would there can its if so what time year about "
          "people into only new some could them other than then now look also back after use two how our work "
          "first well way even want because any these give day most us").split()


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids and one output length per prompt."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclass(frozen=True)
class TextRequest:
    """One HTTP request of a serving run: the prompt text, its length in tokens and the output length asked."""

    prompt: str
    prompt_len: int
    output_len: int


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """[len * (1 - r), len * (1 + r)], at least 1 (vLLM's --random-range-ratio)."""
    if length < 1 or not 0 <= range_ratio < 1:
        raise ValueError(f"length must be >= 1 and range ratio in [0, 1), got {length} and {range_ratio}")
    return max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))


def _draw(rng: random.Random, bounds: tuple[int, int], n: int) -> list[int]:
    lo, hi = bounds
    return [lo] * n if lo == hi else [rng.randint(lo, hi) for _ in range(n)]


def random_workload(vocab_size: int, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    seed: int = 0) -> Workload:
    """num_prompts prompts of random token ids below vocab_size; lengths uniform in the given [lo, hi] ranges.
    Drawn in this order from random.Random(seed): the input lengths, the output lengths, the prompts."""
    if num_prompts < 1 or vocab_size < 1:
        raise ValueError(f"need at least one prompt and one token id, got {num_prompts} and {vocab_size}")
    rng = random.Random(seed)
    in_lens = _draw(rng, input_len, num_prompts)
    out_lens = _draw(rng, output_len, num_prompts)
    return Workload([[rng.randrange(vocab_size) for _ in range(n)] for n in in_lens], out_lens)


def random_text_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], prefix_len: int,
                         tokenizer: Any | None, seed: int = 0) -> list[TextRequest]:
    """vLLM's random dataset as text: random token ids (special ids excluded) decoded by `tokenizer`, re-encoded
    to count them; without a tokenizer, random common words (a token each, roughly). A shared prefix of
    prefix_len tokens starts every prompt."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=num)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=num)
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = [i for i in range(len(tokenizer)) if i not in special]
        pick = lambda k: [vocab[i] for i in rng.integers(0, len(vocab), size=k)]  # noqa: E731
    else:
        pick = lambda k: [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=k)]  # noqa: E731
    prefix = pick(prefix_len)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        body = prefix + pick(int(n_in))
        if tokenizer is not None:
            prompt = tokenizer.decode(body)
            n = len(tokenizer.encode(prompt, add_special_tokens=False))
        else:
            prompt, n = " ".join(body), len(body)
        out.append(TextRequest(prompt, n, int(n_out)))
    return out
