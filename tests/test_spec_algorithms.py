"""N-gram lookup, a standalone draft model, EAGLE-3 and EAGLE heads through the offline LLM on the tiny Llama
(CPU, float32, random weights; heads in the published checkpoint layouts, tests/spec_heads.py): greedy tokens and
logprobs equal those without speculation (prefix caching on, a second pass hitting it; chunked prefill), seeded
and penalised sampling are unchanged, the target as its own draft model has every draft accepted, and the
n-gram proposer copies the continuation of the longest recurring suffix."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB
from spec_heads import build_eagle3_head, build_eagle_head

from appliance import LLM, SamplingParams
from appliance.executor.speculative_ngram import ngram_propose

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
           list(range(40, 60)) + list(range(40, 50)), [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 50, 51]]
NEW = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def drafters(make_tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("drafters")
    return {"draft": make_tiny_model("llama", seed=1, num_hidden_layers=1),
            "eagle3": build_eagle3_head(out / "eagle3", TINY_VOCAB, 128),
            "eagle3_speculators": build_eagle3_head(out / "eagle3_s", TINY_VOCAB, TINY_VOCAB, seed=2,
                                                    layout="layers", with_embedding=True),
            "eagle": build_eagle_head(out / "eagle", TINY_VOCAB)}


# (algorithm, drafter key or None): every drafter this build has, besides MTP (tests/test_spec_mtp.py)
SETUPS = [("NGRAM", None), ("STANDALONE", "draft"), ("EAGLE3", "eagle3"), ("EAGLE3", "eagle3_speculators"),
          ("EAGLE", "eagle")]


def make_llm(model: Path, **overrides: Any) -> LLM:
    return LLM(model=str(model), dtype="float32", block_size=4, skip_tokenizer_init=True, **overrides)


def spec_kwargs(algorithm: str, drafter: Path | None, steps: int = 3) -> dict[str, Any]:
    kw: dict[str, Any] = {"speculative_algorithm": algorithm, "speculative_num_steps": steps}
    if drafter is not None:
        kw["speculative_draft_model_path"] = str(drafter)
    return kw


def generate(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> list[Any]:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def logprobs_of(o: Any) -> list[float]:
    return [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[Any]:
    return generate(make_llm(tiny_model), SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1))


def test_ngram_proposes_what_followed_the_longest_recurring_suffix() -> None:
    t = np.array([1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3])
    assert ngram_propose(t, 1, 3, 3) == [9, 1, 2]  # the latest earlier [1, 2, 3]
    assert ngram_propose(t, 1, 3, 5) == [9, 1, 2, 3]  # runs into the end of the history
    assert ngram_propose(np.array([7, 1, 2, 8, 2]), 1, 3, 2) == [8, 2]  # only the one-token suffix recurs
    assert ngram_propose(np.array([7, 1, 2, 8, 2]), 2, 3, 2) == []  # ... shorter than prompt_lookup_min
    assert ngram_propose(np.array([1, 2, 3]), 1, 3, 3) == [] and ngram_propose(np.array([5]), 1, 3, 3) == []


@pytest.mark.parametrize("algorithm,key", SETUPS)
@pytest.mark.parametrize("setup", [{"enable_prefix_caching": True},
                                   {"enable_prefix_caching": False, "chunked_prefill_size": 8}])
def test_greedy_tokens_and_logprobs_equal_without_speculation(tiny_model: Path, drafters: dict[str, Path],
                                                              reference: list[Any], algorithm: str, key: str | None,
                                                              setup: dict[str, Any]) -> None:
    llm = make_llm(tiny_model, **spec_kwargs(algorithm, drafters.get(key or "")), **setup)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    for _ in range(2 if setup["enable_prefix_caching"] else 1):  # the second pass hits the prefix cache
        for o, ref in zip(generate(llm, params), reference):
            assert o.token_ids == ref.token_ids
            assert logprobs_of(o) == pytest.approx(logprobs_of(ref), abs=1e-4)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert llm.engine.check_accounting().ok
    if setup["enable_prefix_caching"]:
        assert stats.prefix_hit_tokens > 0


def test_the_target_as_its_own_draft_model_has_every_draft_accepted(tiny_model: Path, reference: list[Any]) -> None:
    llm = make_llm(tiny_model, **spec_kwargs("STANDALONE", tiny_model))
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_mean_accepted_length > 3.0  # 3 drafts + 1 per verification, less the ends of requests


@pytest.mark.parametrize("algorithm,key", [("NGRAM", None), ("STANDALONE", "draft"), ("EAGLE3", "eagle3")])
def test_seeded_and_penalised_sampling_is_unchanged(tiny_model: Path, drafters: dict[str, Path], algorithm: str,
                                                    key: str | None) -> None:
    params = [SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=NEW, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=11, min_tokens=3, max_tokens=NEW),
              SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=NEW,
                             ignore_eos=True)]
    base = generate(make_llm(tiny_model), params)
    # the target as its own draft model: drafts are accepted often, so verification paths really run
    drafter = tiny_model if algorithm == "STANDALONE" else drafters.get(key or "")
    llm = make_llm(tiny_model, **spec_kwargs(algorithm, drafter))
    outs = generate(llm, params)
    for b, o in zip(base, outs):
        assert o.token_ids == b.token_ids
    assert logprobs_of(outs[0]) == pytest.approx(logprobs_of(base[0]), abs=1e-4)
    assert llm.engine.stats().spec_num_drafts > 0


def test_a_drafter_of_the_wrong_kind_is_refused(tiny_model: Path, drafters: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="algorithm EAGLE3 needs Eagle3Head"):
        make_llm(tiny_model, **spec_kwargs("EAGLE3", drafters["draft"]))
    with pytest.raises(ValueError, match="algorithm STANDALONE needs an ordinary model"):
        make_llm(tiny_model, **spec_kwargs("STANDALONE", drafters["eagle3"]))
    with pytest.raises(ValueError, match="eagle3_layers_to_capture"):
        make_llm(tiny_model, speculative_eagle3_layers_to_capture=[0, 1, 5], **spec_kwargs("EAGLE3", drafters["eagle3"]))


def test_a_draft_model_with_another_kv_layout_is_refused(tiny_model: Path,
                                                         make_tiny_model: Callable[..., Path]) -> None:
    other = make_tiny_model("llama", seed=3, num_hidden_layers=1, num_key_value_heads=4)
    with pytest.raises(ValueError, match="KV layout"):
        make_llm(tiny_model, **spec_kwargs("STANDALONE", other))
