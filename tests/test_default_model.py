"""The embedded default model (appliance/assets/default_model): the shipped files, the tokenizer, and parity of
our engine's greedy output with transformers'. Built by tools/train_default_model.py; see docs/default_model.md."""
from __future__ import annotations

import ast
import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import appliance

MODEL_DIR = Path(appliance.__file__).resolve().parent / "assets" / "default_model"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    def push(self, item):"]
MAX_SAFETENSORS_BYTES = 25_000_000
SPECIAL = {"<|pad|>": 0, "<|startoftext|>": 1, "<|endoftext|>": 2, "<|im_start|>": 3, "<|im_end|>": 4}


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()


def test_shipped_files_are_a_small_float32_llama() -> None:
    from safetensors import safe_open

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (MODEL_DIR / name).is_file(), name
    weights = MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= MAX_SAFETENSORS_BYTES
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    with safe_open(str(weights), "pt") as f:
        names = list(f.keys())
        dtypes = {f.get_slice(n).get_dtype() for n in names}
        n_params = sum(f.get_tensor(n).numel() for n in names)
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in names  # tied: the engine must reuse embed_tokens
    assert 1_000_000 <= n_params <= 20_000_000


def test_transformers_loads_it_and_ties_the_head(hf_model: Any) -> None:
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    logits = hf_model(torch.tensor([[1, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, hf_model.config.vocab_size) and torch.isfinite(logits).all()


def test_special_tokens_and_bos(hf_tokenizer: Any) -> None:
    for token, token_id in SPECIAL.items():
        assert hf_tokenizer.convert_tokens_to_ids(token) == token_id
    assert (hf_tokenizer.bos_token, hf_tokenizer.eos_token, hf_tokenizer.pad_token) == (
        "<|startoftext|>", "<|endoftext|>", "<|pad|>")
    ids = hf_tokenizer("def f(x):").input_ids
    assert ids[0] == 1 and 1 not in ids[1:]
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {2, 4}  # <|im_end|> ends a chat turn


@pytest.mark.parametrize("text", [
    inspect.getsource(ast),  # stdlib source, as trained on
    Path(__file__).read_text(),
    "\tmixed \t tabs\r\nand CRLF\n\n\n   trailing   ",
    "unicode: héllo wörld — ∑ 😀 中文",
    "",
])
def test_tokenizer_round_trips_source(hf_tokenizer: Any, text: str) -> None:
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert hf_tokenizer.decode(ids) == text
    if len(text) > 1000:  # the BPE actually compresses Python (it is not falling back to bytes)
        assert len(text.encode()) / len(ids) > 2.5


def test_chat_template(hf_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|startoftext|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert ids[:2] == [1, 3] and ids.count(3) == 3 and ids.count(4) == 2


def _hf_greedy(model: Any, tokenizer: Any, prompt: str, max_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_engine_greedy_matches_transformers(hf_model: Any, hf_tokenizer: Any) -> None:
    from appliance import LLM, SamplingParams

    llm = LLM(model=str(MODEL_DIR), dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32))
    for prompt, out in zip(PROMPTS, outs):
        expected = _hf_greedy(hf_model, hf_tokenizer, prompt, 32)
        assert list(out.outputs[0].token_ids) == expected, prompt
    assert len(expected) > 0


def test_samples_mostly_parse(hf_model: Any, hf_tokenizer: Any) -> None:
    """The shipped model writes Python: most sampled bodies of `def fibonacci(n):` parse (see the docs for the
    fraction over 20 samples; 8 here keep the test fast)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "train_default_model", Path(__file__).resolve().parents[1] / "tools" / "train_default_model.py")
    if spec.name not in sys.modules:
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up there
        spec.loader.exec_module(sys.modules[spec.name])
    tool = sys.modules[spec.name]
    first_block, parses = tool.first_block, tool.parses

    prompt = "def fibonacci(n):"
    ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
    torch.manual_seed(0)
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=96, do_sample=True, temperature=0.8, top_k=0,
                                num_return_sequences=8)
    texts = [prompt + hf_tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True) for row in out]
    assert sum(parses(first_block(t)) for t in texts) >= 5, texts
