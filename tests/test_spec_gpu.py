"""MTP speculative decoding on a GPU (Triton MLA / fused MoE, float32 with TF32 off): the same greedy tokens with
drafts (the MTP layer's own, and oracle drafts that are partly right) as without, for num_steps 1 and 2; a
bfloat16 V3-shaped run (dummy weights) completes with the pool whole. Run on the device
machine: python -m pytest -q -m gpu tests/test_spec_gpu.py"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_spec_mtp import NEW, PROMPTS, TINY, dummy_v3, oracle, tiny_v3  # noqa: F401  (fixtures)

from appliance import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_llm(path: Path, **overrides: Any) -> LLM:
    return LLM(model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.3, block_size=16,
               attention_backend="triton", moe_backend="triton", skip_tokenizer_init=True, **overrides)


@pytest.fixture(scope="module")
def gpu_reference(tiny_v3: Path) -> dict[tuple[int, ...], list[int]]:  # noqa: F811
    torch.backends.cuda.matmul.allow_tf32 = False
    outs = gpu_llm(tiny_v3).generate([{"prompt_token_ids": p} for p in PROMPTS],
                                     SamplingParams(temperature=0.0, max_tokens=NEW + 8, ignore_eos=True))
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("forced", [False, True], ids=["mtp_drafts", "oracle_drafts"])
def test_gpu_greedy_parity(tiny_v3: Path, gpu_reference: dict[tuple[int, ...], list[int]],  # noqa: F811
                           monkeypatch: pytest.MonkeyPatch, steps: int, forced: bool, overlap: bool) -> None:
    if forced:
        oracle(monkeypatch, gpu_reference, wrong=3)
    llm = gpu_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=steps, chunked_prefill_size=16,
                  enable_overlap_schedule=overlap)
    assert llm.engine.overlap == overlap
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outs] == [gpu_reference[tuple(p)][:NEW] for p in PROMPTS]
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and llm.engine.check_accounting().ok
    if forced:
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_gpu_bf16_run_completes(tmp_path: Path) -> None:
    import transformers

    cfg = transformers.DeepseekV3Config(**{**TINY, "hidden_size": 256, "moe_intermediate_size": 128,
                                           "intermediate_size": 512, "kv_lora_rank": 64, "q_lora_rank": 96,
                                           "num_attention_heads": 8})
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(str(tmp_path))
    llm = LLM(model=str(tmp_path), device="cuda", dtype="bfloat16", load_format="dummy",
              gpu_memory_utilization=0.3, skip_tokenizer_init=True, speculative_algorithm="MTP",
              speculative_num_steps=2, max_num_seqs=8)
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + 3 * i))} for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True, seed=5))
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and llm.engine.check_accounting().ok and stats.blocks_owned == 0
