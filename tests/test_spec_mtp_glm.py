"""GLM-4.5's MTP layer as the drafter (speculative.algorithm = MTP): a tiny Glm4Moe checkpoint with one MTP layer
in the shipped layout (layer num_hidden_layers: a GLM decoder layer plus enorm / hnorm / eh_proj / shared_head)
loads it, drafts with it (chains and draft trees), and gives transformers' greedy tokens, with the MTP's own drafts
and with an oracle's mostly right ones (accepted and rejected paths); a checkpoint without the layer loads with no
drafter."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from spec_fixtures import MTP_NEW, MTP_PROMPTS, greedy, make_llm, oracle
from spec_heads import append_mtp_layer
from test_moe_models import FAMILIES, TINY

PROMPTS, NEW = MTP_PROMPTS[:3], MTP_NEW


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(plain checkpoint, the same plus one MTP layer): transformers' save drops MTP weights, so they are
    appended, the last decoder layer perturbed, as the model ships them."""
    import transformers
    from safetensors.torch import load_file, save_file

    plain = tmp_path_factory.mktemp("glm_plain")
    _, _, extra = FAMILIES["glm4_moe"]
    cfg = transformers.Glm4MoeConfig(**{**TINY, **extra})
    cfg.architectures = ["Glm4MoeForCausalLM"]
    torch.manual_seed(0)
    transformers.Glm4MoeForCausalLM(cfg).to(torch.float32).save_pretrained(str(plain))
    mtp_dir = tmp_path_factory.mktemp("glm_mtp")
    tensors = load_file(str(plain / "model.safetensors"))
    append_mtp_layer(tensors, TINY["num_hidden_layers"], TINY["hidden_size"], torch.Generator().manual_seed(1))
    save_file(tensors, str(mtp_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg.num_nextn_predict_layers = 1
    cfg.save_pretrained(str(mtp_dir))
    return plain, mtp_dir


@pytest.mark.parametrize("steps", [1, 2])
def test_glm_mtp_drafts_keep_the_targets_tokens(glm_dirs: tuple[Path, Path], hf_greedy: Any,
                                                monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    plain, mtp_dir = glm_dirs
    refs = [t for t, _ in hf_greedy(plain, PROMPTS, NEW + 8)]  # the MTP layer changes nothing the target computes
    llm = make_llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=steps)
    assert len(llm.executor.runner.model.mtp) == 1
    assert greedy(llm, PROMPTS, NEW) == [r[:NEW] for r in refs]  # its own drafts (random weights: mostly rejected)
    oracle(monkeypatch, {tuple(p): r for p, r in zip(PROMPTS, refs)}, wrong=3)
    llm = make_llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=steps)
    assert greedy(llm, PROMPTS, NEW) == [r[:NEW] for r in refs]
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    assert llm.engine.check_accounting().ok


def tree_oracle(monkeypatch: pytest.MonkeyPatch, refs: dict[tuple, list[int]], wrong: int) -> None:
    """After the MTP layer drafts its trees, replace each by [x, a, y, b]: a wrong child x of the root, the true
    next token a, a wrong child y of a, the true token b after a (about one in `wrong` of a, b corrupted), so an
    accepted path runs over rows 0, 2, 4 and its nodes move."""
    from appliance.executor.draft_tree import DraftTree
    from appliance.executor.speculative_mtp import MtpSpeculator

    real = MtpSpeculator._propose

    def propose(self: MtpSpeculator, *args: Any) -> None:
        real(self, *args)
        for rid, tree in list(self.trees.items()):
            st = self.runner.requests[rid]
            done = len(st.token_ids) - st.num_prompt_tokens
            want = refs.get(tuple(st.token_ids[: st.num_prompt_tokens]), [])[done : done + 2]
            if len(want) < 2 or len(tree) < 4:
                continue
            a, b = ((t + 1) % TINY["vocab_size"] if (done * 7 + j * 5) % wrong == 0 else t for j, t in enumerate(want))
            nodes = DraftTree(((a + 3) % TINY["vocab_size"], a, (b + 3) % TINY["vocab_size"], b), (-1, -1, 1, 1))
            self.trees[rid], self._drafts[rid] = nodes, list(nodes.tokens)

    monkeypatch.setattr(MtpSpeculator, "_propose", propose)


@pytest.mark.parametrize("oracle_drafts", [False, True])
def test_glm_mtp_trees_keep_the_targets_tokens(glm_dirs: tuple[Path, Path], hf_greedy: Any,
                                               monkeypatch: pytest.MonkeyPatch, oracle_drafts: bool) -> None:
    """Draft trees from the MTP layer (eagle_topk 2, 2 steps, 4 nodes): the same tokens, with its own trees and
    with an oracle's first logits (mostly right roots: multi-node paths accepted and moved)."""
    plain, mtp_dir = glm_dirs
    refs = [t for t, _ in hf_greedy(plain, PROMPTS, NEW + 8)]
    if oracle_drafts:
        tree_oracle(monkeypatch, {tuple(p): r for p, r in zip(PROMPTS, refs)}, wrong=4)
    llm = make_llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=2, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=5)
    assert llm.executor.runner.spec.tree is not None
    assert greedy(llm, PROMPTS, NEW) == [r[:NEW] for r in refs]
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_drafts and llm.engine.check_accounting().ok
    if oracle_drafts:  # most roots' true child accepted, often the one after it too
        assert stats.spec_accepted_per_pos[0] > stats.spec_num_drafts // 2 and stats.spec_accepted_per_pos[1] > 0


def test_glm_without_mtp_layer_has_no_drafter(glm_dirs: tuple[Path, Path]) -> None:
    plain, _ = glm_dirs
    assert len(make_llm(plain).executor.runner.model.mtp) == 0
    with pytest.raises(ValueError, match="multi-token-prediction"):
        make_llm(plain, speculative_algorithm="MTP", speculative_num_steps=1)
