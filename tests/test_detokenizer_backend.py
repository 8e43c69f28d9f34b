"""The detokenizer's direct decode through the tokenizers library (tokenization/detokenizer.py backend_decode)
returns what transformers' decode returns, and streams the same text, stop strings and held-back characters."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from appliance.tokenization import Detokenizer, load_tokenizer
from appliance.tokenization.detokenizer import backend_decode

TEXT = "Café, naïve, déjà vu! 中文字符测试 🙂🚀🎉 Hello world, how are you? The end."


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path):
    return load_tokenizer(str(tiny_tokenizer_dir))


def _slow(detok: Detokenizer) -> Detokenizer:
    detok._backend = None  # transformers' decode, as for tokenizers without the direct path
    return detok


@pytest.mark.parametrize("skip", [True, False])
def test_backend_decode_equals_transformers_decode_on_random_ids(tok, skip):
    decode = backend_decode(tok, skip)
    assert decode is not None  # the tiny tokenizer is a fast BPE without clean-up: the direct path applies
    rng = random.Random(0)
    specials = list(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.3 and specials:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        assert decode(ids) == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("stop", [(), ("how are", "🚀"), ("end.",)])
def test_streams_match_with_and_without_the_direct_decode(tok, stop):
    prompt = tok("Prompt: ").input_ids
    rng = random.Random(1)
    for ids in (tok(TEXT).input_ids, [rng.randrange(len(tok)) for _ in range(200)]):
        fast, slow = Detokenizer(tok, prompt, stop=stop), _slow(Detokenizer(tok, prompt, stop=stop))
        assert fast._backend is not None
        i = 0
        while i < len(ids):  # uneven pieces, as merged outputs and speculative steps bring them
            n = rng.randrange(1, 4)
            assert fast.update(ids[i:i + n]) == slow.update(ids[i:i + n])
            assert fast.num_output_tokens == slow.num_output_tokens
            i += n
        assert fast.flush() == slow.flush() and fast.text == slow.text and fast.stop_reason == slow.stop_reason


def test_a_tokenizer_whose_decode_cleans_up_keeps_transformers_decode(tok, monkeypatch):
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    # a BPE model: transformers 5 leaves its text uncleaned unless told to corrupt it
    assert backend_decode(tok, True) is not None
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True,
                        raising=False)
    assert backend_decode(tok, True) is None


def test_other_tokenizers_keep_their_own_decode():
    class Plain:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    assert backend_decode(Plain(), True) is None
    detok = Detokenizer(Plain(), [1, 2])
    assert detok.update([3, 4]) == "xx"
