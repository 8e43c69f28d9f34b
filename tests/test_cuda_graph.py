"""CUDA graph sizes, padding and width buckets; the padded decode path against eager (CPU: no capture)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from decode_graphs import use_graphs

from appliance import LLM, SamplingParams
from appliance.executor.cuda_graph import (
    GRAPH_CONTEXT,
    DecodeGraphs,
    GraphKey,
    capture_sizes,
    decode_unsplit_from,
    graph_settings,
    lm_head_rows,
    padded_batch,
    rows_view,
    width_bucket,
)


def test_default_sizes_follow_max_num_seqs() -> None:
    assert capture_sizes(None, None, 512) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert capture_sizes(None, None, 20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(None, 3, 256) == [1, 2, 3]
    assert capture_sizes(None, 40, 256) == [1, 2, 4, 8, 16, 24, 32, 40]


def test_explicit_sizes_win_and_are_checked() -> None:
    assert capture_sizes([8, 1, 8, 4], None, 256) == [1, 4, 8]
    assert capture_sizes([1, 4, 64], 16, 256) == [1, 4]
    with pytest.raises(ValueError, match="positive ints"):
        capture_sizes([0, 4], None, 256)
    with pytest.raises(ValueError, match="positive ints"):
        capture_sizes([], None, 256)
    with pytest.raises(ValueError, match=">= 1"):
        capture_sizes(None, 0, 256)


def test_padded_batch_and_width_bucket() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert [padded_batch(sizes, n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, None]
    assert [width_bucket(n, 1000) for n in (1, 16, 17, 100, 600)] == [16, 16, 32, 128, 1000]
    assert width_bucket(5, 8) == 8
    with pytest.raises(ValueError, match="exceeds"):
        width_bucket(9, 8)


def _config(enforce_eager: bool = False) -> SimpleNamespace:
    return SimpleNamespace(backends=SimpleNamespace(enforce_eager=enforce_eager, cuda_graph_sizes=None,
                                                    cuda_graph_max_bs=16),
                           scheduler=SimpleNamespace(max_num_seqs=64))


def test_graph_settings_switches() -> None:
    llama = SimpleNamespace(supports_cuda_graphs=True)
    cuda = torch.device("cuda")
    assert graph_settings(_config(), llama, cuda) == [1, 2, 4, 8, 16]
    assert graph_settings(_config(enforce_eager=True), llama, cuda) is None
    assert graph_settings(_config(), SimpleNamespace(), cuda) is None  # a model that does not declare support
    assert graph_settings(_config(), llama, torch.device("cpu")) is None
    assert graph_settings(_config(), llama, cuda, backend="torch") is None  # reference kernels sync with the host
    import appliance.layers.parallel_state as ps

    saved = ps._STATE
    ps._STATE = ps.TensorParallelState(0, 2, object())  # a stand-in group: nothing communicates here
    try:
        assert graph_settings(_config(), llama, cuda) == [1, 2, 4, 8, 16]  # tensor parallel: graphs too
    finally:
        ps._STATE = saved
    assert graph_settings(_config(), llama, cuda) == [1, 2, 4, 8, 16]


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


def test_lm_head_rows_and_rows_view() -> None:
    assert [lm_head_rows([1, 2, 4, 8, 16], n) for n in (1, 3, 9, 16, 17)] == [1, 4, 16, 16, 17]
    assert lm_head_rows(None, 5) == 5
    static = torch.randn(8, 4)
    assert torch.equal(rows_view(static[:3], 6), static[:6])  # reads on into the static buffer
    assert torch.equal(rows_view(static[:3], 2), static[:2])
    assert rows_view(torch.randn(3, 4), 6) is None  # nothing past its end
    assert rows_view(static[:3, :2], 6) is None  # not contiguous
    assert rows_view(static[5:], 4) is None  # the storage ends 3 rows on


def test_logits_pad_rows_to_capture_sizes(tiny_model) -> None:
    llm = LLM(model=str(tiny_model), dtype="float32", skip_tokenizer_init=True, max_total_tokens=2048)
    runner = llm.executor.runner
    use_graphs(llm, [1, 2, 4, 8])
    seen: list[int] = []
    head = runner.model.compute_logits
    runner.model.compute_logits = lambda h: (seen.append(h.shape[0]), head(h))[1]  # type: ignore[method-assign]
    static = torch.randn(8, int(runner.hf_config.hidden_size))
    with torch.inference_mode():
        for hidden, rows in ((static[:3], [0, 1, 2]), (static[:5], [0, 1, 2, 3, 4]), (static, [6, 1, 3]),
                             (torch.randn(3, static.shape[1]), [0, 1, 2])):
            seen.clear()
            got = runner.logits(hidden, rows)
            assert torch.allclose(got, head(hidden[torch.tensor(rows)]), atol=1e-5), rows
            assert seen == [lm_head_rows([1, 2, 4, 8], len(rows))]
        seen.clear()
        assert runner.logits(static, list(range(8)) + [0]).shape[0] == 9 and seen == [9]  # above every size


def _record_launches(runner: Any) -> list[int]:
    """Each step the runner launches from now on, as its count of scheduled requests."""
    launched: list[int] = []
    launch = runner.launch
    runner.launch = lambda plan: (launched.append(len(plan.scheduled)), launch(plan))[1]
    return launched


def _key_graphs(unsplit_from: int | None, max_model_len: int = 131072, block_size: int = 16) -> DecodeGraphs:
    """Keys only (nothing runs): the 8B serving shape's default sizes (max_num_seqs 256)."""
    return DecodeGraphs(lambda *a: torch.zeros(0), 8, torch.float32, torch.device("cpu"),
                        capture_sizes(None, None, 256), -(-max_model_len // block_size), block_size,
                        unsplit_from=unsplit_from)


def _decodes(n: int, context: int, block_size: int = 16) -> list[Any]:
    """n one-token decode chunks whose longest row has `context` tokens (table_width reads only these)."""
    blocks = list(range(-(-context // block_size)))
    return [SimpleNamespace(start=context - 1, num_tokens=1, state=SimpleNamespace(block_ids=blocks))
            for _ in range(n)]


def test_unsplit_batches_share_one_width_up_to_the_graph_context() -> None:
    split = _key_graphs(None).keys_up_to(GRAPH_CONTEXT)
    shared = _key_graphs(33).keys_up_to(GRAPH_CONTEXT)  # 8 KV heads on 132 SMs (decode.unsplit_from)
    assert len(split) == 35 * 4 and len(shared) == 7 * 4 + 28  # 140 -> 56 captures at start-up
    assert shared[:35] == [GraphKey(b, 128) for b in reversed(capture_sizes(None, None, 256))]  # largest first
    assert shared[35:] == [GraphKey(b, w) for w in (64, 32, 16) for b in (32, 24, 16, 8, 4, 2, 1)]
    assert {k.width for k in shared if k.batch >= 33} == {128} and set(shared) <= set(split)
    # run-time keys: the same graphs the warm-up captured; wider tables keep their own bucket
    g = _key_graphs(33)
    assert g.key_for(_decodes(40, 100)) == GraphKey(40, 128) and g.key_for(_decodes(37, 700)) == GraphKey(40, 128)
    assert g.key_for(_decodes(8, 100)) == GraphKey(8, 16) and g.key_for(_decodes(30, 700)) == GraphKey(32, 64)
    assert g.key_for(_decodes(40, 3000)) == GraphKey(40, 256) and g.key_for(_decodes(3, 3000)) == GraphKey(4, 256)
    assert {g.key_for(_decodes(n, c)) for n in range(1, 257) for c in (1, 300, 1000, 2048)} <= set(shared)
    # a wider warm-up keeps the shared keys and adds the wider buckets
    wide = g.keys_up_to(4096)
    assert len(wide) == 35 + 56 and wide[:35] == [GraphKey(b, 256) for b in reversed(g.sizes)]
    # a short max_model_len: the shared width is the table's
    assert {k.width for k in _key_graphs(33, max_model_len=500).keys_up_to(GRAPH_CONTEXT)} == {32, 16}


def test_unsplit_from_matches_the_split_heuristic() -> None:
    from appliance.kernels.triton.decode import _sm_count, num_splits_for, unsplit_from

    cpu = torch.device("cpu")
    sms = _sm_count(cpu)
    for hkv in (1, 2, 4, 8, 16):
        b = unsplit_from(hkv, cpu)
        assert all(num_splits_for(b, hkv, ctx, sms) == 1 for ctx in (64, 2048, 1 << 20))
        assert num_splits_for(b - 1, hkv, 1 << 20, sms) > 1  # the smallest such batch
    layers = [SimpleNamespace(decode_unsplit_from=lambda d, n=n: unsplit_from(n, d)) for n in (8, 4)]
    assert decode_unsplit_from(layers, cpu) == unsplit_from(4, cpu)  # every layer unsplit: the fewest heads
    assert decode_unsplit_from(layers + [SimpleNamespace()], cpu) is None  # a layer without one (MLA)
    assert decode_unsplit_from([SimpleNamespace(decode_unsplit_from=lambda d: None)], cpu) is None


def test_padded_decode_path_matches_eager_on_cpu(tiny_model) -> None:
    llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, max_total_tokens=2048,
              skip_tokenizer_init=True)
    prompts = [[5, 6, 7], list(range(10, 80)), [9] * 21]  # 3 rows -> padded to 4; tables of 1..20 blocks
    eager = _greedy(llm, prompts, 12)
    graphs, _ = use_graphs(llm, [1, 2, 4, 8])
    runs: list[GraphKey] = []
    run = graphs.run
    graphs.run = lambda decodes, key, fix=None: (runs.append(key), run(decodes, key, fix))[1]  # type: ignore[method-assign]
    assert _greedy(llm, prompts, 12) == eager
    assert runs and {k.batch for k in runs} <= {1, 2, 4} and GraphKey(4, 32) in runs
    # a batch above every capture size runs eagerly
    runs.clear()
    assert _greedy(llm, prompts * 3, 3)[:3] == [e[:3] for e in eager]
    assert runs == []


def test_shared_width_graphs_match_eager_on_cpu(tiny_model) -> None:
    """Batches from unsplit_from on run one graph per size at the shared width, whatever their tables need."""
    llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, max_total_tokens=2048,
              skip_tokenizer_init=True)
    prompts = [[5, 6, 7], list(range(10, 80)), [9] * 21]
    eager = _greedy(llm, prompts, 12)
    graphs, _ = use_graphs(llm, [1, 2, 4, 8], unsplit_from=2)
    assert graphs.shared_width == min(GRAPH_CONTEXT // 4, llm.executor.runner.max_blocks) > 32
    runs: list[GraphKey] = []
    run = graphs.run
    graphs.run = lambda decodes, key, fix=None: (runs.append(key), run(decodes, key, fix))[1]  # type: ignore[method-assign]
    assert _greedy(llm, prompts, 12) == eager
    assert {k.width for k in runs if k.batch >= 2} == {graphs.shared_width}
    assert _greedy(llm, [list(range(10, 80))], 4) == [eager[1][:4]]
    assert runs[-1].batch == 1 and runs[-1].width == 32  # below unsplit_from: its own bucket


def test_warmup_leaves_results_unchanged(tiny_model) -> None:
    llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, max_total_tokens=2048,
              skip_tokenizer_init=True, max_num_seqs=8)
    prompts = [[5, 6, 7], list(range(10, 40))]
    before = _greedy(llm, prompts, 6)
    runner = llm.executor.runner
    graphs, _ = use_graphs(llm, [1, 2, 4, 8])
    runner._pad_prefills = True
    llm.engine.reset_prefix_cache()  # warm-up writes block 0: only before serving, or with nothing cached
    seeds, free_rows, live = runner._noise_seeds.getstate(), runner.block_table.num_free, set(runner.requests)
    launched = _record_launches(runner)
    assert runner.warmup(graph_context=64) >= 0.0
    assert {k.width for k in graphs.graphs} == {16} and {k.batch for k in graphs.graphs} == {1, 2, 4, 8}
    # its real steps (a prefill, a decode of ids in flight, a mixed step) left no request, row or seed behind
    assert launched == [3, 3, 4]
    assert set(runner.requests) == live and not runner._inflight and runner.block_table.num_free == free_rows
    assert runner._noise_seeds.getstate() == seeds
    assert _greedy(llm, prompts, 6) == before  # warm-up wrote only block 0 and no request state


@pytest.mark.parametrize(("max_num_seqs", "block_size", "steps"),
                         [(1, 4, [1, 1]), (2, 1, [1, 1, 2]), (3, 2, [2, 2, 3])])
def test_warmup_steps_fit_the_block_table(tiny_model, max_num_seqs: int, block_size: int, steps: list[int]) -> None:
    llm = LLM(model=str(tiny_model), dtype="float32", block_size=block_size, max_total_tokens=512,
              skip_tokenizer_init=True, max_num_seqs=max_num_seqs)
    runner = llm.executor.runner
    use_graphs(llm, [1, 2, 4, 8])
    launched = _record_launches(runner)
    runner.warmup(graph_context=16)
    assert launched == steps and runner.block_table.num_free == max_num_seqs and not runner.requests


def test_warmup_steps_skip_a_context_too_short_for_them(tiny_model) -> None:
    llm = LLM(model=str(tiny_model), dtype="float32", block_size=1, max_total_tokens=512, skip_tokenizer_init=True,
              max_model_len=3, chunked_prefill_size=8, max_num_seqs=2)
    runner = llm.executor.runner
    use_graphs(llm, [1, 2, 4, 8])
    launched = _record_launches(runner)
    runner.warmup(graph_context=2)
    assert launched == [] and runner.block_table.num_free == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_eager_on_gpu(tiny_model) -> None:
    llm = LLM(model=str(tiny_model), dtype="bfloat16", block_size=16, max_total_tokens=8192,
              skip_tokenizer_init=True, cuda_graph_max_bs=8)
    runner = llm.executor.runner
    assert runner.graphs is not None
    # the warm-up: every size at both width buckets of a 512-token context, one eager run per size
    assert set(runner.graphs.graphs) == {GraphKey(b, w) for b in (1, 2, 4, 8) for w in (16, 32)}
    assert runner.graphs.eager_sizes == {1, 2, 4, 8}
    prompts = [[5, 6, 7], list(range(10, 80)), [9] * 21, [3] * 300]
    with_graphs = _greedy(llm, prompts, 16)
    assert runner.graphs.graphs  # something was captured and replayed
    runner.use_graphs = False
    assert _greedy(llm, prompts, 16) == with_graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unsplit_batches_share_a_width_and_match_eager_on_gpu(tiny_model) -> None:
    """A decode batch past unsplit_from replays one graph whatever its tables need (the shared width), and gives
    eager's tokens exactly: its attention launch reads the width only as a bound past seq_len."""
    from appliance.kernels.triton.decode import unsplit_from

    llm = LLM(model=str(tiny_model), dtype="bfloat16", block_size=16, max_total_tokens=65536,
              skip_tokenizer_init=True, max_num_seqs=192, cuda_graph_bs=[8, 192])
    runner = llm.executor.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.unsplit_from == unsplit_from(2, runner.device) < 192  # 2 KV heads
    # one prefill step for all (under the 8192-token budget), then every decode step runs all of them: eager runs
    # unsplit too (a smaller eager batch would split, as it did before tables shared a width); every table fits
    # the narrowest bucket (16 blocks), which eager gathers, while the graph reads the shared width
    prompts = [[(7 * i + j) % 90 + 5 for j in range(3 + i % 40)] for i in range(graphs.unsplit_from + 8)]
    runs: list[GraphKey] = []
    run = graphs.run
    graphs.run = lambda decodes, key, fix=None: (runs.append(key), run(decodes, key, fix))[1]  # type: ignore[method-assign]
    with_graphs = _greedy(llm, prompts, 8)
    assert runs and set(runs) == {GraphKey(192, graphs.shared_width)} and graphs.shared_width > 16
    runner.use_graphs = False
    assert _greedy(llm, prompts, 8) == with_graphs
