"""MTP speculative decoding through the offline LLM on a tiny DeepSeek-V3 (CPU, float32, dummy weights, one MTP
layer): the same greedy tokens (and logprobs) as without it for num_steps 1 and 2, prefix caching on and off,
chunked prefill; with drafts forced right or wrong (the MTP layer's own drafts are random here, so an oracle
replaces them) the accepted / rejected paths still emit exactly the target's tokens, with stops and max_tokens
exact; seeded sampling is identical with and without drafts; start-up refusals name the setting."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import spec_fixtures
import torch
from spec_fixtures import MTP_NEW, MTP_PROMPTS, MTP_TINY, generate, logprobs_of, make_llm, oracle

from appliance import SamplingParams
from appliance.executor.speculative_mtp import MtpSpeculator

one_thread, tiny_v3, dummy_v3 = spec_fixtures.one_thread, spec_fixtures.tiny_v3, spec_fixtures.dummy_v3
mtp_reference = spec_fixtures.mtp_reference


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("setup", [{"enable_prefix_caching": True},
                                   {"enable_prefix_caching": False, "chunked_prefill_size": 8}])
def test_greedy_tokens_equal_without_speculation(tiny_v3: Path, mtp_reference: dict[str, Any], steps: int,
                                                 setup: dict[str, Any]) -> None:
    llm = make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=steps, **setup)
    params = SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True, logprobs=1)
    for _ in range(2 if setup["enable_prefix_caching"] else 1):  # the second pass hits the prefix cache
        outs = generate(llm, params, MTP_PROMPTS)
        for p, o, lps in zip(MTP_PROMPTS, outs, mtp_reference["logprobs"]):
            assert o.token_ids == mtp_reference["tokens"][tuple(p)][:MTP_NEW]
            assert logprobs_of(o) == pytest.approx(lps, abs=1e-4)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert llm.engine.check_accounting().ok


@pytest.mark.parametrize("steps,wrong", [(1, 3), (2, 4), (3, 5)])
def test_accepted_and_rejected_drafts_emit_the_targets_tokens(tiny_v3: Path, mtp_reference: dict[str, Any],
                                                              monkeypatch: pytest.MonkeyPatch, steps: int,
                                                              wrong: int) -> None:
    oracle(monkeypatch, mtp_reference["tokens"], wrong)
    llm = make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=steps, enable_prefix_caching=True)
    refs = [mtp_reference["tokens"][tuple(p)] for p in MTP_PROMPTS]
    # per request: a max_tokens, or a stop token that first appears mid-output (what follows it is dropped)
    params = [SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True, stop_token_ids=[refs[2][4]]),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]
    outs = generate(llm, params, MTP_PROMPTS)
    for o, ref, sp in zip(outs, refs, params):
        want = ref[: sp.max_tokens]
        for stop in sp.stop_token_ids:
            want = want[: want.index(stop) + 1] if stop in want else want
        assert o.token_ids == want
        assert o.finish_reason == ("stop" if sp.stop_token_ids else "length")
    stats = llm.engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.spec_mean_accepted_length > 1.0
    assert llm.engine.check_accounting().ok


def test_seeded_and_penalised_sampling_is_unchanged_by_speculation(tiny_v3: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    params = [SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=MTP_NEW, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=MTP_NEW, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=11, min_tokens=3, max_tokens=MTP_NEW),
              SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True)]
    base = generate(make_llm(tiny_v3), params, MTP_PROMPTS)
    refs = {tuple(p): o.token_ids + [3] * 8 for p, o in zip(MTP_PROMPTS, base)}
    oracle(monkeypatch, refs, wrong=4)
    llm = make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=2)
    outs = generate(llm, params, MTP_PROMPTS)
    for b, o in zip(base, outs):
        assert o.token_ids == b.token_ids
    assert logprobs_of(outs[0]) == pytest.approx(logprobs_of(base[0]), abs=1e-4)
    assert llm.engine.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("overrides,match", [
    ({"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "x"}, "speculative.algorithm"),
    ({"speculative_algorithm": "MTP", "speculative_eagle_topk": 2}, r"eagle_topk=2: draft trees cannot run .*MLA"),
    ({"speculative_algorithm": "MTP", "speculative_num_steps": 2, "speculative_num_draft_tokens": 2},
     "num_draft_tokens"),
])
def test_unsupported_settings_are_refused_at_start(tiny_v3: Path, overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_llm(tiny_v3, **overrides)


def test_dummy_weights_greedy_parity(dummy_v3: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True)
    base = generate(make_llm(dummy_v3, load_format="dummy"), params, MTP_PROMPTS)
    llm = make_llm(dummy_v3, load_format="dummy", speculative_algorithm="MTP", speculative_num_steps=2)
    assert [o.token_ids for o in generate(llm, params, MTP_PROMPTS)] == [o.token_ids for o in base]
    assert llm.engine.stats().spec_num_drafts > 0


def test_a_model_without_mtp_layers_is_refused(tmp_path: Path) -> None:
    import transformers

    cfg = transformers.DeepseekV3Config(**{**MTP_TINY, "num_nextn_predict_layers": 0})
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="multi-token-prediction layers"):
        make_llm(tmp_path, load_format="dummy", speculative_algorithm="MTP", speculative_num_steps=1)


def test_the_drafter_cache_is_in_the_kv_budget(tiny_v3: Path) -> None:
    off = make_llm(tiny_v3, max_total_tokens=1024).executor.runner
    on = make_llm(tiny_v3, max_total_tokens=1024, speculative_algorithm="MTP", speculative_num_steps=1).executor.runner
    assert on.kv_spec.num_layers == off.kv_spec.num_layers + 1
    assert on.kv_spec.bytes_per_block == off.kv_spec.bytes_per_block * 3 // 2
    assert on.model.mtp[0].self_attn.attn.k_cache is on.kv_caches[-1][0]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_drafter_cache_and_drafts_equal_a_from_scratch_pass(tiny_v3: Path, mtp_reference: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """The drafter's KV cache stays right through verifications (accepted and rejected), chained steps and prefix
    hits, with steps planned one ahead too (overlap: clamped verifications, blocks stored before the next step
    ran): after every step, each request's MTP cache rows over its computed positions and its drafts equal what a
    fresh engine computes after prefilling the same history in one go."""
    seen: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}
    real = MtpSpeculator.complete_step

    def record(self: MtpSpeculator, *args: Any) -> Any:
        result = real(self, *args)
        cache = self.model.mtp[0].self_attn.attn.k_cache
        for rid, drafts in self.drafts.items():
            st = self.runner.requests[rid]
            rows = cache[torch.tensor(st.block_ids)].reshape(-1, cache.shape[-1])[: st.num_computed].clone()
            seen[tuple(st.token_ids)] = (list(drafts), rows)
        return result

    monkeypatch.setattr(MtpSpeculator, "complete_step", record)
    # accepted drafts: catch-up over several rows; rejected ones too (overlap verifies at other token counts)
    oracle(monkeypatch, mtp_reference["tokens"], wrong=2 if overlap else 3)
    llm = make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=2, enable_overlap_schedule=overlap)
    params = SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True)
    generate(llm, params, [MTP_PROMPTS[1]])
    generate(llm, params, [MTP_PROMPTS[3], MTP_PROMPTS[0]])  # MTP_PROMPTS[3] hits MTP_PROMPTS[1]'s first blocks
    stats = llm.engine.stats()
    assert stats.prefix_hit_tokens > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    incremental = dict(seen)
    seen.clear()
    fresh = make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=2, enable_prefix_caching=False)
    histories = list(incremental)
    generate(fresh, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), [list(h[:-1]) for h in histories])
    compared = [h for h in histories if h in seen]  # the fresh engine sampled the same last token
    assert len(compared) >= len(histories) - 1
    for h in compared:
        assert incremental[h][0] == seen[h][0], h
        torch.testing.assert_close(incremental[h][1], seen[h][1], atol=1e-5, rtol=1e-4)


def test_validation_names_a_model_without_mtp_layers(tmp_path: Path, dummy_v3: Path) -> None:
    import json

    from appliance.config import resolve

    (tmp_path / "config.json").write_text(json.dumps({**json.loads((dummy_v3 / "config.json").read_text()),
                                                      "num_nextn_predict_layers": 0}))
    r = resolve(None, flat={"model": str(tmp_path), "speculative_algorithm": "MTP"}, env={})
    assert any(w.path == "speculative.algorithm" and "multi-token-prediction" in w.message for w in r.warnings)
    ok = resolve(None, flat={"model": str(dummy_v3), "speculative_algorithm": "MTP"}, env={})
    assert ok.config.speculative.algorithm == "MTP" and not ok.warnings


def test_thinking_budget_requests_decode_one_token_at_a_time(tiny_v3: Path) -> None:
    """A request with logits processors never verifies drafts, and its forced tokens are honoured."""
    budget = {"budget": 2, "end_token_ids": [5, 6], "in_reasoning": True}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra={"thinking_budget": budget})
    base = generate(make_llm(tiny_v3), params, MTP_PROMPTS[:2])
    llm = make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=2)
    outs = generate(llm, params, MTP_PROMPTS[:2])
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert all(o.token_ids[2:4] == [5, 6] for o in outs)
    assert llm.engine.stats().spec_num_drafts == 0


def test_preemption_with_drafts_in_flight(tiny_v3: Path, mtp_reference: dict[str, Any],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool too small for all four requests: preempted requests come back, recompute, draft again, and every
    output still equals the target's greedy tokens; the pool is whole afterwards."""
    oracle(monkeypatch, mtp_reference["tokens"], wrong=4)
    llm = make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=3, max_total_tokens=64,
                   max_model_len=48, enable_prefix_caching=False, schedule_conservativeness=0.0)  # admit greedily
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True), MTP_PROMPTS)
    assert [o.token_ids for o in outs] == [mtp_reference["tokens"][tuple(p)][:MTP_NEW] for p in MTP_PROMPTS]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0 and stats.blocks_owned == 0
    assert llm.engine.check_accounting().ok
