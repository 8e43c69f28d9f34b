"""N-gram, standalone-draft and EAGLE-3 speculative decoding on a GPU (Triton kernels, CUDA graphs and piecewise
graphs as configured by default, float32 with TF32 off): the same greedy tokens as without speculation, a prefix
hit included; the device n-gram proposer drafts as the host one; drafts drawn from a drafter equal to the target
are kept; a bfloat16 run with dummy weights and forced acceptance completes with the pool whole. Run on the
device machine: python -m pytest -q -m gpu tests/test_spec_gpu_drafters.py"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import spec_fixtures
import torch
from conftest import TINY_VOCAB
from spec_fixtures import gpu_llm

from appliance import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], list(range(40, 60)) * 2, [7, 11, 13, 17, 19, 23, 29, 31]]  # 40: a hit of 1-2 blocks
NEW = 24

eagle3_head = spec_fixtures.eagle3_head


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE3"])
def test_gpu_greedy_parity(tiny_model: Path, eagle3_head: Path, algorithm: str, overlap: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in gpu_llm(tiny_model).generate(prompts, params)]
    draft = {"STANDALONE": {"speculative_draft_model_path": str(tiny_model)},
             "EAGLE3": {"speculative_draft_model_path": str(eagle3_head)}}.get(algorithm, {})
    llm = gpu_llm(tiny_model, speculative_algorithm=algorithm, speculative_num_steps=3,
                  enable_overlap_schedule=overlap, **draft)
    assert llm.engine.overlap == overlap
    for _ in range(2):  # the second pass hits the prefix cache
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and llm.engine.check_accounting().ok and stats.prefix_hit_tokens > 0


def test_gpu_bf16_eagle3_with_forced_acceptance_completes(make_tiny_model: Any, eagle3_head: Path) -> None:
    target = make_tiny_model("llama", seed=5, num_hidden_layers=4)
    llm = LLM(model=str(target), device="cuda", dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.3,
              skip_tokenizer_init=True, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(eagle3_head),
              speculative_num_steps=3, speculative_enable_synthetic_acceptance=True,
              speculative_synthetic_acceptance_length=2.6, max_num_seqs=8)
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + 3 * i))} for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    stats = llm.engine.stats()
    assert 2.2 < stats.spec_mean_accepted_length < 3.0
    assert llm.engine.check_accounting().ok and stats.blocks_owned == 0


def test_gpu_device_ngram_proposes_what_the_host_one_does(tiny_model: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = []
    for proposer in ("host", "device"):
        llm = gpu_llm(tiny_model, speculative_algorithm="NGRAM", speculative_num_steps=3,
                      speculative_ngram_proposer=proposer)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        s = llm.engine.stats()
        runs.append((outs, s.spec_num_draft_tokens, s.spec_num_accepted_tokens))
    assert runs[0] == runs[1] and runs[0][1] > 0


def test_gpu_drawn_drafts_of_a_drafter_equal_to_the_target_are_kept(tiny_model: Path) -> None:
    """Random unseeded rows draw drafts from q and verify by rejection sampling on the device; q = p here."""
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = gpu_llm(tiny_model, speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tiny_model),
                  speculative_num_steps=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=1.0, top_p=0.95, max_tokens=NEW, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == NEW and max(o.outputs[0].token_ids) < TINY_VOCAB for o in outs)
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0.95 * stats.spec_num_draft_tokens
    assert llm.engine.check_accounting().ok
