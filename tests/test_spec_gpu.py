"""MTP speculative decoding on a GPU (Triton MLA / fused MoE, float32 with TF32 off): the same greedy tokens with
drafts (the MTP layer's own, and oracle drafts that are partly right) as without, for num_steps 1 and 2; a
bfloat16 V3-shaped run (dummy weights) completes with the pool whole. Run on the device
machine: python -m pytest -q -m gpu tests/test_spec_gpu.py"""
from __future__ import annotations

from pathlib import Path

import pytest
import spec_fixtures
import torch
from spec_fixtures import MTP_NEW, MTP_PROMPTS, MTP_TINY, gpu_llm, greedy, oracle

from appliance import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
tiny_v3 = spec_fixtures.tiny_v3


@pytest.fixture(scope="module")
def gpu_reference(tiny_v3: Path) -> dict[tuple[int, ...], list[int]]:
    torch.backends.cuda.matmul.allow_tf32 = False
    refs = greedy(gpu_llm(tiny_v3, moe_backend="triton"), MTP_PROMPTS, MTP_NEW + 8)
    return {tuple(p): r for p, r in zip(MTP_PROMPTS, refs)}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("forced", [False, True], ids=["mtp_drafts", "oracle_drafts"])
def test_gpu_greedy_parity(tiny_v3: Path, gpu_reference: dict[tuple[int, ...], list[int]],
                           monkeypatch: pytest.MonkeyPatch, steps: int, forced: bool, overlap: bool) -> None:
    if forced:
        oracle(monkeypatch, gpu_reference, wrong=3)
    llm = gpu_llm(tiny_v3, moe_backend="triton", speculative_algorithm="MTP", speculative_num_steps=steps,
                  chunked_prefill_size=16, enable_overlap_schedule=overlap)
    assert llm.engine.overlap == overlap
    for _ in range(2):  # the second pass hits the prefix cache
        assert greedy(llm, MTP_PROMPTS, MTP_NEW) == [gpu_reference[tuple(p)][:MTP_NEW] for p in MTP_PROMPTS]
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and llm.engine.check_accounting().ok
    if forced:
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_gpu_bf16_run_completes(tmp_path: Path) -> None:
    import transformers

    cfg = transformers.DeepseekV3Config(**{**MTP_TINY, "hidden_size": 256, "moe_intermediate_size": 128,
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
