"""The flags people use for hybrid linear-attention models (vLLM's --mamba-*, SGLang's --mamba-* / --max-mamba-*,
Atlas's --ssm-*) in `appliance serve` and `appliance translate`, and the state-cache dtypes they set, honoured by
the state cache (or refused for a model without recurrent state)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config import parse_serve_args
from tests.test_translate_corpus import one, validated


def test_serve_accepts_the_state_dtype_flags() -> None:
    c = parse_serve_args(["org/m", "--mamba-cache-dtype", "float32", "--mamba-ssm-cache-dtype", "bfloat16"], env={})
    assert (c.cache.ssm_cache_dtype, c.cache.ssm_state_dtype) == ("float32", "bfloat16")
    c = parse_serve_args(["org/m", "--mamba-ssm-dtype", "float16", "--ssm-cache-slots", "8"], env={})
    assert (c.cache.ssm_state_dtype, c.cache.ssm_cache_slots) == ("float16", 8)
    with pytest.raises(Exception, match="fp8"):
        parse_serve_args(["org/m", "--mamba-ssm-dtype", "fp8"], env={})


def test_translate_vllm_hybrid_flags(tmp_path: Path) -> None:
    tr = one("vllm serve Qwen/Qwen3-Next-80B-A3B-Instruct --mamba-cache-dtype float32 --mamba-ssm-cache-dtype "
             "float32 --mamba-block-size 256 --enable-prefix-caching --max-num-seqs 64 --mamba-cache-mode align\n")
    cache = tr.document()["cache"]
    assert {k: cache[k] for k in ("ssm_cache_dtype", "ssm_state_dtype", "ssm_checkpoint_interval")} == \
        {"ssm_cache_dtype": "float32", "ssm_state_dtype": "float32", "ssm_checkpoint_interval": 256}
    assert tr.document()["scheduler"]["max_num_seqs"] == 64
    assert any("--mamba-cache-mode" in f.subject for f in tr.findings)  # no equivalent: said, not dropped
    assert not {u.split(":")[0] for u in tr.unsupported} & {"cache.ssm_cache_dtype", "cache.ssm_state_dtype"}
    validated(tr, tmp_path)


def test_translate_sglang_hybrid_flags(tmp_path: Path) -> None:
    tr = one("python -m sglang.launch_server --model-path Qwen/Qwen3-Next-80B-A3B-Instruct --max-mamba-cache-size "
             "48 --mamba-ssm-dtype bfloat16 --mamba-track-interval 512 --mamba-full-memory-ratio 0.5 "
             "--linear-attn-backend triton\n")
    cache = tr.document()["cache"]
    assert {k: cache[k] for k in ("ssm_cache_slots", "ssm_state_dtype", "ssm_checkpoint_interval")} == \
        {"ssm_cache_slots": 48, "ssm_state_dtype": "bfloat16", "ssm_checkpoint_interval": 512}
    subjects = "\n".join(f.subject for f in tr.findings)
    assert "--mamba-full-memory-ratio" in subjects and "--linear-attn-backend" in subjects
    validated(tr, tmp_path)


def test_state_dtypes_are_honoured(make_tiny_model) -> None:
    path = make_tiny_model("qwen3_next")
    prompts = [[5, 6, 7, 8, 9], list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    runs = {}
    for conv, state in (("auto", "auto"), ("bfloat16", "auto"), ("auto", "bfloat16")):
        llm = LLM(model=str(path), dtype="float32", block_size=4, ssm_cache_dtype=conv, ssm_state_dtype=state)
        sc = llm.executor.runner.state_cache
        conv_t, ssm_t = sc.tensors[0]
        # ssm_state_dtype auto follows ssm_cache_dtype when that is set, else float32
        want_state = torch.bfloat16 if "bfloat16" in (conv, state) else torch.float32
        assert conv_t.dtype == (torch.bfloat16 if conv == "bfloat16" else torch.float32) and ssm_t.dtype == want_state
        assert sc.spec.bytes_per_slot == 2 * (128 * 3 * conv_t.element_size() + 4 * 16 * 16 * ssm_t.element_size())
        runs[(conv, state)] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   params)]
    exact = runs[("auto", "auto")]
    for key, outs in runs.items():
        for got, ref in zip(outs, exact):
            # 16-bit states round what decode steps read: the same tokens, logprobs within bfloat16's error
            assert got.token_ids == ref.token_ids, key
            lp = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
            ref_lp = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
            if key[0] == "auto":  # the prefill's output reads no stored recurrent state
                assert lp[0] == pytest.approx(ref_lp[0], abs=1e-5), key
            assert lp == pytest.approx(ref_lp, abs=0.05), key


def test_state_settings_are_refused_for_a_model_without_state(tiny_model) -> None:
    with pytest.raises(ValueError, match="cache.ssm_state_dtype applies to hybrid"):
        LLM(model=str(tiny_model), dtype="float32", skip_tokenizer_init=True, ssm_state_dtype="bfloat16")
