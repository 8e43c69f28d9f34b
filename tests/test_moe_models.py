"""Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3 (CPU, float32, tiny random weights): greedy tokens
and logprobs through `LLM` equal transformers' greedy `generate`, with prefix caching on (second pass hits the
cache) and off with chunked prefill (decode + prefill chunks over a cached prefix in one step). DeepSeek-V2's
group-limited routing is checked against transformers' router in test_moe_kernels."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.kernels import registry as kernel_registry
from appliance.models import registry

TINY: dict[str, Any] = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                            "num_attention_heads": 4, "max_position_embeddings": 512, "tie_word_embeddings": False,
                            "initializer_range": 0.1, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
MLA: dict[str, Any] = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                           "moe_intermediate_size": 32}
# DeepSeek-V2-Lite's and V3's YaRN settings (mscale differs), on a short original context
YARN_V2 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
           "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
YARN_V3 = {**YARN_V2, "mscale": 1.0, "mscale_all_dim": 1.0}

# name -> (config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "head_dim": 32, "norm_topk_prob": True}),
    # V2: plain q_proj, greedy routing, YaRN, one leading dense layer, routed_scaling_factor
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(MLA, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=1, routed_scaling_factor=1.5, rope_parameters=YARN_V2)),
    # V3: sigmoid + correction bias + group top-k, norm_topk_prob, interleaved rope, YaRN
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(MLA, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=4, topk_group=2, rope_parameters=YARN_V3,
                         num_nextn_predict_layers=0)),
    # GLM-4.5: q/k/v bias without o bias, q/k norm, half the head rotated, V3 routing over 2 of 4 groups + shared
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {"num_key_value_heads": 2, "head_dim": 32, "attention_bias": True, "use_qk_norm": True,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                  "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5,
                  "num_nextn_predict_layers": 0}),
    # MiniMax-M2: q/k norm over all heads, a quarter of each head rotated, sigmoid routing with a correction bias
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   {"num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                    "intermediate_size": 32, "rotary_dim": 8}),
}

SHARED = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41]
PROMPTS = [[5, 6, 7, 8, 9], SHARED + [50, 51, 52, 53, 54, 55, 56, 57, 58], [90] * 3 + list(range(100, 126)),
           SHARED + [60, 61]]
NEW = 6
SETUPS = [
    ("prefix_on", {"enable_prefix_caching": True, "chunked_prefill_size": 8192}),
    ("prefix_off_chunk16", {"enable_prefix_caching": False, "chunked_prefill_size": 16}),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run much faster on one thread (two spin-waiting OpenMP threads on a busy 2-core CI machine
    cost up to 50x); restored afterwards so other modules keep their setting. Autouse in every test module that
    imports it (the shared helper modules do too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_family(family: str, out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():  # transformers starts the V3 bias at zero; make it matter
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn_like(bias) * 0.1)
    model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in cache:
            cache[family] = build_family(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return make


def run_greedy(path: Path, **overrides: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(model=str(path), dtype="float32", block_size=4, skip_tokenizer_init=True, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    return llm, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)


def assert_matches(outs: list[Any], refs: list[tuple[list[int], list[float]]], label: str) -> None:
    for out, (ref_tokens, ref_lps) in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, (label, out.prompt_token_ids)
        ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert ours == pytest.approx(ref_lps, abs=2e-4), label


def test_kimi_k2_checkpoint_layout_loads(tmp_path: Path, hf_greedy) -> None:
    """Kimi-K2 ships DeepSeek-V3 weights under model_type kimi_k2 with remote code (auto_map), which transformers
    will not read without trust_remote_code: it loads as DeepseekV3 (K2's routing: one group, scaling 2.827) and
    matches transformers' DeepseekV3 on the same weights."""
    import json
    import shutil

    v3 = build_family("deepseek_v3", tmp_path / "v3", n_group=1, topk_group=1, routed_scaling_factor=2.827)
    kimi = tmp_path / "kimi"
    shutil.copytree(v3, kimi)
    config = json.loads((kimi / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (kimi / "config.json").write_text(json.dumps(config))
    refs = hf_greedy(v3, PROMPTS, NEW)
    llm, outs = run_greedy(kimi, chunked_prefill_size=16)
    assert type(llm.executor.runner.model).__name__ == "DeepseekV3ForCausalLM"
    assert_matches(outs, refs, "kimi_k2")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family: str, family_dir, hf_greedy) -> None:
    path = family_dir(family)
    refs = hf_greedy(path, PROMPTS, NEW)
    for name, overrides in SETUPS:
        llm, outs = run_greedy(path, **overrides)
        assert_matches(outs, refs, f"{family}/{name}")
        if overrides["enable_prefix_caching"]:
            again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                 SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1))
            assert sum(o.num_cached_tokens for o in again) > 0
            assert_matches(again, refs, f"{family}/{name}/cached")
        assert llm.engine.check_accounting().ok


def test_decode_chain_stays_off_for_moe_families(family_dir) -> None:
    """The fused decode chain (layers/decode_chain.py) serves dense layers only: each family's model, with every
    projection bound to a GEMV as on a GPU, declines it with a reason and keeps running its own layers."""
    from appliance.kernels.registry import get
    from appliance.layers import decode_chain

    for family in FAMILIES:
        llm = LLM(model=str(family_dir(family)), dtype="float32", block_size=4, skip_tokenizer_init=True)
        model = llm.executor.runner.model
        for module in model.modules():
            if hasattr(module, "gemv"):
                module.gemv = get("gemv", "torch")
        assert decode_chain.unserved_reason(model.model, "torch"), family
        assert not model.model.use_decode_chain("torch") and model.model.chain is None, family
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2


def test_mla_cache_holds_latents_only(family_dir) -> None:
    """The MLA layers ask for one kv head of kv_lora_rank + rope dims: the compressed cache."""
    llm, _ = run_greedy(family_dir("deepseek_v3"))
    runner = llm.executor.runner
    layers = runner.model.attention_layers()
    assert {(a.num_kv_heads, a.head_dim) for a in layers} == {(1, MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"])}
    assert all(a.k_cache is not None and a.k_cache.shape[-2:] == (1, 40) for a in layers)
    assert runner.kv_spec.num_tensors == 1 and all(v is None for _, v in runner.kv_caches)  # no V cache at all


def test_moe_backend_setting_reaches_the_experts(family_dir) -> None:
    from appliance.layers.moe import FusedMoE, resolve_moe_backend

    assert resolve_moe_backend("auto", "torch") == "torch"
    with pytest.raises(ValueError, match="backends.moe"):
        resolve_moe_backend("bogus", "torch")
    pytest.importorskip("triton")
    llm = LLM(model=str(family_dir("qwen3_moe")), dtype="float32", skip_tokenizer_init=True, moe_backend="triton")
    experts = [m for m in llm.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m._op is kernel_registry.get("fused_moe", "triton") for m in experts)
    assert llm.executor.runner.model.supports_cuda_graphs  # the Triton MoE path never syncs with the host
    torch_moe = LLM(model=str(family_dir("deepseek_v3")), dtype="float32", skip_tokenizer_init=True)
    assert not torch_moe.executor.runner.model.supports_cuda_graphs  # the torch references do


def test_registry_lists_every_family() -> None:
    for _, model_cls, _ in FAMILIES.values():
        assert registry.MODELS[model_cls].__name__ == model_cls


def test_unsupported_router_method_is_an_error(tmp_path: Path) -> None:
    path = build_family("deepseek_v2", tmp_path / "m")
    with pytest.raises(ValueError, match="topk_method"):
        LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, hf_overrides={"topk_method": "bogus"})
