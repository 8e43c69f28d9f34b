"""Online fp8 KV scale calibration (precision.kv_cache_calibration_tokens) and kv_cache_quant_method: the scales
equal the amax of the first N prefill tokens' keys / values over 448 (a torch reference: the 16-bit model's own
keys and values), they are frozen after, entries stored before a scale grew stay readable, and the outlier model
that saturates at scale 1.0 comes back close to the 16-bit cache; the same for DeepSeek's MLA latent cache (one
scale: the amax of the stored latents).

Run: python -m pytest -q -p no:cacheprovider tests/test_fp8_kv_calibration.py
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config import build_config, check_supported, parse_serve_args
from appliance.executor.kv_calibration import KVCalibration
from appliance.kernels.reference.kv_quant import dequantize, quantize
from appliance.layers.attention import Attention
from appliance.layers.mla import MLAAttention
from tests.test_fp8_kv_cache import (
    COMMON,
    MLA_BOUNDS,
    OUTLIER_BOUND,
    OUTLIER_FLOOR,
    _compare,
    _outliers,
    _prompt_logprobs,
    _stats,
    _variant,
)

E4M3 = torch.float8_e4m3fn
N = 20  # calibration tokens: more than the first chunk (8), fewer than the first prompt (30)
PROMPT = [(7 * i + 3) % 90 + 5 for i in range(30)]


# ---- configuration -------------------------------------------------------------------------------------------
def test_support_list() -> None:
    ok = {"kv_cache_dtype": "fp8"}
    assert not check_supported(build_config(flat={**ok, "kv_cache_calibration_tokens": 64}))
    assert not check_supported(build_config(flat={**ok, "kv_cache_quant_method": "none"}))
    refused = [
        {"kv_cache_calibration_tokens": 64},  # a 16-bit cache has no scales to calibrate
        {**ok, "kv_cache_calibration_tokens": 64, "quantization_param_path": "s.json"},  # two sources
        {**ok, "kv_cache_calibration_tokens": 64, "host_cache": True},
        {**ok, "kv_cache_quant_method": "per_token_head"},
    ]
    for flat in refused:
        msgs = check_supported(build_config(flat=flat))
        assert len(msgs) == 1, (flat, msgs)
    assert "per_token_head" in check_supported(build_config(flat=refused[-1]))[0]
    with pytest.raises(Exception, match="kv_cache_quant_method"):
        build_config(flat={"kv_cache_quant_method": "per_channel"})


def test_flags() -> None:
    for flag in ("--fp8-kv-calibration-tokens", "--kv-cache-calibration-tokens"):
        cfg = parse_serve_args(["m", "--kv-cache-dtype", "fp8", flag, "256", "--kv-cache-quant-method", "none"],
                               env={})
        # TokenSpeed's default `none` reads as unset: the static per-layer scales
        assert (cfg.precision.kv_cache_calibration_tokens, cfg.precision.kv_cache_quant_method) == (256, None)
        assert not check_supported(cfg)


def test_translated_flags() -> None:
    from appliance.translate.translator import translate_text

    def calibration_tokens(text: str) -> object:
        (tr,) = translate_text(text).translations
        return tr.settings["precision.kv_cache_calibration_tokens"].value

    assert calibration_tokens("spark serve m --kv-cache-dtype fp8 --fp8-kv-calibration-tokens 512\n") == 512
    assert calibration_tokens("vllm serve m --kv-cache-dtype fp8 --calculate-kv-scales\n") == 2048


# ---- the running amax and the rescale ------------------------------------------------------------------------
def _layer(blocks: int = 4, block: int = 4) -> Attention:
    layer = Attention(num_heads=2, head_dim=8, num_kv_heads=2, scale=0.35, backend="torch")
    layer.set_kv_scales(torch.ones(2), torch.ones(2))
    layer.bind_kv_cache(*(torch.zeros(blocks, block, 2, 8, dtype=E4M3) for _ in range(2)))
    return layer


def _step(cal: KVCalibration, layer: Attention, k: torch.Tensor, v: torch.Tensor, slots: list[int],
          num_decode: int = 0) -> None:
    """What Attention.forward does: observe, then store at the layer's current scales."""
    meta = SimpleNamespace(num_decode_tokens=num_decode, slot_mapping=torch.tensor(slots))
    cal.observe(layer, k, v, meta)  # type: ignore[arg-type]
    for x, cache, scale in ((k, layer.k_cache, layer.k_scale), (v, layer.v_cache, layer.v_scale)):
        flat = cache.view(-1, 2, 8)
        for row, slot in enumerate(slots):
            if slot >= 0:
                flat[slot] = quantize(x[row : row + 1], scale, E4M3)[0]


def test_scales_grow_and_earlier_entries_are_rescaled() -> None:
    """Three steps: 6 prefill tokens of amax ~3, then a decode row and 4 prefill tokens of amax ~300 (one padding
    row), then more prefill past the window. The scales end at amax / 448 of the 10 counted rows, frozen; the
    first step's entries, stored at the smaller scale, read back within e4m3's rounding of their values."""
    g = torch.Generator().manual_seed(0)
    layer = _layer()
    cal = KVCalibration([layer], tokens=10)
    k1, v1 = torch.randn(6, 2, 8, generator=g), 3 * torch.randn(6, 2, 8, generator=g)
    _step(cal, layer, k1, v1, list(range(6)))
    assert float(layer.v_scale[0]) == pytest.approx(float(v1.abs().max()) / 448)
    dec = 1000 * torch.ones(1, 2, 8)  # a decode row: stored, never counted
    k2, v2 = 100 * torch.randn(5, 2, 8, generator=g), 300 * torch.randn(5, 2, 8, generator=g)
    _step(cal, layer, torch.cat([dec, k2]), torch.cat([dec, v2]), [6, 7, 8, 9, 10, -1], num_decode=1)
    counted_k, counted_v = torch.cat([k1, k2[:4]]), torch.cat([v1, v2[:4]])
    assert cal.done and layer.calibration is None
    want_k, want_v = float(counted_k.abs().max()) / 448, float(counted_v.abs().max()) / 448
    assert torch.allclose(layer.k_scale, torch.full((2,), want_k))
    assert torch.allclose(layer.v_scale, torch.full((2,), want_v))
    got = dequantize(layer.v_cache.view(-1, 2, 8)[:6], layer.v_scale)
    assert torch.allclose(got, v1, rtol=0.07, atol=want_v), (got - v1).abs().max()
    _step(cal, layer, 1e4 * torch.ones(3, 2, 8), 1e4 * torch.ones(3, 2, 8), [11, 12, 13])  # after the window
    assert float(layer.k_scale[0]) == pytest.approx(want_k)


def test_only_fp8_caches_are_calibrated() -> None:
    """arm() leaves 16-bit (high-precision) layers out and takes an fp8 MLA latent cache; the placeholders hold
    1.0 for both kinds (one scale for the latent)."""
    from appliance.executor.kv_calibration import arm
    from appliance.executor.kv_scales import (
        CheckpointKVScales,
        calibration_placeholders,
    )

    fp8, plain = _layer(), Attention(num_heads=2, head_dim=8, num_kv_heads=2, scale=0.35, backend="torch")
    plain.bind_kv_cache(*(torch.zeros(4, 4, 2, 8) for _ in range(2)))
    mla = _mla_layer()
    cal = arm([fp8, plain, mla], tokens=8)
    assert cal is not None and cal.layers == [fp8, mla] and plain.calibration is None
    assert fp8.calibration is cal and mla.calibration is cal
    assert arm([fp8], tokens=0) is None
    fresh = MLAAttention(2, 12, 4, 4, 4, 0.3)
    source = calibration_placeholders([fresh], CheckpointKVScales(), 8)
    assert source == "online calibration over the first 8 prefill tokens"
    assert fresh.kv_scale is not None and fresh.kv_scale.tolist() == [1.0]


def _mla_layer(blocks: int = 4, block: int = 4) -> MLAAttention:
    layer = MLAAttention(num_heads=2, kv_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                         scale=0.3, backend="torch")
    layer.set_kv_scales(torch.ones(1), torch.ones(1))
    layer.bind_kv_cache(torch.zeros(blocks, block, 1, 16, dtype=E4M3))
    return layer


def test_latent_scale_grows_and_earlier_latents_are_rescaled() -> None:
    """The MLA latent cache's one scale: 6 prefill latents of amax ~3, then a decode row and 4 prefill latents of
    amax ~300 (one padding row), then more past the window; stored through the layer's mla_store op. The scale
    ends at amax / 448 of the 10 counted rows, frozen; the first step's latents read back within e4m3's rounding."""
    g = torch.Generator().manual_seed(1)
    layer = _mla_layer()
    cal = KVCalibration([layer], tokens=10)

    def step(latent: torch.Tensor, slots: list[int], num_decode: int = 0) -> None:
        meta = SimpleNamespace(num_decode_tokens=num_decode, slot_mapping=torch.tensor(slots))
        cal.observe_latent(layer, latent, meta)  # type: ignore[arg-type]
        assert layer.k_cache is not None
        layer._store(latent, layer.k_cache, meta.slot_mapping, **layer.kv_scales)

    first = 3 * torch.randn(6, 16, generator=g)
    step(first, list(range(6)))
    assert layer.kv_scale is not None and float(layer.kv_scale[0]) == pytest.approx(float(first.abs().max()) / 448)
    second = 300 * torch.randn(5, 16, generator=g)
    step(torch.cat([1000 * torch.ones(1, 16), second]), [6, 7, 8, 9, 10, -1], num_decode=1)
    assert cal.done and layer.calibration is None
    want = float(torch.cat([first, second[:4]]).abs().max()) / 448
    assert layer.kv_scale.tolist() == [pytest.approx(want)]
    got = dequantize(layer.k_cache.view(-1, 1, 16)[:6], layer.kv_scale).view(6, 16)
    assert torch.allclose(got, first, rtol=0.07, atol=want), (got - first).abs().max()
    step(1e4 * torch.ones(3, 16), [11, 12, 13])  # after the window: frozen
    assert layer.kv_scale.tolist() == [pytest.approx(want)]


# ---- on a tiny model -----------------------------------------------------------------------------------------
def _recorded_kv(model: Path, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values (post-rotary, as stored) of PROMPT's first n tokens in the 16-bit model."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = Attention.forward

    def record(self: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object) -> torch.Tensor:
        seen.append((k.float().clone(), v.float().clone()))
        return forward(self, q, k, v, meta)  # type: ignore[arg-type]

    llm = LLM(model=str(model), **COMMON)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Attention, "forward", record)
        for module in llm.executor.runner.model.modules():  # the unfused path stores through Attention.forward
            if hasattr(module, "_rope_store"):
                mp.setattr(module, "_rope_store", None)
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=1))
    layers = len(llm.executor.runner.model.attention_layers())
    per_layer = seen[:layers]  # the prompt's one prefill step, layer by layer
    assert len(per_layer) == layers and all(k.shape[0] == len(PROMPT) for k, _ in per_layer)
    return [(k[:n].reshape(n, -1), v[:n].reshape(n, -1)) for k, v in per_layer]


def test_scales_equal_the_16_bit_models_amax(tiny_model: Path) -> None:
    """The fp8 run calibrates over PROMPT's first 20 tokens, in 8-token chunks (three steps, the scales grow
    between them), then serves more prompts: its scales are those of the 16-bit model's keys and values of the
    same tokens. Layer 0 sees the same inputs (exact up to bf16 rounding); later layers see the fp8 cache's
    attention output (measured: 0.6% for k, 0.7% for v; bound 5%)."""
    model = _variant(tiny_model, tiny_model.parent / "calibration_outliers", _outliers)
    ref = _recorded_kv(model, N)
    llm = LLM(model=str(model), kv_cache_dtype="fp8", kv_cache_calibration_tokens=N, chunked_prefill_size=8,
              **COMMON)
    runner = llm.executor.runner
    assert runner.kv_scale_source == f"online calibration over the first {N} prefill tokens"
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=2))
    assert runner.kv_calibration is not None and runner.kv_calibration.done
    layers = runner.model.attention_layers()
    frozen = [(layer.k_scale.clone(), layer.v_scale.clone()) for layer in layers]
    llm.generate([{"prompt_token_ids": [p + 1 for p in PROMPT]}], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(ref) == len(layers) == 2
    for i, (layer, (k, v)) in enumerate(zip(layers, ref)):
        assert layer.calibration is None
        assert torch.equal(layer.k_scale, frozen[i][0]) and torch.equal(layer.v_scale, frozen[i][1])
        tol = 0.01 if i == 0 else 0.05
        for got, x in ((layer.k_scale, k), (layer.v_scale, v)):
            want = float(x.abs().max()) / 448
            assert torch.allclose(got, torch.full_like(got, want), rtol=tol), (i, got, want)
    assert float(frozen[0][1][0]) > 1.0  # the outlier values: scale 1.0 would have saturated them


def test_calibrated_outlier_model_stays_close_to_16_bit(tiny_model: Path) -> None:
    """The outlier model saturates at scale 1.0 (test_fp8_kv_cache.py: mean |diff| 0.35 nats); calibrated over
    its first 16 tokens (the first prompt's 8 and part of the next) it is as close as with a scale file (same
    bounds). Measured (bf16, CPU): mean |diff| 0.023 nats, top-1 agreement 0.93."""
    model = _variant(tiny_model, tiny_model.parent / "calibration_outliers_2", _outliers)
    mean, agree = _compare(model, kv_cache_dtype="fp8", kv_cache_calibration_tokens=16)
    assert mean < OUTLIER_BOUND and agree >= OUTLIER_FLOOR, (mean, agree)


def _recorded_latents(llm: LLM, n: int) -> list[torch.Tensor]:
    """Each MLA layer's latents (c_kv and the rotated k_pe, as stored) of PROMPT's first n tokens in a 16-bit run."""
    seen: list[torch.Tensor] = []
    forward = MLAAttention.forward

    def record(self: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
               k_pe: torch.Tensor, *rest: object) -> torch.Tensor:
        seen.append(torch.cat((kv_c, k_pe), dim=-1).float().clone())
        return forward(self, q_nope, q_pe, kv_c, k_pe, *rest)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MLAAttention, "forward", record)
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=1))
    per_layer = seen[: len(llm.executor.runner.model.attention_layers())]  # the prompt's one prefill step
    assert all(x.shape[0] == len(PROMPT) for x in per_layer)
    return [x[:n] for x in per_layer]


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_latent_scales_equal_the_16_bit_models_amax(tmp_path: Path, arch: str) -> None:
    """DeepSeek's latent cache calibrated over PROMPT's first 20 tokens in 8-token chunks (the scale grows between
    them; MLA prefill reads the earlier chunks' rescaled latents back): each layer's scale is the amax of the 16-bit
    model's latents of the same tokens over 448 (layer 0 exact up to bf16 rounding, later layers see the fp8
    cache's attention output: bound 5%), frozen after; the output stays within test_fp8_kv_cache.py's MLA fp8
    bounds of the 16-bit cache. Measured (bf16, CPU): scales within 0.0% / 0.6% / 1.0% of the reference by layer,
    mean |logprob diff| 0.044 (V2) / 0.050 (V3) nats, top-1 agreement 0.91 / 0.84."""
    from test_moe_models import build_family

    path = build_family(arch, tmp_path / arch)
    base = LLM(model=str(path), **COMMON)
    ref = _recorded_latents(base, N)
    fp8 = LLM(model=str(path), kv_cache_dtype="fp8", kv_cache_calibration_tokens=N, chunked_prefill_size=8,
              **COMMON)
    runner = fp8.executor.runner
    assert runner.kv_scale_source == f"online calibration over the first {N} prefill tokens"
    fp8.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=2))
    assert runner.kv_calibration is not None and runner.kv_calibration.done
    layers = runner.model.attention_layers()
    assert len(layers) == len(ref) == 3 and all(isinstance(layer, MLAAttention) for layer in layers)
    frozen = [layer.kv_scale.clone() for layer in layers]
    mean, agree = _stats(_prompt_logprobs(base), _prompt_logprobs(fp8))
    for i, (layer, x) in enumerate(zip(layers, ref)):
        assert layer.calibration is None and torch.equal(layer.kv_scale, frozen[i])
        want = float(x.abs().max()) / 448
        assert layer.kv_scale.tolist() == [pytest.approx(want, rel=0.01 if i == 0 else 0.05)], (i, want)
    bound, floor = MLA_BOUNDS[arch]
    assert mean < bound and agree >= floor, (mean, agree)


def test_mtp_drafter_latent_cache_is_calibrated(tmp_path_factory: pytest.TempPathFactory) -> None:
    """DeepSeek-V3 with its MTP drafter: the drafter's own latent cache is calibrated too (its window closes with
    the target's), and greedy speculative decoding emits the tokens of plain decoding on a calibrated cache."""
    import spec_fixtures as spec

    path = spec.tiny_v3.__wrapped__(tmp_path_factory)  # the fixture's builder, outside its module
    params = SamplingParams(temperature=0.0, max_tokens=spec.MTP_NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec.MTP_PROMPTS]
    plain = spec.make_llm(path, kv_cache_dtype="fp8", kv_cache_calibration_tokens=16)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = spec.make_llm(path, kv_cache_dtype="fp8", kv_cache_calibration_tokens=16, speculative_algorithm="MTP",
                        speculative_num_steps=2)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    cal = llm.executor.runner.kv_calibration
    assert cal is not None and cal.done and len(cal.layers) == 3  # 2 layers + MTP
    assert all(layer.kv_scale is not None and float(layer.kv_scale[0]) != 1.0 for layer in cal.layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_calibration_through_graphs(make_tiny_model: Callable[..., Path]) -> None:
    """The Triton backend with decode graphs, the decode chain and piecewise graphs (16-token chunks): the window
    (40 tokens: three mixed steps, decodes stored by graphs in between) runs eagerly and rescales what the graphs
    stored; afterwards piecewise graphs serve again. The outlier model stays within the CPU bounds."""
    src = make_tiny_model("llama3", hidden_size=256, intermediate_size=512, head_dim=128)
    path = _variant(src, src.parent / "gpu_calibration_outliers", _outliers)
    kw = {"device": "cuda", "dtype": "bfloat16", "gpu_memory_utilization": 0.3, "attention_backend": "triton",
          "chunked_prefill_size": 16, "skip_tokenizer_init": True, "block_size": 16}
    base = LLM(model=str(path), **kw)
    fp8 = LLM(model=str(path), kv_cache_dtype="fp8", kv_cache_calibration_tokens=40, **kw)
    runner = fp8.executor.runner
    assert runner.graphs is not None and runner.pieces is not None
    mean, agree = _stats(_prompt_logprobs(base), _prompt_logprobs(fp8))
    assert runner.kv_calibration is not None and runner.kv_calibration.done
    assert float(runner.model.attention_layers()[0].v_scale[0]) > 1.0
    assert mean < OUTLIER_BOUND and agree >= OUTLIER_FLOOR, (mean, agree)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_gpu_mla_calibration_through_graphs(tmp_path: Path, arch: str) -> None:
    """The Triton MLA kernels with decode graphs and 16-token chunks: the latent cache calibrates over the first
    40 prefill tokens (mixed steps, graph-stored decodes rescaled with the rest), then freezes; the output stays
    within the CPU test's MLA bounds of the 16-bit cache."""
    from test_moe_models import build_family

    path = build_family(arch, tmp_path / arch)
    kw = {"device": "cuda", "dtype": "bfloat16", "gpu_memory_utilization": 0.3, "attention_backend": "triton",
          "chunked_prefill_size": 16, "skip_tokenizer_init": True, "block_size": 16}
    base = LLM(model=str(path), **kw)
    fp8 = LLM(model=str(path), kv_cache_dtype="fp8", kv_cache_calibration_tokens=40, **kw)
    runner = fp8.executor.runner
    assert runner.graphs is not None
    mean, agree = _stats(_prompt_logprobs(base), _prompt_logprobs(fp8))
    assert runner.kv_calibration is not None and runner.kv_calibration.done
    assert all(float(layer.kv_scale[0]) != 1.0 for layer in runner.model.attention_layers())
    bound, floor = MLA_BOUNDS[arch]
    assert mean < bound and agree >= floor, (mean, agree)
