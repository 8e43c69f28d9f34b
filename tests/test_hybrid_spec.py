"""Speculative decoding on hybrid linear-attention models is refused at start-up with a clear message: a
verification advances the recurrent state over every draft, so a rejected draft would corrupt it."""
from __future__ import annotations

import pytest

from appliance import LLM


@pytest.mark.parametrize("algorithm", ["NGRAM", "MTP"])
def test_speculation_on_a_hybrid_model_is_refused(algorithm: str, make_tiny_model) -> None:
    path = make_tiny_model("qwen3_next")
    with pytest.raises(ValueError, match="not supported for hybrid linear-attention models"):
        LLM(model=str(path), dtype="float32", block_size=4, skip_tokenizer_init=True,
            speculative_algorithm=algorithm, speculative_num_steps=2)
