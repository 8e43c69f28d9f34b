"""Speculative decoding on hybrid linear-attention models: the MTP layer of Qwen3-Next / Qwen3.5 drafts
(speculative.algorithm = MTP), and a verification that rejects drafts puts the recurrent state back and recomputes
the kept tokens (executor/speculative_states.py). Greedy tokens equal transformers' (and so the run without
speculation) with the MTP's own drafts (random weights: mostly rejected) and with an oracle's mostly right ones
(accepted and rejected paths), under chunked prefill and prefix hits that restore state snapshots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from spec_fixtures import greedy, make_llm, oracle

from appliance import SamplingParams
from tests.test_models_vs_transformers import PROMPTS

NEW = 10
LONG = list(range(3, 3 + 45))  # three 16-token chunks


def with_mtp_layer(plain: Path, out: Path) -> Path:
    """The checkpoint plus one MTP layer in the shipped layout (mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0 = a
    full-attention decoder layer, mtp.norm): transformers' save drops it, so it is appended, copied from the last
    full-attention layer and perturbed."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in plain.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((plain / "config.json").read_text())
    tensors = load_file(str(plain / "model.safetensors"))
    last = max(i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention")
    gen = torch.Generator().manual_seed(1)
    src, hidden = f"model.layers.{last}.", cfg["hidden_size"]
    for name, t in list(tensors.items()):
        if name.startswith(src):
            tensors[name.replace(src, "mtp.layers.0.")] = t + 0.05 * torch.randn(t.shape, generator=gen)
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=gen)  # zero-centred (1 + w)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def hybrid_dirs(make_tiny_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    plain = make_tiny_model("qwen3_next")
    return plain, with_mtp_layer(plain, tmp_path_factory.mktemp("qwen3_next_mtp"))


@pytest.mark.parametrize("steps", [1, 3])
def test_mtp_drafts_keep_the_targets_tokens(hybrid_dirs: tuple[Path, Path], hf_greedy: Any,
                                            monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    plain, mtp_dir = hybrid_dirs
    prompts = PROMPTS[:3] + [LONG]
    refs = [t for t, _ in hf_greedy(plain, prompts, NEW + 8)]  # the MTP layer changes nothing the target computes
    llm = make_llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=steps, chunked_prefill_size=16)
    assert llm.executor.runner.model.mtp is not None
    assert greedy(llm, prompts, NEW) == [r[:NEW] for r in refs]  # its own drafts
    oracle(monkeypatch, {tuple(p): r for p, r in zip(prompts, refs)}, wrong=3)
    llm = make_llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=steps, chunked_prefill_size=16)
    assert greedy(llm, prompts, NEW) == [r[:NEW] for r in refs]
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    assert llm.executor.runner.spec.recomputed > 0  # rejections rolled the state back
    assert llm.engine.check_accounting().ok


def test_mtp_with_state_snapshots(hybrid_dirs: tuple[Path, Path], hf_greedy: Any,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A second turn extending the first hits the prefix cache: the snapshot restored in a speculative step."""
    plain, mtp_dir = hybrid_dirs
    second = LONG[:43] + [200, 201, 202]
    refs = [t for t, _ in hf_greedy(plain, [LONG, second], NEW + 8)]
    oracle(monkeypatch, {tuple(LONG): refs[0], tuple(second): refs[1]}, wrong=3)
    llm = make_llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=2, chunked_prefill_size=16,
                   enable_prefix_caching=True, ssm_checkpoint_interval=8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in (LONG, second)]
    assert [o.outputs[0].token_ids for o in outs] == [r[:NEW] for r in refs]
    hit = outs[1].num_cached_tokens  # cut to a checkpoint with a snapshot
    assert hit >= 16 and hit % 8 == 0 and llm.engine.scheduler.snapshots.num_restored == 1


def test_ngram_drafts_on_a_hybrid_model(hybrid_dirs: tuple[Path, Path], hf_greedy: Any) -> None:
    plain, _ = hybrid_dirs
    prompts = [[7, 8, 9] * 6, [5, 6] * 9 + [5]]  # repeats: prompt lookup proposes, the target rejects some
    refs = [t for t, _ in hf_greedy(plain, prompts, NEW)]
    llm = make_llm(plain, speculative_algorithm="NGRAM", speculative_num_steps=3)
    assert greedy(llm, prompts, NEW) == refs
    assert llm.engine.stats().spec_num_draft_tokens > 0


def test_mtp_needs_the_layer(hybrid_dirs: tuple[Path, Path]) -> None:
    plain, mtp_dir = hybrid_dirs
    assert make_llm(mtp_dir).executor.runner.model.mtp is None  # built only to draft with
    with pytest.raises(ValueError, match="multi-token-prediction"):
        make_llm(plain, speculative_algorithm="MTP", speculative_num_steps=1)


def test_overlap_with_drafts_is_refused_for_recurrent_state(hybrid_dirs: tuple[Path, Path]) -> None:
    plain, _ = hybrid_dirs  # state rollback and snapshots follow the plan's chunk, which a clamp would change
    with pytest.raises(ValueError, match="recurrent-state layers; turn scheduler.enable_overlap off"):
        make_llm(plain, speculative_algorithm="NGRAM", speculative_num_steps=3, enable_overlap_schedule=True)


def test_draft_trees_are_refused_for_recurrent_state(hybrid_dirs: tuple[Path, Path]) -> None:
    _, mtp_dir = hybrid_dirs  # a linear-attention layer's state advances along one sequence, not a tree
    with pytest.raises(ValueError, match="eagle_topk=2: draft trees cannot run .*recurrent-state"):
        make_llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=2, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=4)
