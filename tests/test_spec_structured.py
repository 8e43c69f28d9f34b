"""Structured outputs under speculative decoding (tiny Llama with its tokenizer): a verification masks each row as
after the drafts before it, so a draft the grammar refuses is rejected and the greedy output equals the output
without speculation, for drafts from n-gram lookup and from a draft model (the target itself: its unconstrained
drafts are often right, and often refused by the grammar)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from appliance import LLM, SamplingParams
from appliance.structured import StructuredSpec

pytest.importorskip("xgrammar")

SPECS = [StructuredSpec.regex("[a-z]{2,6}-[0-9]{1,3}( [a-z]{2,6}-[0-9]{1,3}){0,4}"),
         StructuredSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                      "s": {"type": "string", "maxLength": 8}},
                                     "required": ["n", "s"], "additionalProperties": False}),
         StructuredSpec.choice(["red", "green", "blue"])]
PROMPTS = ["Hello world, hello world, hello", "name: ab-12 cd-34"]


def run(llm: LLM) -> list[Any]:
    params = [SamplingParams(temperature=0.0, max_tokens=64, extra={"structured": spec.to_dict()}) for spec in SPECS
              for _ in PROMPTS]
    prompts = [p for _ in SPECS for p in PROMPTS]
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_structured_outputs_are_unchanged_by_speculation(tiny_model: Path, algorithm: str) -> None:
    kw: dict[str, Any] = {"dtype": "float32", "block_size": 4}
    base = run(LLM(model=str(tiny_model), **kw))
    spec = {"speculative_algorithm": algorithm, "speculative_num_steps": 3}
    if algorithm == "STANDALONE":
        spec["speculative_draft_model_path"] = str(tiny_model)
    llm = LLM(model=str(tiny_model), **spec, **kw)
    outs = run(llm)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    texts = [o.text for o in outs]
    n = len(PROMPTS)
    assert all(re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}( [a-z]{2,6}-[0-9]{1,3}){0,4}", t) for t in texts[:n])
    assert all(set(json.loads(t)) == {"n", "s"} for t in texts[n : 2 * n])
    assert all(t in ("red", "green", "blue") for t in texts[2 * n :])
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    if algorithm == "STANDALONE":  # the unconstrained drafts were refused somewhere
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_drawn_drafts_keep_random_structured_outputs_valid(tiny_model: Path) -> None:
    """Random unseeded rows draw their drafts from the drafter's q (unconstrained) and verify against the masked
    target: a draft the grammar refuses has p = 0 and is rejected, so every output still matches its grammar."""
    llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, speculative_algorithm="STANDALONE",
              speculative_draft_model_path=str(tiny_model), speculative_num_steps=3)
    params = [SamplingParams(temperature=1.0, max_tokens=64, extra={"structured": spec.to_dict()}) for spec in SPECS
              for _ in PROMPTS]
    outs = [o.outputs[0].text for o in llm.generate([p for _ in SPECS for p in PROMPTS], params)]
    n = len(PROMPTS)
    assert all(re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}( [a-z]{2,6}-[0-9]{1,3}){0,4}", t) for t in outs[:n])
    assert all(set(json.loads(t)) == {"n", "s"} for t in outs[n : 2 * n])
    assert all(t in ("red", "green", "blue") for t in outs[2 * n :])
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
