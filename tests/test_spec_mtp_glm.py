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
from test_moe_models import FAMILIES, TINY
from test_spec_mtp import oracle

from appliance import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 50, 51], [90] * 3 + list(range(100, 120))]
NEW = 10


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
    gen = torch.Generator().manual_seed(1)
    n, hidden = TINY["num_hidden_layers"], TINY["hidden_size"]
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            tensors[name.replace(last, mtp)] = t + 0.05 * torch.randn(t.shape, generator=gen)
    head = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
            "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=gen),
            "shared_head.norm.weight": torch.ones(hidden), "shared_head.head.weight": tensors["lm_head.weight"],
            "embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    tensors.update({mtp + k: v.clone() for k, v in head.items()})
    save_file(tensors, str(mtp_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg.num_nextn_predict_layers = 1
    cfg.save_pretrained(str(mtp_dir))
    return plain, mtp_dir


def _generate(llm: LLM, new: int = NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _llm(path: Path, **kw: Any) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=4, skip_tokenizer_init=True, **kw)


@pytest.mark.parametrize("steps", [1, 2])
def test_glm_mtp_drafts_keep_the_targets_tokens(glm_dirs: tuple[Path, Path], hf_greedy: Any,
                                                monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    plain, mtp_dir = glm_dirs
    refs = [t for t, _ in hf_greedy(plain, PROMPTS, NEW + 8)]  # the MTP layer changes nothing the target computes
    llm = _llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=steps)
    assert len(llm.executor.runner.model.mtp) == 1
    assert _generate(llm) == [r[:NEW] for r in refs]  # its own drafts (random weights: mostly rejected)
    oracle(monkeypatch, {tuple(p): r for p, r in zip(PROMPTS, refs)}, wrong=3)
    llm = _llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=steps)
    assert _generate(llm) == [r[:NEW] for r in refs]
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
    llm = _llm(mtp_dir, speculative_algorithm="MTP", speculative_num_steps=2, speculative_eagle_topk=2,
               speculative_num_draft_tokens=5)
    assert llm.executor.runner.spec.tree is not None
    assert _generate(llm) == [r[:NEW] for r in refs]
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_drafts and llm.engine.check_accounting().ok
    if oracle_drafts:  # most roots' true child accepted, often the one after it too
        assert stats.spec_accepted_per_pos[0] > stats.spec_num_drafts // 2 and stats.spec_accepted_per_pos[1] > 0


def test_glm_without_mtp_layer_has_no_drafter(glm_dirs: tuple[Path, Path]) -> None:
    plain, _ = glm_dirs
    assert len(_llm(plain).executor.runner.model.mtp) == 0
    with pytest.raises(ValueError, match="multi-token-prediction"):
        _llm(plain, speculative_algorithm="MTP", speculative_num_steps=1)
