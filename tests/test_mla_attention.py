"""Multi-head latent attention: the absorbed decode path equals the expanded prefill path over the same latent
cache, the expanded path equals ordinary paged attention on explicit K/V, DeepSeek's YaRN table equals
transformers', and DeepSeek-V3's multi-token-prediction layer loads (and is dropped when absent)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from selfcheck_runner import interpreted_cases
from test_moe_models import (
    PROMPTS,
    YARN_V2,
    build_family,
    one_thread,  # noqa: F401  (autouse: one torch thread in this module)
)

from appliance import LLM, SamplingParams
from appliance.kernels import registry
from appliance.layers.attention import AttentionMetadata
from appliance.layers.mla import MLAAttention, rope_cache_and_mscale

H, R, DN, DR, DV, BS = 4, 16, 8, 4, 6, 4


def _meta(num_decode: int, lens: list[int], q_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    i32 = {"dtype": torch.int32}
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return AttentionMetadata(slot_mapping=torch.full((num_decode + sum(q_lens),), -1, dtype=torch.int64),
                             num_decode_tokens=num_decode,
                             decode_block_tables=tables if num_decode else torch.zeros(0, 1, **i32),
                             decode_seq_lens=torch.tensor(lens if num_decode else [], **i32),
                             prefill_cu_seqlens=torch.tensor(cu, **i32),
                             prefill_seq_lens=torch.tensor([] if num_decode else lens, **i32),
                             prefill_block_tables=torch.zeros(0, 1, **i32) if num_decode else tables)


@pytest.fixture()
def latent_setup():
    torch.manual_seed(0)
    lens = [7, 10]
    cache = torch.randn(8, BS, 1, R + DR)
    tables = torch.tensor([[3, 0, 5, 0], [1, 2, 6, 4]], dtype=torch.int32)
    w_kv_b = torch.randn(H * (DN + DV), R) / R**0.5
    layer = MLAAttention(H, R, DN, DR, DV, scale=(DN + DR) ** -0.5)
    layer.bind_kv_cache(cache)
    return layer, cache, tables, lens, w_kv_b


def test_absorbed_decode_equals_expanded_prefill(latent_setup) -> None:
    layer, _cache, tables, lens, w_kv_b = latent_setup
    q_nope, q_pe = torch.randn(2, H, DN), torch.randn(2, H, DR)
    # the token is already in the cache (slot -1 keeps it untouched); decode it, then treat it as a 1-row chunk
    empty_c, empty_pe = torch.zeros(2, R), torch.zeros(2, DR)
    decoded = layer(q_nope, q_pe, empty_c, empty_pe, w_kv_b, _meta(2, lens, [], tables))
    rows = []
    for b in range(2):
        meta = _meta(0, [lens[b]], [1], tables[b : b + 1])
        rows.append(layer(q_nope[b : b + 1], q_pe[b : b + 1], empty_c[:1], empty_pe[:1], w_kv_b, meta))
    torch.testing.assert_close(decoded, torch.cat(rows), rtol=1e-5, atol=1e-5)


def test_expanded_prefill_equals_paged_attention_on_explicit_kv(latent_setup) -> None:
    _, cache, tables, lens, w_kv_b = latent_setup
    w = w_kv_b.view(H, DN + DV, R)
    w_uk, w_uv = w[:, :DN], w[:, DN:]
    # explicit per-head K = [c W_UK^T, k_pe] and V = c W_UV^T (V zero-padded to K's width) in ordinary caches
    c, pe = cache[..., :R].squeeze(2), cache[..., R:].squeeze(2)
    k_cache = torch.cat((torch.einsum("nsr,hdr->nshd", c, w_uk), pe[:, :, None, :].expand(-1, -1, H, -1)), dim=-1)
    v_cache = torch.nn.functional.pad(torch.einsum("nsr,hvr->nshv", c, w_uv), (0, DN + DR - DV))
    q_lens = [3, 5]
    q = torch.randn(sum(q_lens), H, DN + DR)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    scale = 0.3
    got = registry.get("mla_prefill", "torch")(q, cache, cu, seq, tables, w_uk, w_uv, scale)
    want = registry.get("prefill_attention", "torch")(q, k_cache, v_cache, cu, seq, tables, scale)[..., :DV]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_store_writes_latents_to_their_slots() -> None:
    cache = torch.zeros(3, BS, 1, R + DR)
    latent = torch.randn(3, R + DR)
    registry.get("mla_store", "torch")(latent, cache, torch.tensor([5, -1, 11]))
    assert torch.equal(cache[1, 1, 0], latent[0]) and torch.equal(cache[2, 3, 0], latent[2])
    assert int((cache != 0).any(-1).sum()) == 2


def test_yarn_table_matches_transformers() -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.DeepseekV2Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=8,
                                        max_position_embeddings=512, rope_parameters=dict(YARN_V2))
    inv_freq, attn_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    cache, softmax_mult = rope_cache_and_mscale(cfg, 8)
    freqs = torch.outer(torch.arange(512, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(cache, torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attn_factor)
    mscale = 0.1 * YARN_V2["mscale_all_dim"] * math.log(YARN_V2["factor"]) + 1.0
    assert softmax_mult == pytest.approx(mscale**2)


def _with_mtp(src: Path, out: Path, num_layers: int) -> dict[str, torch.Tensor]:
    """Copy a V3 checkpoint and append one MTP layer (stored as layer `num_layers`, as DeepSeek ships it)."""
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    mtp: dict[str, torch.Tensor] = {}
    last = f"model.layers.{num_layers - 1}."
    for name, t in tensors.items():
        if name.startswith(last):
            mtp[name.replace(last, f"model.layers.{num_layers}.")] = t + 0.01 * torch.randn(t.shape, generator=gen)
    hidden, vocab = tensors["model.norm.weight"].shape[0], tensors["lm_head.weight"].shape[0]
    extra = {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
             "shared_head.norm.weight": (hidden,), "shared_head.head.weight": (vocab, hidden),
             "embed_tokens.weight": (vocab, hidden)}
    for name, shape in extra.items():
        mtp[f"model.layers.{num_layers}.{name}"] = torch.randn(shape, generator=gen)
    save_file({**tensors, **mtp}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    return mtp


def test_v3_mtp_layer_loads_and_leaves_generation_alone(tmp_path: Path) -> None:
    src = build_family("deepseek_v3", tmp_path / "src")
    (tmp_path / "mtp").mkdir()
    mtp = _with_mtp(src, tmp_path / "mtp", num_layers=3)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with_mtp = LLM(model=str(tmp_path / "mtp"), dtype="float32", block_size=4, skip_tokenizer_init=True)
    model = with_mtp.executor.runner.model
    assert len(model.mtp) == 1
    layer = model.mtp[0]
    assert torch.equal(layer.eh_proj.weight, mtp["model.layers.3.eh_proj.weight"])
    assert torch.equal(layer.shared_head.head.weight[:384], mtp["model.layers.3.shared_head.head.weight"])
    assert torch.equal(layer.self_attn.kv_b_proj.weight, mtp["model.layers.3.self_attn.kv_b_proj.weight"])
    assert torch.equal(layer.mlp.experts.w2_weight[5], mtp["model.layers.3.mlp.experts.5.down_proj.weight"])
    assert torch.equal(layer.mlp.gate.e_score_correction_bias, mtp["model.layers.3.mlp.gate.e_score_correction_bias"])
    assert len(model.attention_layers()) == 3  # the MTP layer gets no cache of the main model
    without = LLM(model=str(src), dtype="float32", block_size=4, skip_tokenizer_init=True,
                  hf_overrides={"num_nextn_predict_layers": 1})
    assert len(without.executor.runner.model.mtp) == 0  # declared but absent from the checkpoint: dropped
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert ([o.outputs[0].token_ids for o in with_mtp.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in without.generate(prompts, params)])


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    pytest.importorskip("triton")
    return interpreted_cases("appliance.kernels.mla.selfcheck", timeout=120, threads=1)


def _case_names(cases: str) -> list[str]:
    from appliance.kernels.mla import selfcheck as sc

    return [c.name for c in getattr(sc, cases)()]


@pytest.mark.parametrize("case", _case_names("small_cases"))
def test_triton_mla_decode_interpreted_matches_reference(interpreted: dict, case: str) -> None:
    row = interpreted.get(case)
    assert row is not None, f"{case} produced no result"
    assert "error" not in row, row.get("error")
    assert row["err"] <= row["tol"], f"{case}: relative error {row['err']:.3g} > {row['tol']:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", _case_names("gpu_cases"))
def test_triton_mla_decode_gpu_shapes(case: str) -> None:
    from appliance.kernels.mla import selfcheck as sc

    row = sc.run_case(next(c for c in sc.gpu_cases() if c.name == case), "cuda")
    assert row["err"] <= row["tol"], row


@pytest.mark.parametrize("case", _case_names("small_prefill_cases"))
def test_triton_mla_prefill_interpreted_matches_reference(interpreted: dict, case: str) -> None:
    row = interpreted.get(case)
    assert row is not None, f"{case} produced no result"
    assert "error" not in row, row.get("error")
    assert row["op"] == "mla_prefill" and row["err"] <= row["tol"], row


def test_triton_backend_layer_uses_the_triton_mla_kernels() -> None:
    pytest.importorskip("triton")
    from appliance.kernels import registry
    from appliance.layers.mla import MLAAttention

    attn = MLAAttention(2, 32, 16, 8, 16, 0.1, backend="triton")
    assert attn._prefill is registry.get("mla_prefill", "triton")
    assert attn._decode is registry.get("mla_decode", "triton")
    assert MLAAttention(2, 32, 16, 8, 16, 0.1)._prefill is registry.get("mla_prefill", "torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", _case_names("gpu_prefill_cases"))
def test_triton_mla_prefill_gpu_shapes(case: str) -> None:
    from appliance.kernels.mla import selfcheck as sc

    row = sc.run_prefill_case(next(c for c in sc.gpu_prefill_cases() if c.name == case), "cuda")
    assert row["err"] <= row["tol"], row
