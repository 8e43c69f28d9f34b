"""Shared fixtures: tiny random-weight HF models and a tiny byte-level BPE tokenizer, built on the fly.

    def test_x(tiny_model):                      # a llama checkpoint dir (config.json, safetensors, tokenizer)
    def test_y(make_tiny_model):
        path = make_tiny_model("qwen3", tie_word_embeddings=True)   # any arch in TINY_ARCHS, config overrides
    def test_z(tiny_tokenizer_dir):              # tokenizer files only (tokenizer.json + tokenizer_config.json)
    def test_w(tokenizer):                       # that tokenizer loaded as the server loads it (per module)

Models are cached per session by (arch, overrides), weights are float32 and deterministic (torch.manual_seed),
the vocabulary (TINY_VOCAB) covers the tokenizer's, and every model dir also holds the tokenizer files and a
generation_config.json, so `LLM(model=path)` and `AutoTokenizer.from_pretrained(path)` both work.
"""
from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")

TINY_VOCAB = 384
TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "Café, naïve, déjà vu, piñata: accents everywhere.",
    "中文字符测试，你好世界。日本語のテキストです。",
    "Emoji time 🙂🚀🎉 and more 🙂 smiles.",
    "def main():\n    return 42\n",
    "Numbers 0123456789 and symbols #$%&*()[]{}<>",
]
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]

# arch name -> (transformers config class, model class, config kwargs beyond the shared tiny shape)
TINY_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    # hybrid: linear-attention (Gated DeltaNet) layers 0 and 2, full attention 1 and 3; MoE + shared expert,
    # layer 2 dense; a 16-token delta-rule chunk is set by the tests that need chunks shorter than a prompt
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "mlp_only_layers": [2],
        "norm_topk_prob": True}),
    # Qwen3.5 text, dense and MoE: the same layer pattern with Qwen3.5's separate linear-attention projections
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32}),
}


TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_tool(name: str) -> Any:
    """tools/<name>.py imported as a module (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_tiny_tokenizer(out_dir: Path) -> Path:
    """Train a byte-level BPE (multi-byte characters split across tokens) and save it in HF layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TINY_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def build_tiny_model(arch: str, out_dir: Path, tokenizer_dir: Path | None = None, seed: int = 0,
                     **overrides: Any) -> Path:
    """Save a random-weight float32 model of family `arch` (see TINY_ARCHS) with `overrides` on its config."""
    import shutil

    import torch
    import transformers

    cfg_cls, model_cls, extra = TINY_ARCHS[arch]
    kwargs: dict[str, Any] = {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "initializer_range": 0.1,
                                  "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False}
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, out_dir / f.name)
    return out_dir


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path) -> Any:
    """The tiny tokenizer as the server loads it (appliance.tokenization.load_tokenizer)."""
    from appliance.tokenization import load_tokenizer

    return load_tokenizer(str(tiny_tokenizer_dir))


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (pytest.mark.anyio) run on asyncio."""
    return "asyncio"


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory,
                    tiny_tokenizer_dir: Path) -> Callable[..., Path]:
    """Factory: make_tiny_model(arch="llama", seed=0, **config_overrides) -> model dir (cached per session)."""
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = repr((arch, seed, sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[key] = build_tiny_model(arch, out, tiny_tokenizer_dir, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(make_tiny_model: Callable[..., Path]) -> Path:
    """The default tiny llama checkpoint dir."""
    return make_tiny_model("llama")


def hf_greedy_reference(model_dir: Path, prompts: list[list[int]],
                        max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy `generate` per prompt (unbatched, EOS ignored): (new tokens, their raw logprobs)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                                 pad_token_id=2)
        toks = gen.sequences[0, len(ids):].tolist()
        lps = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, toks)]
        out.append((toks, lps))
    return out


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[..., list[tuple[list[int], list[float]]]]:
    """hf_greedy(model_dir, prompts, max_new_tokens) -> [(tokens, logprobs)] from transformers, per prompt."""
    return hf_greedy_reference


_GPU_LEFT: list[tuple[str, float]] = []  # (test, GiB it left allocated): engines a GPU test did not let go


@pytest.fixture(autouse=True)
def _gpu_memory_left(request: pytest.FixtureRequest) -> Any:
    """GPU tests share one process: one that keeps an engine alive shrinks every later test's memory. Records
    what each leaves allocated once collected (pytest_terminal_summary lists it)."""
    torch = sys.modules.get("torch")
    if request.node.get_closest_marker("gpu") is None or torch is None or not torch.cuda.is_available():
        yield
        return
    gc.collect()
    before = torch.cuda.memory_allocated()
    yield
    gc.collect()
    left = (torch.cuda.memory_allocated() - before) / 2**30
    if left > 0.25:
        _GPU_LEFT.append((request.node.nodeid, round(left, 2)))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for nodeid, gib in _GPU_LEFT:
        terminalreporter.write_line(f"GPU memory left allocated: {gib} GiB after {nodeid}")
