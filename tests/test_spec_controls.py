"""Speculative-decoding controls: speculative.disable_by_batch_size (no verifications while more requests decode,
tokens unchanged), the benchmark-only forced accept decision (refused without its switch; the mean acceptance
length and per-position rates it asks for), the per-position acceptance counters and the decode log line's
speculative part."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from spec_fixtures import make_llm, spec_kwargs

from appliance import LLM, SamplingParams
from appliance.config import build_config
from appliance.config.errors import ConfigError
from appliance.engine import EngineConfig, EngineCore
from appliance.engine.fake_executor import FakeExecutor, reference_generation
from appliance.engine.speculation import SpecCounters
from appliance.observability.request_log import DecodeProgressLog


class Recording(FakeExecutor):
    """The fake worker, recording each plan's decodes: (scheduled rows that sample, largest chunk among them)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.steps: list[tuple[int, int]] = []

    def execute(self, plan: Any) -> Any:
        sampling = [s for s in plan.scheduled if s.sample and not any(n.request_id == s.request_id
                                                                       for n in plan.new_requests)]
        if sampling:
            self.steps.append((len(sampling), max(s.num_tokens for s in sampling)))
        return super().execute(plan)


def test_disable_by_batch_size_verifies_only_at_small_batches() -> None:
    k = 2
    config = EngineConfig(num_blocks=128, block_size=4, max_model_len=64, num_speculative_tokens=k,
                          spec_disable_batch_size=1)
    ex = Recording(128, 4, vocab_size=48, num_speculative_tokens=k, max_model_len=64,
                   draft_quality=lambda rid, n: k)  # every draft right: a verification would take 1 + k tokens
    core = EngineCore(config, ex)
    prompts = {"a": [5, 6, 7], "b": [8, 9], "c": [10, 11, 12, 13]}
    lengths = {"a": 20, "b": 6, "c": 8}
    for rid, p in prompts.items():
        core.add_request(rid, p, SamplingParams(max_tokens=lengths[rid], ignore_eos=True))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while core.has_work():
        for d in core.step():
            out[d.request_id] += d.new_token_ids
    for rid, p in prompts.items():
        assert out[rid] == reference_generation(ex.next_token, p, lengths[rid], 64)[0]
    assert all(widest == 1 for rows, widest in ex.steps if rows > 1)  # no drafts while several decode
    assert any(widest == 1 + k for rows, widest in ex.steps if rows == 1)  # "a" alone verifies
    assert core.stats().spec_num_drafts > 0


def test_the_counters_count_each_accepted_position() -> None:
    c = SpecCounters()
    for drafts, accepted in [(3, 0), (3, 2), (3, 3), (2, 1)]:
        c.record(drafts, accepted)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (4, 11, 6)
    assert c.accepted_per_pos == [3, 2, 1]


def test_the_decode_log_line_reports_the_speculation_since_the_last_line() -> None:
    log = DecodeProgressLog(1, 4, clock=iter(range(100)).__next__)
    base = {"num_running": 1, "num_waiting": 0, "kv_usage": 0.1, "blocks_owned": 2, "prefix_hit_rate": 0.0}
    first = log.on_step(SimpleNamespace(**base, spec_num_drafts=4, spec_num_draft_tokens=12,
                                        spec_num_accepted_tokens=6, spec_accepted_per_pos=(3, 2, 1)), 10)
    assert first is not None and first.endswith(" spec_verifications=4 spec_drafted=12 spec_accepted=6 spec_emitted=10 "
                                                 "spec_mean_accept_len=2.50 spec_accept_per_pos=[0.75,0.50,0.25]")
    second = log.on_step(SimpleNamespace(**base, spec_num_drafts=6, spec_num_draft_tokens=18,
                                         spec_num_accepted_tokens=6, spec_accepted_per_pos=(3, 2, 1)), 2)
    assert second is not None and "spec_verifications=2 spec_drafted=6 spec_accepted=0 spec_emitted=2 " in second
    assert "spec_accept_per_pos=[0.00,0.00,0.00]" in second
    plain = log.on_step(SimpleNamespace(**base, spec_num_drafts=6, spec_num_draft_tokens=18,
                                        spec_num_accepted_tokens=6, spec_accepted_per_pos=(3, 2, 1)), 1)
    assert plain is not None and "spec_" not in plain  # no verification since the last line


@pytest.mark.parametrize("key,value", [("speculative_synthetic_acceptance_length", 2.0),
                                       ("speculative_synthetic_acceptance_rates", [0.5, 0.5])])
def test_synthetic_acceptance_is_refused_without_its_switch(key: str, value: Any) -> None:
    flat = {"speculative_algorithm": "NGRAM", "speculative_num_steps": 2, key: value}
    with pytest.raises(ConfigError, match=key.replace("speculative_", "speculative.") + ".*benchmark-only"):
        build_config(flat=flat)
    ok = build_config(flat={**flat, "speculative_enable_synthetic_acceptance": True})
    assert ok.speculative.enable_synthetic_acceptance


@pytest.mark.parametrize("bad,match", [({"speculative_synthetic_acceptance_length": 4.5}, "more than num_steps"),
                                       ({"speculative_synthetic_acceptance_rates": [0.5]}, "num_steps = 3"),
                                       ({"speculative_synthetic_acceptance_rates": [0.5, 2.0, 0.0]}, r"\[0, 1\]")])
def test_synthetic_acceptance_targets_must_be_reachable(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(flat={"speculative_algorithm": "NGRAM", "speculative_num_steps": 3,
                           "speculative_enable_synthetic_acceptance": True, **bad})


@pytest.fixture(scope="module")
def draft(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama", seed=1, num_hidden_layers=1)


def forced_llm(tiny_model: Path, draft: Path, **forced: Any) -> LLM:
    return make_llm(tiny_model, **spec_kwargs("STANDALONE", draft), speculative_enable_synthetic_acceptance=True,
                    **forced)


PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(4)]


def test_a_forced_acceptance_length_is_met_by_the_drafters_real_drafts(tiny_model: Path, draft: Path) -> None:
    """The random draft model's own drafts are almost never right; forced, a verification keeps 2.6 tokens on
    average (capped near max_tokens only)."""
    llm = forced_llm(tiny_model, draft, speculative_synthetic_acceptance_length=2.6)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 100
    assert stats.spec_mean_accepted_length == pytest.approx(2.6, abs=0.12)


def test_forced_per_position_rates(tiny_model: Path, draft: Path) -> None:
    llm = forced_llm(tiny_model, draft, speculative_synthetic_acceptance_rates=[1.0, 0.5, 0.0])
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 80 for o in outs)
    stats = llm.engine.stats()
    per_pos = stats.spec_accepted_per_pos
    assert per_pos[0] == stats.spec_num_drafts and len(per_pos) == 2  # draft 0 always, draft 2 never
    assert per_pos[1] / per_pos[0] == pytest.approx(0.5, abs=0.12)


def test_serve_flags_reach_the_speculative_section() -> None:
    from appliance.config import parse_serve_args

    c = parse_serve_args(["m", "--speculative-algorithm", "ngram", "--speculative-num-steps", "4",
                          "--speculative-ngram-min-match-window-size", "2",
                          "--speculative-ngram-max-match-window-size", "5",
                          "--speculative-disable-by-batch-size", "8", "--speculative-ngram-proposer", "device"],
                         env={}).speculative
    assert (c.algorithm, c.num_steps, c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size,
            c.ngram_proposer) == ("NGRAM", 4, 2, 5, 8, "device")
    for method, want in (("draft_model", {"algorithm": "STANDALONE", "draft_model_path": "d"}),
                         ("deepseek_mtp", {"algorithm": "MTP"}), ("eagle3", {"algorithm": "EAGLE3", "draft_model_path": "d"}),
                         ("ngram_gpu", {"algorithm": "NGRAM", "ngram_proposer": "device"})):
        model = {} if want["algorithm"] in ("MTP", "NGRAM") else {"model": "d"}
        doc = json.dumps({"method": method, "num_speculative_tokens": 4, **model})
        got = parse_serve_args(["m", "--speculative-config", doc], env={}).speculative
        assert got.model_dump(exclude_defaults=True) == {**want, "num_steps": 4}, method  # vLLM's method names
    with pytest.raises(ConfigError, match="ngram_proposer"):  # meaningless without NGRAM
        parse_serve_args(["m", "--speculative-algorithm", "MTP", "--speculative-ngram-proposer", "device"], env={})
    s = parse_serve_args(["m", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
                          "--speculative-enable-synthetic-acceptance", "--speculative-synthetic-acceptance-length",
                          "2.6"], env={}).speculative
    assert (s.algorithm, s.draft_model_path, s.enable_synthetic_acceptance, s.synthetic_acceptance_length) == (
        "STANDALONE", "d", True, 2.6)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        parse_serve_args(["m", "--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "4",
                          "--speculative-ngram-max-match-window-size", "2"], env={})


@pytest.mark.parametrize("flat,path", [
    ({"speculative_algorithm": "MTP", "speculative_draft_model_quantization": "fp8"},
     "speculative.draft_model_quantization"),
    ({"speculative_algorithm": "MTP", "attention_backend": "torch", "drafter_attention_backend": "triton"},
     "backends.drafter_attention"),
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "d", "drafter_attention_backend": "flashinfer"},
     "backends.drafter_attention"),
    ({"speculative_algorithm": "MTP", "moe_backend": "torch", "draft_moe_backend": "triton"}, "backends.draft_moe"),
])
def test_drafter_settings_this_build_cannot_honour_are_refused(flat: dict[str, Any], path: str) -> None:
    from appliance.config import check_supported

    assert any(m.startswith(path + ":") for m in check_supported(build_config(flat=flat, env={})))


def test_a_standalone_drafter_runs_on_its_own_attention_backend(tiny_model: Path, draft: Path) -> None:
    from appliance.config import check_supported

    kw: dict[str, Any] = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft),
                          "drafter_attention_backend": "torch"}
    assert check_supported(build_config(flat={"model": str(tiny_model), **kw}, env={})) == []
    from appliance.executor.speculative_draft import _drafter_backend

    target = SimpleNamespace(backend="triton", device=torch.device("cpu"))  # a target on another backend
    unset = SimpleNamespace(backends=SimpleNamespace(drafter_attention=None))
    assert _drafter_backend(unset, target) == "triton"
    assert _drafter_backend(SimpleNamespace(backends=SimpleNamespace(drafter_attention="torch")), target) == "torch"
    llm = make_llm(tiny_model, **kw)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert llm.engine.stats().spec_num_drafts > 0


def test_the_lookahead_blocks_follow_the_drafter() -> None:
    from appliance.engine.speculation import lookahead_tokens

    assert [lookahead_tokens(a, 3) for a in ("MTP", "EAGLE3", "EAGLE", "STANDALONE", "NGRAM", None)] == [2, 2, 2, 3, 0, 0]
    flat = {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}
    cfg = EngineConfig.from_appliance(build_config(flat=flat, env={}), 1024, [], 512)
    assert (cfg.num_speculative_tokens, cfg.lookahead) == (3, 0)


def test_a_draft_model_holds_every_draft_at_block_boundaries(tiny_model: Path, draft: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's lookahead covers the draft model's chain (one position further than MTP's), so with
    max_model_len far away a draft model always holds num_steps drafts, whatever the block boundaries."""
    from appliance.executor.speculative import Speculator

    held: list[int] = []
    real = Speculator.complete_step

    def record(self: Speculator, step: Any) -> Any:
        result = real(self, step)
        held.extend(result.drafts.values())
        return result

    monkeypatch.setattr(Speculator, "complete_step", record)
    llm = make_llm(tiny_model, **spec_kwargs("STANDALONE", draft))
    llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 4, 5, 6)],
                 SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert len(held) > 40 and set(held) == {3}
