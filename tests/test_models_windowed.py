"""Gemma 3 and gpt-oss (CPU, float32, tiny random weights): greedy tokens and logprobs through `LLM` equal
transformers' with prefix caching (a second pass hits the cache), 16-token chunked prefill and preemption, on
configs whose sliding window (6 tokens) is shorter than most prompts, with both layer kinds, attention sinks and
random norms / biases; gpt-oss also from an MXFP4 checkpoint in the layout it ships in. The window and sink
arguments of the torch attention ops are checked against a dense computation."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_vs_transformers import NEW, PROMPTS, SETUPS, each_setup_matching, greedy_params
from test_moe_models import (
    one_thread,  # noqa: F401  (autouse: one torch thread in this module)
)

from appliance.kernels import mxfp4
from appliance.kernels.reference.attention import decode_attention, prefill_attention
from appliance.models import registry

WINDOW = 6
TINY: dict[str, Any] = {"vocab_size": 384, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 16, "max_position_embeddings": 512, "initializer_range": 0.1, "rms_norm_eps": 1e-6,
                        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "sliding_window": WINDOW}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # local and global layers with their own rotary (linear scaling on the global one), tied embeddings
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "intermediate_size": 128, "num_hidden_layers": 3, "query_pre_attn_scalar": 24, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}}),
    # alternating banded / full layers with sinks, YaRN on a short original context, top-2 of 4 experts with a
    # SwiGLU clamp the random activations reach
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "intermediate_size": 32, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "swiglu_limit": 0.5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0}}),
}


# layer counts the shared pool does not take (three sliding layers to two full ones): separate pools
OTHER_SHAPES = {"gemma3_uneven": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
    **FAMILIES["gemma3"][2], "num_hidden_layers": 5, "layer_types": ["sliding_attention", "full_attention"] * 2
    + ["sliding_attention"]})}

# the preemption setup's cache as the memory of fewer tokens at every layer than SETUPS' 64: the sliding layers
# keep only their window and share the full layers' pool (executor/window_groups.py), so 64 tokens' worth holds
# the whole batch; each is the least that holds one max_model_len sequence in every group
PREEMPT_TOKENS = {"gemma3": 40, "gpt_oss": 48}


def windowed_setups(family: str) -> list[tuple[str, dict]]:
    return [(name, {**o, "max_total_tokens": PREEMPT_TOKENS[family]} if "max_total_tokens" in o else o)
            for name, o in SETUPS]


def build_family(family: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random model whose norms, sinks and biases are random too (transformers starts them at 0 or 1), with
    gpt-oss's expert weights rounded to MXFP4 values so the float and MXFP4 checkpoints hold the same model."""
    import transformers

    cfg_cls, model_cls, extra = {**FAMILIES, **OTHER_SHAPES}[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**TINY, **extra})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("sinks", "bias")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(mxfp4.dequantize(*mxfp4.quantize(param.transpose(1, 2))).transpose(1, 2))
    model.save_pretrained(str(out_dir))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    return out_dir


def to_mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """gpt-oss as shipped: every expert matrix as `<proj>_blocks` / `<proj>_scales` in the checkpoint's output x
    input orientation, and quantization_config naming mxfp4."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    cache: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in cache:
            if family == "gpt_oss_mxfp4":
                cache[family] = to_mxfp4_checkpoint(make("gpt_oss"), tmp_path_factory.mktemp("x") / "mxfp4")
            else:
                cache[family] = build_family(family, tmp_path_factory.mktemp(family), tiny_tokenizer_dir)
        return cache[family]

    return make


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family: str, family_dir, hf_greedy) -> None:

    path = family_dir(family)
    refs = hf_greedy(path, PROMPTS, NEW)
    assert max(len(p) for p in PROMPTS) > 4 * WINDOW  # the window hides most of the longest prompt
    for name, overrides, llm in each_setup_matching(path, refs, setups=windowed_setups(family)):
        stats = llm.engine.stats()
        if name.startswith("preempt"):
            assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
        elif overrides["enable_prefix_caching"]:
            again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params())
            assert [o.outputs[0].token_ids for o in again] == [r[0] for r in refs]
            assert sum(o.num_cached_tokens for o in again) > 0
        assert llm.engine.check_accounting().ok
        layers = llm.executor.runner.model.attention_layers()
        assert {a.sliding_window for a in layers} == {WINDOW, None}, "both layer kinds"
        # the sliding layers keep their window, in groups as large as the full group's that share its pool
        # (executor/window_groups.py): the layers at one position of their groups share their K/V tensors
        layout = llm.executor.runner.kv_layout
        groups = sum(a.sliding_window is not None for a in layers) // sum(a.sliding_window is None for a in layers)
        assert layout.shared and llm.engine.config.window_shared
        assert llm.engine.config.window_sizes == layout.window_sizes == (WINDOW,) * groups
        assert {a.kv_group for a in layers if a.sliding_window} == set(range(1, groups + 1))
        assert {a.kv_group for a in layers if a.sliding_window is None} == {0}
        at = layout.positions(len(layers))
        ptrs = {(at[i], a.kv_cache()[0].data_ptr()) for i, a in enumerate(layers)}
        assert len(ptrs) == len(set(at)) == len(layers) // (groups + 1)


def test_separate_pools_where_the_groups_cannot_share_one(family_dir, hf_greedy) -> None:
    """Three sliding layers and two full ones do not make groups of one size: the sliding layers keep their
    window in a pool of their own, split from the budget at start-up, and the tokens are the same."""
    from appliance import LLM

    path = family_dir("gemma3_uneven")
    refs = hf_greedy(path, PROMPTS, NEW)
    llm = LLM(model=str(path), dtype="float32", block_size=4, chunked_prefill_size=16)
    layout = llm.executor.runner.kv_layout
    assert not layout.shared and layout.window_sizes == llm.engine.config.window_sizes == (WINDOW,)
    assert 1 < layout.window_blocks[0] < layout.num_blocks and not llm.engine.config.window_shared
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params())
        assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]
    assert llm.engine.check_accounting().ok


def test_one_pool_where_the_groups_do_not_apply_yet(family_dir, hf_greedy) -> None:
    """With the host KV tier the sliding layers keep the whole context in the shared pool, as before the groups,
    and the tokens are the same."""
    from appliance import LLM

    path = family_dir("gemma3")
    refs = hf_greedy(path, PROMPTS, NEW)
    llm = LLM(model=str(path), dtype="float32", block_size=4, chunked_prefill_size=16, host_cache=True)
    assert llm.executor.runner.kv_layout.groups == () and llm.engine.config.window_sizes == ()
    assert {a.kv_group for a in llm.executor.runner.model.attention_layers()} == {0}
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params())
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]


def test_mxfp4_checkpoint_loads_as_shipped(family_dir, hf_greedy) -> None:
    """The MXFP4 checkpoint (blocks + scales) gives the tokens transformers gives on the same values in float."""
    from appliance import LLM

    refs = hf_greedy(family_dir("gpt_oss"), PROMPTS, NEW)
    llm = LLM(model=str(family_dir("gpt_oss_mxfp4")), dtype="float32", block_size=4, chunked_prefill_size=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params())
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]
    experts = llm.executor.runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float32 and experts.w13_weight.abs().sum() > 0


def test_mxfp4_dequantize_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    w = torch.randn(3, 16, 64) * 4
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 16, 2, 16) and scales.shape == (3, 16, 2)
    ours = mxfp4.dequantize(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transposed: [E, K, N]
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert (ours - w).abs().max() <= w.abs().amax() / 6  # within half of the coarsest step
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(blocks.int(), scales)


def test_registry_and_context_length(family_dir) -> None:
    """Both classes are registered and, since they apply their windows, max_model_len is not capped at it."""
    from appliance import LLM

    assert registry.MODELS["Gemma3ForCausalLM"].__name__ == "Gemma3ForCausalLM"
    assert registry.MODELS["GptOssForCausalLM"].__name__ == "GptOssForCausalLM"
    llm = LLM(model=str(family_dir("gemma3")), dtype="float32", skip_tokenizer_init=True)
    assert llm.executor.runner.max_model_len == TINY["max_position_embeddings"] > WINDOW


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of the last len(q) positions over k/v [L, H, D] (one kv head per head), written out by hand."""
    length, scale, out = k.shape[0], q.shape[-1] ** -0.5, torch.empty_like(q)
    for i in range(q.shape[0]):
        p = length - q.shape[0] + i
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(q.shape[1]):
            s = [float(q[i, h] @ k[j, h]) * scale for j in range(lo, p + 1)]
            m = max(s + ([float(sinks[h])] if sinks is not None else []))
            e = [math.exp(x - m) for x in s]
            z = sum(e) + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
            out[i, h] = sum(w / z * v[lo + j, h] for j, w in enumerate(e))
    return out


@pytest.mark.parametrize("window", [None, 1, 5, 64])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_window_and_sinks(window: int | None, with_sinks: bool) -> None:
    torch.manual_seed(1)
    length, heads, d, page = 13, 2, 8, 4
    k, v = torch.randn(length, heads, d), torch.randn(length, heads, d)
    q = torch.randn(5, heads, d)
    sinks = torch.randn(heads) if with_sinks else None
    table = torch.tensor([[3, 0, 2, 1]], dtype=torch.int32)  # blocks out of order
    k_cache, v_cache = torch.zeros(4, page, heads, d), torch.zeros(4, page, heads, d)
    for t in range(length):
        k_cache[table[0, t // page], t % page], v_cache[table[0, t // page], t % page] = k[t], v[t]
    want = _dense(q, k, v, window, sinks)
    lens = torch.tensor([length], dtype=torch.int32)
    got = prefill_attention(q, k_cache, v_cache, torch.tensor([0, 5], dtype=torch.int32), lens, table, d**-0.5,
                            sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    one = decode_attention(q[-1:], k_cache, v_cache, table, lens, d**-0.5, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(one, want[-1:], rtol=1e-5, atol=1e-5)


def test_backend_without_window_kernels_is_refused() -> None:
    from appliance.layers.attention import Attention

    with pytest.raises(ValueError, match="sliding-window"):
        Attention(4, 16, 2, 0.25, backend="flashinfer", sliding_window=8)
    with pytest.raises(ValueError, match="at least 1"):
        Attention(4, 16, 2, 0.25, sliding_window=0)


TRITON_SCRIPT = """
import json, sys
import torch
from appliance import LLM, SamplingParams
torch.set_num_threads(1)
sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
prompts = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float32", block_size=4, skip_tokenizer_init=True, attention_backend="triton",
          chunked_prefill_size=16)
assert llm.executor.runner.backend == "triton"
assert getattr(llm.executor.runner.model, "moe_backend", "triton") == "triton"  # gpt-oss: the Triton fused MoE
runs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
        for _ in range(2)]  # the second pass hits the prefix cache
print(json.dumps(runs))
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_backend_matches_transformers_interpreted(family: str, family_dir, hf_greedy) -> None:
    """The Triton store / rope_store_kv / decode / prefill kernels with windows and sinks (and gpt-oss's experts
    in the Triton fused MoE with biases and the clamped SwiGLU), under the interpreter, give transformers' greedy
    tokens, with chunked prefill and a second pass over the prefix cache."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    prompts = [PROMPTS[1], PROMPTS[2]]  # 19 and 29 tokens: both past the window, one chunked
    refs = [t[:4] for t, _ in hf_greedy(family_dir(family), prompts, 4)]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(family_dir(family)), json.dumps(prompts)],
                          env=env, cwd=root, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [refs, refs]


def test_multimodal_gemma3_checkpoint_serves_its_language_model(family_dir, tmp_path: Path, hf_greedy) -> None:
    """A Gemma3ForConditionalGeneration checkpoint (text_config, `language_model.model.*` names, a vision tower)
    loads its language model and gives the text model's tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config

    from appliance import LLM

    text_dir = family_dir("gemma3")
    mm = tmp_path / "mm"
    shutil.copytree(text_dir, mm)
    text = json.loads((text_dir / "config.json").read_text())
    config = Gemma3Config(text_config={k: v for k, v in text.items() if k not in ("architectures", "model_type")},
                          vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                         "num_attention_heads": 2, "image_size": 28, "patch_size": 14})
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(str(mm))
    tensors = {f"language_model.{k}": v for k, v in load_file(str(text_dir / "model.safetensors")).items()}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(32)
    save_file(tensors, str(mm / "model.safetensors"), metadata={"format": "pt"})
    refs = hf_greedy(text_dir, PROMPTS[:3], NEW)
    llm = LLM(model=str(mm), dtype="float32", block_size=4)
    assert type(llm.executor.runner.model).__name__ == "Gemma3ForConditionalGeneration"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], greedy_params())
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]
