"""Weight loading: formats, sharded checkpoints, dummy weights, dtypes, hf_overrides, local HF cache, errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config import build_config
from appliance.executor.model_loader import ModelNotFound
from appliance.executor.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [40, 41]]


def _tokens(path, **kw):
    llm = LLM(model=str(path), dtype="float32", max_total_tokens=512, skip_tokenizer_init=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _runner(path, **flat):
    return ModelRunner(build_config(flat=dict(model=str(path), max_total_tokens=256, **flat), env={}))


@pytest.fixture(scope="module")
def reference(tiny_model):
    return _tokens(tiny_model)


def _resave(tiny_model, out, **save_kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model.save_pretrained(str(out), **save_kwargs)
    return out


def test_sharded_safetensors(tiny_model, tmp_path, reference):
    out = _resave(tiny_model, tmp_path / "sharded", max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert _tokens(out) == reference


def test_pytorch_bin_and_load_format(tiny_model, tmp_path, reference):
    out = tmp_path / "bin"
    shutil.copytree(tiny_model, out)
    state = {k: v for k, v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(out / "model.safetensors")).items()}
    (out / "model.safetensors").unlink()
    torch.save(state, out / "pytorch_model.bin")
    assert _tokens(out) == reference
    assert _tokens(out, load_format="pt") == reference
    with pytest.raises(ModelNotFound, match="safetensors"):
        _tokens(out, load_format="safetensors")


def test_tied_checkpoint_has_no_lm_head(make_tiny_model):
    runner = _runner(make_tiny_model("qwen2"), dtype="float32")  # tie_word_embeddings=True
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight


def test_missing_tensor_is_an_error(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "partial"
    shutil.copytree(tiny_model, out)
    state = load_file(str(out / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj"):
        _runner(out)


def test_dummy_weights_need_only_config(tiny_model, tmp_path):
    out = tmp_path / "config_only"
    out.mkdir()
    shutil.copy(tiny_model / "config.json", out / "config.json")
    toks = _tokens(out, load_format="dummy")
    assert all(len(t) == 6 for t in toks)


def test_dtypes_and_overrides(tiny_model):
    assert _runner(tiny_model, dtype="bfloat16").model.model.embed_tokens.weight.dtype == torch.bfloat16
    auto = _runner(tiny_model)
    assert auto.dtype == torch.float32 and auto.max_model_len == 512
    over = _runner(tiny_model, hf_overrides={"max_position_embeddings": 128})
    assert over.max_model_len == 128 and over.hf_config.max_position_embeddings == 128
    with pytest.raises(ValueError, match="max_model_len"):
        _runner(tiny_model, max_model_len=100000)


def test_kv_cache_sizing(tiny_model):
    r = _runner(tiny_model, block_size=8)
    assert r.num_blocks == 256 // 8
    k, v = r.kv_caches[0]
    assert k.shape == (32, 8, 2, 16) and v.shape == k.shape
    cpu_default = ModelRunner(build_config(flat={"model": str(tiny_model), "max_num_seqs": 4}, env={}))
    assert cpu_default.num_blocks == 4 * (512 // 16)  # every sequence at full length fits under the CPU bound


def test_local_hf_cache_resolution(tiny_model, tmp_path, reference):
    commit = "a" * 40
    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert _tokens("acme/tiny", download_dir=str(tmp_path / "hub")) == reference
    assert _tokens("acme/tiny", download_dir=str(tmp_path / "hub"), revision=commit) == reference
    with pytest.raises(ModelNotFound, match="refs"):
        _tokens("acme/tiny", download_dir=str(tmp_path / "hub"), revision="v2")
    with pytest.raises(ModelNotFound, match=str(tmp_path / "hub" / "models--acme--absent")):
        _tokens("acme/absent", download_dir=str(tmp_path / "hub"))


def test_unsupported_architecture(tiny_model, tmp_path):
    out = tmp_path / "gpt"
    shutil.copytree(tiny_model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        _runner(out)


@pytest.mark.parametrize("flat, match", [
    ({"kv_cache_dtype": "nvfp4"}, "kv_cache_dtype"),
    ({"quantization": "awq"}, "quantization"),
    ({"sampling_backend": "flashinfer"}, "sampling"),
    ({"attention_backend": "flashinfer"}, "attention"),
])
def test_settings_this_executor_cannot_honour_are_errors(tiny_model, flat, match):
    with pytest.raises(ValueError, match=match):
        _runner(tiny_model, **flat)
