"""The device n-gram proposer (speculative.ngram_proposer = device): batched torch lookups propose exactly the host
proposer's drafts on random histories with repeats (every length, match window and draft count), its device
history follows the requests through growth and row reuse, and through the offline LLM it drafts, accepts and
generates what the host proposer does."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.engine.sampling_params import SamplingParams as Params
from appliance.executor.request_table import RequestState
from appliance.executor.speculative_ngram import ngram_propose
from appliance.executor.speculative_ngram_device import DeviceHistory, ngram_propose_batch


def _histories(seed: int, count: int) -> list[np.ndarray]:
    """Short histories over a small alphabet (so suffixes recur), some with copied spans, some tiny."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(1, 40))
        t = rng.integers(0, int(rng.integers(2, 9)), size=n)
        if n > 10 and rng.random() < 0.5:  # copy a span of itself to the end, as code edits do
            a = int(rng.integers(0, n - 5))
            t = np.concatenate([t, t[a : a + int(rng.integers(2, 6))]])
        out.append(t.astype(np.int64))
    return out


@pytest.mark.parametrize("min_n,max_n,k", [(1, 3, 3), (2, 4, 5), (1, 1, 1), (3, 5, 2)])
def test_batched_lookup_equals_the_host_proposer(min_n: int, max_n: int, k: int) -> None:
    hist = _histories(min_n * 100 + max_n * 10 + k, 300)
    width = max(len(h) for h in hist) + 3  # padding past every row's length
    tokens = torch.full((len(hist), width), 99, dtype=torch.int32)  # padding that could match if read
    for i, h in enumerate(hist):
        tokens[i, : len(h)] = torch.from_numpy(h)
    lengths = torch.tensor([len(h) for h in hist])
    drafts, counts = ngram_propose_batch(tokens, lengths, min_n, max_n, k)
    got = [[t for t in row if t >= 0] for row in drafts.tolist()]
    want = [ngram_propose(h, min_n, max_n, k) for h in hist]
    assert got == want
    assert counts.tolist() == [len(w) for w in want]
    assert sum(1 for w in want if w) > 100  # the cases really propose


def test_device_history_follows_growth_and_row_reuse() -> None:
    hist = DeviceHistory(rows=4, max_len=1024, device=torch.device("cpu"))
    a = RequestState("a", [1, 2, 3, 1, 2], 5, 5, [0], Params())
    a.table_row = 1
    b = RequestState("b", [7, 8, 7], 3, 3, [0], Params())
    b.table_row = 2
    hist.update([a, b])
    assert hist.propose([a, b], 1, 3, 3) == [[3, 1, 2], [8, 7]]
    a.token_ids += [3] * 300 + [9, 4, 1, 2]  # past the first width: the buffer grows, the prefix stays
    hist.update([a])
    assert hist.tokens.shape[1] == 512
    assert hist.propose([a], 2, 3, 2) == [ngram_propose(np.asarray(a.token_ids), 2, 3, 2)] == [[3, 3]]
    hist.forget("b")  # b finished; c reuses its row and must not see b's tokens
    c = RequestState("c", [5, 6], 2, 2, [0], Params())
    c.table_row = 2
    hist.update([c])
    assert hist.propose([c], 1, 3, 3) == [[]] and hist.tokens[2, :2].tolist() == [5, 6]


def test_the_device_proposer_generates_what_the_host_one_does(tiny_model: Path) -> None:
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
                                                 list(range(40, 60)) + list(range(40, 50)))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = {}
    for proposer in ("host", "device"):
        llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, skip_tokenizer_init=True,
                  speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_ngram_proposer=proposer)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        s = llm.engine.stats()
        runs[proposer] = (outs, s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)
    assert runs["device"] == runs["host"]
    assert runs["device"][1] > 0
