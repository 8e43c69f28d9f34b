"""The flashinfer backend on a GPU (skipped without CUDA and an importable flashinfer): every registered op against
the torch reference, and greedy decoding of tiny Llama / Qwen3 models against the triton backend. Run by
benchmarks/flashinfer.sh; the CPU side of the backend is tests/test_flashinfer_backend.py."""
from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from flashinfer_cases import (
    check_close,
    decode_case,
    mixed_step,
    prefill_case,
    store_case,
)

from appliance.kernels import registry


def _flashinfer_importable() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


needs_flashinfer = pytest.mark.skipif(not _flashinfer_importable(), reason="needs CUDA and flashinfer")
# Each (dtype, head_dim) pair is one more JIT-compiled decode and prefill module on a fresh machine (~11 s and ~80 s):
# two pairs, the one of Llama-8B (also timed by benchmarks/flashinfer.sh) and the one of the tiny models below.
# Head counts are runtime arguments of those modules, so every case loops over several GQA shapes.
CONFIGS = [pytest.param(torch.bfloat16, 128, id="bf16-d128"), pytest.param(torch.float16, 64, id="fp16-d64")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
HEADS = [(32, 8), (8, 8), (16, 2), (4, 1)]  # (q heads, kv heads): GQA 4, MHA, GQA 8, one kv head


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype, d", CONFIGS)
def test_gpu_decode_matches_reference(dtype: torch.dtype, d: int) -> None:
    for seed, (h, hkv) in enumerate(HEADS):
        decode_case([1, 15, 16, 17, 300, 1024], h, hkv, d, dtype, "cuda", TOL[dtype], seed=seed)
        decode_case([37] * 3, h, hkv, d, dtype, "cuda", TOL[dtype], seed=seed + 10)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype, d", CONFIGS)
def test_gpu_prefill_with_cached_prefix_matches_reference(dtype: torch.dtype, d: int) -> None:
    for seed, (h, hkv) in enumerate(HEADS):
        prefill_case([1, 16, 100, 7, 0, 0], [0, 48, 3, 200, 0, 0], h, hkv, d, dtype, "cuda", TOL[dtype], seed=seed)
        prefill_case([257], [0], h, hkv, d, dtype, "cuda", TOL[dtype], seed=seed + 10)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype, d", CONFIGS)
def test_gpu_store_kv_matches_reference(dtype: torch.dtype, d: int) -> None:
    for hkv in (8, 2, 1):
        store_case(100, hkv, d, dtype, "cuda")
        store_case(50, hkv, d, dtype, "cuda", skip_every=4)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype, d", CONFIGS)
def test_gpu_mixed_step_through_attention_layer(dtype: torch.dtype, d: int) -> None:
    outs, cache = mixed_step("flashinfer", dtype, "cuda", d=d)
    refs, ref_cache = mixed_step("torch", dtype, "cuda", d=d)
    for out, ref in zip(outs, refs):
        check_close(out, ref, TOL[dtype])
    assert torch.equal(cache, ref_cache)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    fi, ref = registry.get("rms_norm", "flashinfer"), registry.get("rms_norm", "torch")
    for shape in [(7, 4096), (256, 4096), (3, 8, 128), (5, 64)]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(*shape, generator=gen).to(dtype).cuda()
        res = torch.randn(*shape, generator=gen).to(dtype).cuda()
        w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).cuda()
        check_close(fi(x, w, 1e-6), ref(x, w, 1e-6), TOL[dtype])
        if len(shape) == 3:  # q/k norm over a strided view (the heads of a fused qkv output)
            wide = torch.randn(shape[0], shape[1] * 3, shape[2], generator=gen).to(dtype).cuda()
            view = wide[:, : shape[1]]
            check_close(fi(view, w, 1e-6), ref(view, w, 1e-6), TOL[dtype])
            continue
        x0, r0 = x.clone(), res.clone()
        out, summed = fi(x, w, 1e-6, res)
        ref_out, ref_summed = ref(x, w, 1e-6, res)
        check_close(out, ref_out, TOL[dtype])
        check_close(summed, ref_summed, TOL[dtype] / 4)
        assert torch.equal(x, x0) and torch.equal(res, r0)  # out of place, like the reference


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    fi, ref = registry.get("silu_and_mul", "flashinfer"), registry.get("silu_and_mul", "torch")
    for tokens, inter in [(1, 14336), (64, 1024), (5, 8)]:
        x = torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(0)).to(dtype).cuda()
        check_close(fi(x), ref(x), TOL[dtype])


def _greedy(path: Any, backend: str) -> list[tuple[list[int], list[float]]]:
    from appliance import LLM, SamplingParams

    llm = LLM(model=str(path), device="cuda", dtype="float16", attention_backend=backend, enforce_eager=True,
              max_total_tokens=4096, chunked_prefill_size=16, skip_tokenizer_init=True)
    assert llm.executor.runner.backend == backend
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140)), list(range(100, 120)) + [3] * 9, [3] * 17]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
    got = [(o.outputs[0].token_ids, [o.outputs[0].logprobs[i][t].logprob
                                     for i, t in enumerate(o.outputs[0].token_ids)]) for o in outs]
    del llm
    torch.cuda.empty_cache()
    return got


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_greedy_matches_triton_backend(arch: str, make_tiny_model: Any) -> None:
    """Token-exact greedy decoding against the triton backend (chunked prefill: chunks over cached prefixes, decode
    and prefill rows in one step, padded prefill batches), logprobs close."""
    path = make_tiny_model(arch, head_dim=64)  # flashinfer's kernels take head_dim 64, 128, 256
    fi, tr = _greedy(path, "flashinfer"), _greedy(path, "triton")
    for (fi_ids, fi_lps), (tr_ids, tr_lps) in zip(fi, tr):
        assert fi_ids == tr_ids
        assert fi_lps == pytest.approx(tr_lps, abs=2e-2)
