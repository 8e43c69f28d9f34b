"""Reasoning parsers (whole and streamed), thinking switches and the thinking budget."""
from __future__ import annotations

import random

import pytest

from appliance.server.parsers import assemble, get_reasoning_parser, get_tool_parser, resolve_thinking
from appliance.server.parsers.reasoning import (
    REASONING_EFFORT_BUDGETS,
    ReasoningParser,
    ThinkingBudget,
    ThinkingDecision,
    get_reasoning_format,
    prompt_opens_reasoning,
)

QWEN3_PROMPT_THINK = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_PROMPT_NO_THINK = QWEN3_PROMPT_THINK + "<think>\n\n</think>\n\n"
QWEN3_2507_PROMPT = QWEN3_PROMPT_THINK + "<think>\n"
R1_PROMPT = "<｜User｜>Hi<｜Assistant｜><think>\n"

# (parser name, prompt, thinking on, output, expected reasoning, expected content)
CASES = [
    ("qwen3", QWEN3_PROMPT_THINK, True, "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello!", "The user greets me.\nI greet back.", "Hello!"),
    ("qwen3", QWEN3_PROMPT_THINK, True, "Hello without thinking.", None, "Hello without thinking."),
    ("qwen3", QWEN3_PROMPT_NO_THINK, False, "Hello!", None, "Hello!"),
    ("qwen3", QWEN3_PROMPT_NO_THINK, False, "<think>x</think>y", None, "<think>x</think>y"),
    ("qwen3", QWEN3_2507_PROMPT, True, "Short thought.\n</think>\n\nAnswer: 4", "Short thought.", "Answer: 4"),
    ("qwen3", QWEN3_PROMPT_THINK, True, "<think>\nStill thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    ("deepseek_r1", R1_PROMPT, True, "Okay, 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.", "Okay, 2+2.\nThat is 4.", "The answer is **4**."),
    ("deepseek_r1", None, True, "<think>\nOld R1 opens it itself.\n</think>\nAnswer", "Old R1 opens it itself.", "Answer"),
    ("deepseek_r1", None, True, "no end tag at all", "no end tag at all", None),
    ("deepseek_v31", "<｜User｜>Hi<｜Assistant｜><think>", True, "Let me see.</think>Hi there", "Let me see.", "Hi there"),
    ("deepseek_v31", "<｜User｜>Hi<｜Assistant｜></think>", True, "Hi there", None, "Hi there"),
    ("mistral", None, True, "[THINK]I should call the tools.[/THINK]It is 20C.", "I should call the tools.", "It is 20C."),
    ("qwen3", QWEN3_PROMPT_THINK, True, "<thinking is a word>", None, "<thinking is a word>"),
]


@pytest.mark.parametrize("name,prompt,enabled,text,reasoning,content", CASES)
def test_whole_and_streamed(name: str, prompt: str | None, enabled: bool, text: str, reasoning: str | None, content: str | None) -> None:
    def make() -> ReasoningParser:
        return get_reasoning_parser(name, thinking_enabled=enabled, prompt_text=prompt)

    assert make().parse(text) == (reasoning, content)
    splits = [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    rng = random.Random(0)
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(5, len(text) - 1)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for chunks in splits:
        parser = make()
        r_parts, c_parts = [], []
        for chunk in [*chunks, None]:
            r, c = parser.finish() if chunk is None else parser.feed(chunk)
            r_parts.append(r or "")
            c_parts.append(c or "")
        assert ("".join(r_parts) or None, "".join(c_parts) or None) == (reasoning, content), chunks


def test_reasoning_streams_before_the_end_tag() -> None:
    parser = get_reasoning_parser("qwen3", prompt_text=QWEN3_PROMPT_THINK)
    assert parser.feed("<think>\nStep one") == ("Step one", None)
    assert parser.feed(". Step two.</th") == (". Step two.", None)
    assert parser.in_reasoning
    assert parser.feed("ink>\n\nDone") == (None, "Done")
    assert not parser.in_reasoning
    assert parser.finish() == (None, None)


def test_reasoning_then_tool_calls() -> None:
    text = '<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": {"c": "Oslo"}}\n</tool_call>'
    rp = get_reasoning_parser("qwen3", prompt_text=QWEN3_PROMPT_THINK)
    tp = get_tool_parser("hermes")([{"type": "function", "function": {"name": "w"}}])
    deltas, reasoning = [], []
    for ch in [*text, None]:
        r, c = rp.finish() if ch is None else rp.feed(ch)
        reasoning.append(r or "")
        if c:
            deltas += tp.feed(c)
    deltas += tp.finish()
    parsed = assemble(deltas)
    assert "".join(reasoning) == "I need the weather."
    assert parsed.content is None and [(t.name, t.arguments) for t in parsed.tool_calls] == [("w", '{"c": "Oslo"}')]


def test_prompt_detection_and_formats() -> None:
    fmt = get_reasoning_format("qwen3")
    assert prompt_opens_reasoning(QWEN3_2507_PROMPT, fmt)
    assert not prompt_opens_reasoning(QWEN3_PROMPT_NO_THINK, fmt)
    assert not prompt_opens_reasoning(None, fmt)
    custom = get_reasoning_parser("base", start="<reasoning>", end="</reasoning>")
    assert custom.parse("<reasoning>a</reasoning>b") == ("a", "b")
    with pytest.raises(ValueError, match="unknown reasoning_parser"):
        get_reasoning_format("nope")


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({}, ThinkingDecision(True, None)),
        ({"disable_thinking": True, "enable_thinking": True, "budget_tokens": 10}, ThinkingDecision(False, None)),
        ({"enable_thinking": False}, ThinkingDecision(False, None)),
        ({"reasoning_effort": "none"}, ThinkingDecision(False, None)),
        ({"reasoning_effort": "low"}, ThinkingDecision(True, REASONING_EFFORT_BUDGETS["low"])),
        ({"budget_tokens": 500, "max_thinking_budget": 2000}, ThinkingDecision(True, 500)),  # request wins below ceiling
        ({"budget_tokens": 5000, "max_thinking_budget": 2000}, ThinkingDecision(True, 2000)),  # ceiling caps it
        ({"max_thinking_budget": 2000}, ThinkingDecision(True, 2000)),
        ({"budget_tokens": 5000, "max_tokens": 1000}, ThinkingDecision(True, 900)),  # max_tokens * 9 / 10
        ({"max_tokens": 100, "max_thinking_budget": 50}, ThinkingDecision(True, 50)),
        ({"default_enabled": False}, ThinkingDecision(False, None)),
        ({"structured_output": True, "enable_thinking": True}, ThinkingDecision(False, None)),
    ],
)
def test_resolve_thinking(kwargs: dict, expected: ThinkingDecision) -> None:
    assert resolve_thinking(**kwargs) == expected


def test_resolve_thinking_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="reasoning_effort"):
        resolve_thinking(reasoning_effort="extreme")
    with pytest.raises(ValueError, match="budget_tokens"):
        resolve_thinking(budget_tokens=-1)


THINK, END_THINK, NL = 100, 101, 10


def _run(budget: ThinkingBudget, proposals: list[int]) -> list[int]:
    """A sampler that wants to emit `proposals` in order but obeys forced tokens."""
    out: list[int] = []
    wanted = iter(proposals)
    for _ in range(len(proposals) + 5):
        forced = budget.forced_token()
        token = forced if forced is not None else next(wanted, None)
        if token is None:
            break
        budget.observe(token)
        out.append(token)
    return out


def test_budget_forces_the_end_of_thinking() -> None:
    budget = ThinkingBudget(3, end_token_ids=[NL, END_THINK, NL], start_tag_ids=[THINK])
    out = _run(budget, [THINK, 1, 2, 3, 4, 5, 6])
    assert out[:4] == [THINK, 1, 2, 3]
    assert out[4:7] == [NL, END_THINK, NL]  # forced after three reasoning tokens
    assert out[7:] == [4, 5, 6]  # then free sampling, which no longer counts as reasoning
    assert budget.exhausted and not budget.in_reasoning and budget.reasoning_tokens == 3


def test_budget_not_spent_when_the_model_ends_thinking_itself() -> None:
    budget = ThinkingBudget(10, end_token_ids=[END_THINK], in_reasoning=True)
    out = _run(budget, [1, 2, END_THINK, 7, 8, 9, 10, 11, 12, 13, 14, 15])
    assert out == [1, 2, END_THINK, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert not budget.exhausted and budget.reasoning_tokens == 3


def test_zero_budget_closes_an_open_block_at_once_and_disobedience_is_an_error() -> None:
    budget = ThinkingBudget(0, end_token_ids=[END_THINK], in_reasoning=True)
    assert budget.forced_token() == END_THINK
    with pytest.raises(ValueError, match="forced"):
        budget.observe(5)
    with pytest.raises(ValueError):
        ThinkingBudget(-1, end_token_ids=[END_THINK])


def test_unlimited_budget_only_tracks_the_block() -> None:
    budget = ThinkingBudget(None, end_token_ids=[END_THINK], start_tag_ids=[THINK])
    states = []
    for token in [5, THINK, *range(1000, 1200), END_THINK, 6]:
        assert budget.forced_token() is None
        budget.observe(token)
        states.append(budget.in_reasoning)
    assert states[0] is False and states[1] is True and states[-2] is False and states[-1] is False
    assert budget.reasoning_tokens == 201 and not budget.exhausted
