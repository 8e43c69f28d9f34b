"""Incremental detokenization (multi-byte characters split across tokens) and stop strings spanning tokens."""
from __future__ import annotations

import pytest

from appliance.tokenization import Detokenizer, load_tokenizer

TEXTS = ["Café, naïve, déjà vu!", "中文字符测试，你好世界。", "Emoji time 🙂🚀🎉 and more", "Hello world! How are you?"]


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(str(tiny_tokenizer_dir))


def _stream(detok: Detokenizer, ids: list[int]) -> list[str]:
    return [detok.update([t]) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_without_replacement_halves(tok, text):
    prompt = tok("Prompt: ").input_ids
    ids = tok(text).input_ids
    detok = Detokenizer(tok, prompt)
    deltas = _stream(detok, ids)
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)


def test_some_character_really_is_split_across_tokens(tok):
    # guards the test above: the tiny BPE must split at least one multi-byte character
    ids = tok("🙂🚀🎉 中文").input_ids
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)


def test_stop_string_spanning_tokens_is_cut(tok):
    ids = tok("Hello world! How are you?").input_ids
    detok = Detokenizer(tok, stop=["lo wor"])
    out = "".join(_stream(detok, ids))
    assert detok.finished and detok.stop_reason == "lo wor"
    assert out == "Hel" and detok.text == "Hel"
    assert detok.update(tok(" more").input_ids) == ""  # nothing after the stop


def test_include_stop_str_in_output(tok):
    ids = tok("Hello world! How are you?").input_ids
    detok = Detokenizer(tok, stop=["world"], include_stop_str_in_output=True)
    assert "".join(_stream(detok, ids)) == "Hello world"


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok("The quick brown fox jumps").input_ids
    detok = Detokenizer(tok, stop=["fox", "quick"])
    assert "".join(_stream(detok, ids)) == "The "
    assert detok.stop_reason == "quick"


def test_partial_stop_match_is_held_back_then_released(tok):
    ids = tok("Hello there the end").input_ids
    detok = Detokenizer(tok, stop=["the end!"])
    emitted = ""
    for t in ids:
        emitted += detok.update([t])
        # never shows a tail that could still turn into the stop string
        assert len(emitted) <= max(0, len(detok.text) - (len("the end!") - 1))
    assert not detok.finished
    assert emitted + detok.flush() == "Hello there the end"


def test_min_tokens_defers_stop_strings(tok):
    ids = tok("ab ab ab").input_ids
    detok = Detokenizer(tok, stop=["ab"], min_tokens=len(ids))
    text = "".join(_stream(detok, ids)) + detok.flush()
    # like vLLM, text produced before min_tokens is never searched: only the last "ab" stops
    assert detok.stop_reason == "ab"
    assert text == "ab ab "


def test_multi_token_update_equals_token_by_token(tok):
    ids = tok("中文 and 🙂 Hello world").input_ids
    one = Detokenizer(tok, stop=["world"])
    many = Detokenizer(tok, stop=["world"])
    assert "".join(_stream(one, ids)) == many.update(ids)
    assert one.text == many.text


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError):
        Detokenizer(tok, stop=[""])
