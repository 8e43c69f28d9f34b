"""Speculative steps as decode rows (executor/verify_graphs.py, catch_up_graphs.py, draft_graphs.py): the upload's
layout, the same hidden states as the multi-token (prefill attention) path on every verification step of a run, the
drafter's catch-up drafting what its eager catch-up drafts, a chain's rows stopping at their limit, greedy tokens
equal to plain decoding through them on the CPU (the uncaptured bodies), and on a GPU the captured graphs give the
tokens of the eager path. GPU part: python -m pytest -q -m gpu tests/test_spec_verify_graphs.py
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import spec_fixtures
import torch
from spec_fixtures import NEW, gpu_llm, greedy, make_llm, spec_kwargs

from appliance.engine.sampling_params import SamplingParams as Params
from appliance.executor import speculative
from appliance.executor.draft_graphs import ChainGraphs
from appliance.executor.input_batch import Chunk, graph_stride
from appliance.executor.request_table import RequestState
from appliance.executor.verify_graphs import VerifyGraphs, verify_rows

PROMPTS = spec_fixtures.PROMPTS[:3]
eagle3_head = spec_fixtures.eagle3_head


def test_verify_rows_layout() -> None:
    a = RequestState("a", [1, 2, 3, 4, 5, 6], 3, 3, [7, 9], Params(), table_row=2)
    b = RequestState("b", [8, 8, 8, 8, 4], 4, 4, [5, 6], Params(), table_row=1)
    out = np.full(5 * graph_stride(8) + 3, 99, dtype=np.int64)
    verify_rows([Chunk(a, 3, 3, True), Chunk(b, 4, 1, True)], 4, 8, out)
    v = out[: 5 * 8].reshape(5, 8)
    assert v[0].tolist() == [4, 5, 6, 8 - 4, 0, 0, 0, 0]  # token ids, then padding
    assert v[1].tolist() == [2, 2, 2, 1, 0, 0, 0, 0]  # table rows (0: the zero row)
    assert v[2].tolist() == [3, 4, 5, 4, 0, 0, 0, 0]  # positions
    assert v[3].tolist() == [7 * 4 + 3, 9 * 4, 9 * 4 + 1, 6 * 4, -1, -1, -1, -1]  # slots (-1: stored nowhere)
    assert v[4].tolist() == [4, 5, 6, 5, 0, 0, 0, 0]  # seq lens: each row sees itself and what precedes it
    assert out[5 * 8 :].tolist() == [99, 99, 99]  # nothing past the five segments


def test_verify_batches_follow_what_the_config_needs() -> None:
    from types import SimpleNamespace

    from appliance.config import build_config
    from appliance.executor.verify_graphs import MAX_VERIFY_BATCH, verify_batches

    def batches(state_cache: object = None, backend: str = "torch", **flat: Any) -> list[int] | None:
        config = build_config(flat={"speculative_algorithm": "NGRAM", **flat})
        runner = SimpleNamespace(config=config, state_cache=state_cache, backend=backend,
                                 device=torch.device("cpu"), model=None)
        return verify_batches(runner)  # type: ignore[arg-type]

    assert batches(max_num_seqs=16) == [1, 2, 4, 8, 16]
    assert batches(max_num_seqs=16, speculative_disable_by_batch_size=4) == [1, 2, 4]  # no drafts above it
    assert batches(max_num_seqs=512)[-1] == MAX_VERIFY_BATCH  # larger steps run eagerly
    assert batches(max_num_seqs=16, cuda_graph_bs=[3, 6]) == [3, 6]
    assert batches(state_cache=object()) is None  # hybrid models: multi-token verification
    assert batches(backend="flashinfer") is None


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_decode_rows_match_the_multi_token_path(tiny_model: Path, eagle3_head: Path, algorithm: str) -> None:
    """Every verification step runs both ways (the second re-stores the same K/V); hidden states agree."""
    reference = greedy(make_llm(tiny_model), PROMPTS, NEW)
    draft = {"speculative_draft_model_path": str(eagle3_head)} if algorithm == "EAGLE3" else {}
    llm = make_llm(tiny_model, speculative_algorithm=algorithm, speculative_num_steps=3, **draft)
    spec = llm.executor.runner.spec
    assert isinstance(spec.verify_graphs, VerifyGraphs)
    compared: list[int] = []
    run_step = spec.verify_graphs.run_step

    def both(chunks: list[Chunk]) -> Any:
        ordered, starts, hidden = spec.runner._forward(chunks)
        want = {c.state.request_id: hidden[s : s + c.num_tokens].clone() for c, s in zip(ordered, starts)}
        got = run_step(chunks)
        assert got is not None
        for c, s in zip(chunks, got[0]):
            torch.testing.assert_close(got[1][s : s + c.num_tokens], want[c.state.request_id], atol=1e-4, rtol=1e-4)
        compared.append(sum(c.num_tokens for c in chunks))
        return got

    spec.verify_graphs.run_step = both  # type: ignore[method-assign]
    assert greedy(llm, PROMPTS, NEW) == reference
    assert compared and max(compared) > len(PROMPTS)  # verifications of several rows per request ran
    assert llm.engine.stats().spec_num_drafts > 0 and llm.engine.check_accounting().ok


def test_verification_above_the_buckets_takes_the_multi_token_path(tiny_model: Path) -> None:
    llm = make_llm(tiny_model, speculative_algorithm="NGRAM", speculative_num_steps=3, cuda_graph_bs=[1])
    spec = llm.executor.runner.spec
    assert spec.verify_graphs.sizes == [4]  # one request of 1 + 3 tokens
    ran: list[bool] = []
    run_step = spec.verify_graphs.run_step

    def record(chunks: list[Chunk]) -> Any:
        got = run_step(chunks)
        ran.append(got is not None)
        return got

    spec.verify_graphs.run_step = record  # type: ignore[method-assign]
    reference = greedy(make_llm(tiny_model), PROMPTS, NEW)
    assert greedy(llm, PROMPTS, NEW) == reference
    assert not all(ran)  # three requests verifying drafts: more rows than the one bucket
    if any(ran):
        assert spec.verify_graphs.last_key is not None and spec.verify_graphs.last_key.batch == 4


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE3"])
def test_catch_up_rows_draft_what_the_eager_catch_up_drafts(tiny_model: Path, eagle3_head: Path,
                                                           make_tiny_model: Any, algorithm: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """After every verify-graph step the drafter catches up both ways (the second re-stores the same K/V): the
    same drafts. The host path's catch-up (the device path equals it: tests/test_spec_device_proposal.py)."""
    monkeypatch.setattr(speculative, "proposes_on_device", lambda *_: False)
    drafter = eagle3_head if algorithm == "EAGLE3" else make_tiny_model("llama", seed=1, num_hidden_layers=1)
    llm = make_llm(tiny_model, **spec_kwargs(algorithm, drafter))
    spec = llm.executor.runner.spec
    assert spec.catch_up_graphs is not None
    propose, compared = spec._propose, []

    def both(chunks: list[Chunk], *args: Any) -> None:
        on_graphs = spec._verified_on_graphs
        propose(chunks, *args)
        if not on_graphs:
            return
        via_graphs = {c.state.request_id: spec.drafts.get(c.state.request_id) for c in chunks}
        cu, spec.catch_up_graphs = spec.catch_up_graphs, None
        try:
            propose(chunks, *args)
        finally:
            spec.catch_up_graphs = cu
        assert via_graphs == {c.state.request_id: spec.drafts.get(c.state.request_id) for c in chunks}
        compared.append(sum(1 for d in via_graphs.values() if d))

    spec._propose = both  # type: ignore[method-assign]
    reference = greedy(make_llm(tiny_model), PROMPTS, NEW)
    assert greedy(llm, PROMPTS, NEW) == reference
    assert compared and max(compared) == len(PROMPTS)  # every request drafted from the catch-up rows


def test_chain_drafts_stop_at_the_limit(tiny_model: Path, eagle3_head: Path) -> None:
    """A chain's rows past their block table store nothing and lose those drafts; the others run on."""
    llm = make_llm(tiny_model, **spec_kwargs("EAGLE3", eagle3_head, steps=4))
    spec = llm.executor.runner.spec
    chains = spec.chains
    assert isinstance(chains, ChainGraphs) and chains.captured == 0  # CPU: uncaptured
    r = spec.runner
    tables = [[1, 5], [2, 6], [3, 7, 9]]
    states = [RequestState(f"r{i}", [3] * 6, 6, 6, t, Params()) for i, t in enumerate(tables)]
    for st in states:
        r.requests[st.request_id] = st
    r.block_table.apply(*(torch.from_numpy(x) for x in r.block_table.delta(states)))
    k_cache = spec.head.attention_layers()[0].k_cache
    before = k_cache.clone()
    with torch.inference_mode():
        drafts = chains.run(states, torch.tensor([7, 8, 9]), [6, 6, 6], torch.randn(3, 64), [8, 6, 12])
    assert [len(d) for d in drafts] == [3, 1, 4] and [d[0] for d in drafts] == [7, 8, 9]
    changed = (k_cache != before).flatten(2).any(dim=2).nonzero().tolist()  # (block, offset) of written slots
    # chain step i writes position 6 + i - 1: row 0 positions 6, 7 (block 5); row 1 none (its limit is 6);
    # row 2 positions 6, 7, 8 (blocks 7 and 9)
    assert changed == [[5, 2], [5, 3], [7, 2], [7, 3], [9, 0]]
    for st in states:
        del r.requests[st.request_id]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_verify_graphs_match_eager(tiny_model: Path, eagle3_head: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = greedy(gpu_llm(tiny_model, max_num_seqs=8), PROMPTS, 32)
    llm = gpu_llm(tiny_model, max_num_seqs=8, speculative_algorithm="EAGLE3",
                  speculative_draft_model_path=str(eagle3_head), speculative_num_steps=3)
    spec = llm.executor.runner.spec
    graphs, chains = spec.verify_graphs, spec.chains
    assert graphs is not None and graphs.cuda and graphs.graphs  # captured at start-up
    assert chains is not None and chains.captured >= len(PROMPTS) and chains.graphs
    assert greedy(llm, PROMPTS, 32) == reference
    assert graphs.last_key is not None and chains.last_key is not None  # both replayed a graph
    assert spec.catch_up_graphs is not None and spec.catch_up_graphs.last_key is not None
    spec.verify_graphs = None  # the multi-token eager path
    chains.captured = 0
    chains.graphs.clear()  # the chains' body uncaptured
    assert greedy(llm, PROMPTS, 32) == reference
    assert llm.engine.stats().spec_num_drafts > 0 and llm.engine.check_accounting().ok
