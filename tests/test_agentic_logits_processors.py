"""executor/logits_processors.py on the CPU with random logits: grammar masking, the thinking budget, the
per-worker registry (lazy observation, preemption, forgetting) and the routing of constrained rows."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.executor.batch_sampler import BatchSampler
from appliance.executor.logits_processors import (
    FinishNow,
    GrammarProcessor,
    LogitsProcessors,
    ThinkingBudgetProcessor,
    sample,
    thinking_budget_from_dict,
    unpack_bitmask,
)
from appliance.executor.request_table import RequestState
from appliance.executor.sampler import Sampler
from appliance.structured import GrammarMatcher, StructuredSpec

pytest.importorskip("xgrammar")

VOCAB = 384  # the tiny models' logits width (conftest.TINY_VOCAB); the tokenizer has fewer tokens
EOS = 1


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


@pytest.fixture(scope="module")
def registry_factory(tokenizer: Any) -> Any:
    compiler: dict[str, Any] = {}

    def make(live: dict[str, RequestState]) -> LogitsProcessors:
        reg = LogitsProcessors(lambda: tokenizer, VOCAB, [EOS], live)
        if "c" in compiler:  # share one compiled tokenizer between tests
            reg._compiler = compiler["c"]
        else:
            compiler["c"] = reg.compiler
        return reg

    return make


def state(rid: str, extra: dict[str, Any], prompt: list[int] | None = None, **params: Any) -> RequestState:
    prompt = prompt or [5, 6, 7]
    return RequestState(rid, list(prompt), len(prompt), len(prompt), [0], SamplingParams(extra=extra, **params))


def test_unpack_bitmask_matches_bit_arithmetic() -> None:
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int64, generator=g).to(torch.int32)
    allowed = unpack_bitmask(words, 150)
    assert allowed.shape == (3, 150)
    for r in range(3):
        for t in range(150):
            assert bool(allowed[r, t]) == bool((int(words[r, t // 32]) >> (t % 32)) & 1)


@pytest.mark.parametrize("spec", [
    StructuredSpec.regex("[a-z]{2,4}-[0-9]{1,2}"),
    StructuredSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                        "maximum": 50},
                                                                  "ok": {"type": "boolean"}},
                                "required": ["n", "ok"], "additionalProperties": False}),
    StructuredSpec.choice(["red", "green", "blue"]),
])
def test_grammar_processor_forces_valid_output(registry_factory: Any, tokenizer: Any, spec: StructuredSpec) -> None:
    compiler = registry_factory({}).compiler
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        proc = GrammarProcessor(GrammarMatcher(compiler.compile(spec)), EOS)
        tokens: list[int] = []
        for _ in range(80):
            row = torch.randn(VOCAB, generator=g) * 3
            proc.mask_row(row)
            assert torch.isinf(row[tokenizer.vocab_size:]).all()  # columns past the tokenizer never come
            allowed = torch.isfinite(row)
            assert 0 < int(allowed.sum()) < VOCAB
            token = int(torch.multinomial(torch.softmax(row, -1), 1, generator=g))
            assert allowed[token]
            proc.observe(token)
            tokens.append(token)
            if token == EOS:
                break
        assert tokens[-1] == EOS and proc.matcher.is_terminated()
        text = tokenizer.decode(tokens[:-1])
        if spec.kind == "regex":
            assert re.fullmatch(spec.value, text), text
        elif spec.kind == "choice":
            assert text in spec.choices
        else:
            value = json.loads(text)
            assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 50 and isinstance(value["ok"], bool)
        row = torch.randn(VOCAB, generator=g)
        proc.mask_row(row)  # complete: only EOS may follow
        assert torch.isfinite(row).nonzero().flatten().tolist() == [EOS]


def test_thinking_budget_processor_forces_the_end_sequence() -> None:
    end_seq = [10, 11, 12]
    budget = thinking_budget_from_dict({"budget": 4, "end_token_ids": end_seq, "start_tag_ids": [20],
                                        "end_tag_ids": [11]}, prompt_ids=[3, 20, 4])  # prompt opens a block
    assert budget.in_reasoning
    proc = ThinkingBudgetProcessor(budget)
    g = torch.Generator().manual_seed(2)
    tokens = []
    for _ in range(12):
        row = torch.randn(VOCAB, generator=g)
        row[[10, 11, 12, 20]] = float("-inf")  # the random "model" never ends (or reopens) thinking itself
        before = row.clone()
        proc.mask_row(row)
        free = torch.equal(torch.isfinite(row), torch.isfinite(before))
        token = int(row.argmax())
        if not free:
            assert torch.isfinite(row).nonzero().flatten().tolist() == [token]
        proc.observe(token)
        tokens.append(token)
    assert tokens[4:7] == end_seq
    assert not set(tokens[:4]) & set(end_seq) and not set(tokens[7:]) & set(end_seq)
    assert not budget.in_reasoning and budget.reasoning_tokens == 4


def test_registry_observes_lazily_rebuilds_after_preemption_and_forgets(registry_factory: Any) -> None:
    tb = {"budget": 2, "end_token_ids": [30], "in_reasoning": True}
    live = {"a": state("a", {"thinking_budget": tb}), "b": state("b", {})}
    reg = registry_factory(live)
    states = [live["a"], live["b"]]
    forced, masked = [], []
    for step in range(4):
        logits = torch.zeros(2, VOCAB)
        logits[:, 7] = 1.0
        masked.append(reg.mask(logits, states))
        assert torch.equal(logits[1], torch.eye(VOCAB)[7] * 1.0)  # row b untouched
        token = int(logits[0].argmax())
        forced.append(token)
        for s, t in zip(states, (token, 7)):
            s.token_ids.append(t)
    assert forced == [7, 7, 30, 7]  # two reasoning tokens, then the forced end, then free
    assert masked == [[], [], [0], []]  # only the forcing step constrains the row
    # preemption: the scheduler sends the request again with its tokens; the worker builds a new state
    again = state("a", {"thinking_budget": tb}, prompt=live["a"].token_ids[:3])
    again.token_ids.extend(live["a"].output_ids)
    live["a"] = again
    logits = torch.zeros(1, VOCAB)
    reg.mask(logits, [again])
    assert reg._entries["a"].state is again and reg._entries["a"].seen == 4
    assert torch.isfinite(logits[0]).all()  # replayed: thinking is over, nothing is forced
    del live["a"]
    reg.mask(torch.zeros(1, VOCAB), [live["b"]])
    assert "a" not in reg._entries


def test_a_spec_the_worker_cannot_compile_ends_the_request(registry_factory: Any) -> None:
    bad = state("x", {"structured": {"kind": "grammar", "value": "root ::= undefined_rule"}})
    reg = registry_factory({"x": bad})
    (proc,) = reg.build(bad)
    assert isinstance(proc, FinishNow)
    logits = torch.randn(1, VOCAB)
    reg.mask(logits, [bad])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]


def test_constrained_rows_skip_the_gpu_fast_path(registry_factory: Any) -> None:
    """With a fast-path op present, constrained rows are drawn by the torch Sampler (which honours the mask)."""
    calls: list[int] = []

    def fake_gpu_op(logits: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(logits.shape[0])
        return torch.full((logits.shape[0],), 3, dtype=torch.int64)

    spec = StructuredSpec.choice(["ab"]).to_dict()
    thinking = {"budget": 5, "end_token_ids": [30], "in_reasoning": True}  # not forcing yet
    live = {"c": state("c", {"structured": spec}, temperature=1.0), "f": state("f", {}, temperature=1.0),
            "t": state("t", {"thinking_budget": thinking}, temperature=1.0)}
    runner = type("Runner", (), {})()
    runner.batch_sampler = BatchSampler(Sampler([EOS], seed=0), torch.device("cpu"), fake_gpu_op)
    runner.logits_processors = registry_factory(live)
    results = sample(runner, torch.randn(3, VOCAB), [live["c"], live["f"], live["t"]])
    assert calls == [2]  # the free row and the unconstrained step of the thinking row took the fast path
    assert results[1].token_id == 3 and results[2].token_id == 3
    allowed = runner.logits_processors._entries["c"].processors[0].matcher.allowed_token_ids()
    assert results[0].token_id in allowed
