"""Structured outputs: request specs, the compile cache, and masked sampling with a tiny byte-level BPE tokenizer."""
from __future__ import annotations

import json
import re
import sys

import pytest

from appliance.server.parsers import ToolSet, forced_tool_spec, parse_forced_output
from appliance.server.parsers.tool_calls import ForcedToolStream, assemble
from appliance.structured import (
    StructuredOutputError,
    StructuredOutputUnavailable,
    StructuredSpec,
    choice_ebnf,
    spec_from_request,
    tool_choice_schema,
)
from appliance.server.parsers.tool_calls.schema_check import validate

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "unit", "tags", "ok"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]


# ------------------------------------------------------------------------------------ request specs
@pytest.mark.parametrize(
    "body,expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredSpec.json_object()),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
         StructuredSpec.json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": r"\d+"}}, StructuredSpec.regex(r"\d+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredSpec.choice(["a", "b"])),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredSpec.json_schema(SCHEMA)),
        ({"guided_grammar": 'root ::= "x"'}, StructuredSpec.grammar('root ::= "x"')),
        ({"ebnf": 'root ::= "x"'}, StructuredSpec.grammar('root ::= "x"')),
    ],
)
def test_spec_from_request(body: dict, expected: StructuredSpec | None) -> None:
    spec = spec_from_request(body)
    assert spec == expected
    if spec is not None:
        assert StructuredSpec.from_dict(spec.to_dict()) == spec
        assert hash(spec) == hash(expected)


def test_schema_keeps_property_order() -> None:
    # the grammar generates properties in the schema's order, so the order is part of the spec
    props = {"zeta": {"type": "integer"}, "alpha": {"type": "string"}}
    spec = StructuredSpec.json_schema({"type": "object", "properties": props})
    assert list(spec.schema["properties"]) == ["zeta", "alpha"]
    reversed_props = {"type": "object", "properties": dict(reversed(list(props.items())))}
    assert StructuredSpec.json_schema(reversed_props) != spec


@pytest.mark.parametrize(
    "body,match",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "at most one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"guided_choice": []}, "non-empty list"),
        ({"guided_json": "{not json"}, "not valid JSON"),
    ],
)
def test_bad_requests_are_clear_errors(body: dict, match: str) -> None:
    with pytest.raises(StructuredOutputError, match=match):
        spec_from_request(body)


def test_missing_xgrammar_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.structured import GrammarCompiler

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # makes `import xgrammar` raise ImportError
    with pytest.raises(StructuredOutputUnavailable, match=r"pip install xgrammar"):
        GrammarCompiler.from_tokenizer(object())
    assert isinstance(StructuredOutputUnavailable(), StructuredOutputError)


# ------------------------------------------------------------------------------------ tool_choice
def test_tool_choice_schemas() -> None:
    tools = {"get_weather": TOOLS[0]["function"]["parameters"], "noargs": {}}
    assert tool_choice_schema(tools, "auto") is None and tool_choice_schema(tools, "none") is None
    named = tool_choice_schema(tools, {"type": "function", "function": {"name": "get_weather"}})
    assert named == TOOLS[0]["function"]["parameters"]
    assert tool_choice_schema(tools, {"type": "function", "function": {"name": "noargs"}}) == {"type": "object"}
    required = tool_choice_schema(tools, "required")
    good = [{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}, {"name": "noargs", "parameters": {}}]
    assert validate(good, required) == []
    assert validate([], required) != []
    assert validate([{"name": "get_weather", "parameters": {"city": "Rome"}}], required) != []
    assert validate([{"name": "other", "parameters": {}}], required) != []
    with pytest.raises(StructuredOutputError, match="not in tools"):
        tool_choice_schema(tools, {"type": "function", "function": {"name": "zzz"}})
    with pytest.raises(StructuredOutputError, match="tool_choice must be"):
        tool_choice_schema(tools, "sometimes")


def test_forced_output_back_to_tool_calls() -> None:
    tools = ToolSet(TOOLS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    parsed = parse_forced_output('{"city": "Rome", "days": 2}', tools, named)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Rome", "days": 2})]
    text = '[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", "parameters": {"city": "A", "days": 1}}]'
    assert [c.name for c in parse_forced_output(text, tools, "required").tool_calls] == ["get_time", "get_weather"]
    cut = parse_forced_output('{"city": "Ro', tools, named)  # stopped by max_tokens
    assert cut.tool_calls == () and cut.content == '{"city": "Ro' and cut.errors
    for choice, out in ((named, '{"city":"Rome",  "days":2}'), ("required", text)):
        stream = ForcedToolStream(tools, choice)
        first = stream.feed(out[:3])
        if choice is named:  # the name goes out with the first text, before the arguments are complete
            assert first[0].tool_call is not None and first[0].tool_call.name == "get_weather"
        deltas = first + [d for i in range(3, len(out), 3) for d in stream.feed(out[i : i + 3])] + stream.finish()
        streamed, whole = assemble(deltas), parse_forced_output(out, tools, choice)
        assert [(c.name, json.loads(c.arguments)) for c in streamed.tool_calls] == \
            [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
        assert streamed.tool_calls and stream.errors == ()


# ------------------------------------------------------------------------------------ masked sampling
xgr = pytest.importorskip("xgrammar", reason="structured-output enforcement needs xgrammar")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        '{"name": "Paris", "age": 42, "tags": ["a", "b"], "ok": true, "x": null, "unit": "c"}',
        '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}] yes no maybe',
        "abc-123 hello world 0.5e-3 ü ☃",
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=350, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def compiler(tokenizer):  # type: ignore[no-untyped-def]
    from appliance.structured import GrammarCompiler

    # The model's logits are wider than the tokenizer (padded vocab), as with real checkpoints.
    return GrammarCompiler.from_tokenizer(tokenizer, vocab_size=len(tokenizer) + 13, stop_token_ids=[tokenizer.eos_token_id])


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: token characters back to the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    mapping = {chr(b): b for b in printable}
    mapping.update({chr(256 + i): b for i, b in enumerate(extra)})
    return mapping


BYTES = _byte_decoder()


def _generate(compiler, tokenizer, spec: StructuredSpec, seed: int, max_steps: int = 400) -> str:  # type: ignore[no-untyped-def]
    from appliance.structured import GrammarMatcher

    matcher = GrammarMatcher(compiler.compile(spec))
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(compiler.vocab_size, generator=gen) * 3
        matcher.apply_to_logits(logits)
        assert torch.isinf(logits).any()  # something is always masked in this small vocabulary
        token = int(torch.multinomial(torch.softmax(logits, dim=0), 1, generator=gen))
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            assert token == tokenizer.eos_token_id
            raw = bytes(BYTES[ch] for t in tokenizer.convert_ids_to_tokens(ids) for ch in t)
            text = raw.decode("utf-8")  # strict: the grammar must never let invalid UTF-8 through
            assert text == tokenizer.decode(ids)
            return text
        ids.append(token)
    raise AssertionError(f"no termination within {max_steps} tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(16))
def test_json_object_output_parses(compiler, tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(json.loads(_generate(compiler, tokenizer, StructuredSpec.json_object(), seed)), dict)


@pytest.mark.parametrize("seed", range(24))
def test_json_schema_output_validates(compiler, tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    value = json.loads(_generate(compiler, tokenizer, StructuredSpec.json_schema(SCHEMA), seed))
    assert validate(value, SCHEMA) == []


@pytest.mark.parametrize("seed", range(8))
def test_regex_output_matches(compiler, tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    pattern = r"[a-c]{2,4}-\d{3}(\.[xy])?"
    assert re.fullmatch(pattern, _generate(compiler, tokenizer, StructuredSpec.regex(pattern), seed))


@pytest.mark.parametrize("seed", range(8))
def test_choice_output_is_a_choice(compiler, tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    choices = ["yes", "no", 'say "hi"\\n', "ü ☃", "no way"]
    assert _generate(compiler, tokenizer, StructuredSpec.choice(choices), seed) in choices


@pytest.mark.parametrize("seed", range(4))
def test_ebnf_grammar_output_matches(compiler, tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    grammar = 'root ::= item (", " item)*\nitem ::= "a" | "b" [0-9]'
    assert re.fullmatch(r"(a|b\d)(, (a|b\d))*", _generate(compiler, tokenizer, StructuredSpec.grammar(grammar), seed))


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_forces_valid_calls(compiler, tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    tools = ToolSet(TOOLS)
    spec = forced_tool_spec(tools, "required")
    parsed = parse_forced_output(_generate(compiler, tokenizer, spec, seed), tools, "required")
    assert parsed.errors == () and parsed.tool_calls
    assert all(c.name in ("get_weather", "get_time") for c in parsed.tool_calls)


def test_compile_once_per_spec(compiler) -> None:  # type: ignore[no-untyped-def]
    before = compiler.cache_info()
    spec = StructuredSpec.regex(r"z{1,3}q")
    first = compiler.compile(spec)
    assert compiler.compile(StructuredSpec.regex(r"z{1,3}q")) is first
    after = compiler.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)


def test_bad_specs_fail_the_request_only(compiler) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StructuredOutputError, match="cannot compile the regex"):
        compiler.compile(StructuredSpec.regex("(unclosed"))
    with pytest.raises(StructuredOutputError, match="cannot compile the grammar"):
        compiler.compile(StructuredSpec.grammar("root ::= undefined_rule"))
    assert compiler.compile(StructuredSpec.regex("ok")) is not None  # the compiler still works


def test_matcher_masks_and_rejects(compiler, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from appliance.structured import GrammarMatcher

    matcher = GrammarMatcher(compiler.compile(StructuredSpec.choice(["yes", "no"])))
    allowed = set(matcher.allowed_token_ids())
    decoded = {tokenizer.decode([i]) for i in allowed}
    assert decoded and all("yes".startswith(t) or "no".startswith(t) for t in decoded)
    logits = torch.zeros(compiler.vocab_size)
    matcher.apply_to_logits(logits)
    assert set(torch.nonzero(logits == 0).flatten().tolist()) == allowed
    bad = tokenizer.convert_tokens_to_ids("x") if "x" in tokenizer.get_vocab() else next(iter(set(range(256)) - allowed))
    assert not matcher.accept_token(bad)
    assert not matcher.accept_token(compiler.vocab_size + 5)
    with pytest.raises(ValueError, match="columns"):
        matcher.apply_to_logits(torch.zeros(5))


def test_choice_ebnf_escapes() -> None:
    assert choice_ebnf(['a"b', "c\\d", "e\nf"]) == 'root ::= "a\\"b" | "c\\\\d" | "e\\x0af"'


def test_apply_batch_matches_per_row(compiler) -> None:  # type: ignore[no-untyped-def]
    from appliance.structured import GrammarMatcher, apply_batch

    a = GrammarMatcher(compiler.compile(StructuredSpec.choice(["yes", "no"])))
    b = GrammarMatcher(compiler.compile(StructuredSpec.json_object()))
    logits = torch.randn(3, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    a.apply_to_logits(expected[0])
    b.apply_to_logits(expected[2])
    apply_batch(logits, [a, None, b])
    assert torch.equal(logits, expected)
    assert not torch.isinf(logits[1]).any() and torch.isinf(logits[0]).any() and torch.isinf(logits[2]).any()
    with pytest.raises(ValueError, match="expected logits"):
        apply_batch(logits, [a, b])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masking_on_cuda_matches_cpu(compiler) -> None:  # type: ignore[no-untyped-def]
    from appliance.structured import GrammarMatcher, apply_batch

    a = GrammarMatcher(compiler.compile(StructuredSpec.json_schema(SCHEMA)))
    b = GrammarMatcher(compiler.compile(StructuredSpec.regex(r"[a-c]+")))
    for dtype in (torch.float32, torch.bfloat16):
        cpu = torch.randn(3, compiler.vocab_size, generator=torch.Generator().manual_seed(1)).to(dtype)
        gpu = cpu.cuda()
        apply_batch(cpu, [a, None, b])
        apply_batch(gpu, [a, None, b])
        assert torch.equal(gpu.cpu(), cpu)
        row = cpu[0].clone().normal_()
        assert torch.equal(a.apply_to_logits(row.clone().cuda()).cpu(), a.apply_to_logits(row.clone()))
