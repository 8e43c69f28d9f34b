"""executor/host_copy.py: the host tier's copies beside the forward. On the CPU a recording copy stream shows the
order the GPU path relies on (each layer's copies closed by a marker, the forward waiting for layer i just
before layer i uses its cache, layer after layer) with the outputs unchanged; on a GPU the side stream's copies
are checked against the bytes, with a kernel rewriting a block right after its store. A forward run as CUDA-graph
pieces waits for layer i's copies just before the piece that stores into layer i's cache."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tier_fixtures import Recording, assert_stored_then_loaded, cuda_caches

from appliance import LLM
from appliance.engine.sampling_params import SamplingParams
from appliance.executor.host_copy import HostCopier
from appliance.executor.kv_cache import KVCacheSpec, allocate_host
from appliance.executor.piecewise import Pieces, PiecewiseGraphs, bucket_for, replay

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_the_forward_waits_for_each_layers_copies_just_before_that_layer(tiny_model: Path) -> None:
    common = {"model": str(tiny_model), "dtype": "float32", "block_size": 4, "max_total_tokens": 64, "max_model_len": 64,
                  "enable_overlap_schedule": False, "device": "cpu"}  # eager steps: a GPU's graphs wait per step
    llm = LLM(**common, host_cache=True, host_cache_ratio=4)
    runner = llm.executor.runner
    copier = runner.host_copier
    assert copier.layerwise and len(copier.device_caches) >= 2
    log: list[tuple[str, int]] = []
    copier.stream = Recording(log)
    layers = runner.model.attention_layers()
    for i, layer in enumerate(layers):  # log each layer's use of its cache after its wait
        hook = layer.kv_ready
        layer.kv_ready = (lambda h=hook, i=i: (h(), log.append(("use", i))))
    prompts = [list(range(10 + 30 * i, 38 + 30 * i)) for i in range(4)]  # 4 x 7 blocks > the 16 of the pool
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts[:1], GREEDY)  # evicted by the others: loaded back from the host
    assert llm.engine.scheduler.cache.host.num_loaded > 0 and again[0].num_cached_tokens > 0
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    n = len(layers)
    steps = [i for i, e in enumerate(log) if e[0] == "begin"]
    assert steps
    for at in steps:
        marks = log[at + 1:at + 1 + n]
        assert [e[0] for e in marks] == ["mark"] * n
        # layer by layer: wait for layer i's marker, then layer i uses its cache (maybe more than once), then
        # layer i + 1's turn
        after = [e for e in log[at + 1 + n:] if e[0] in ("wait", "use")]
        order = [e for j, e in enumerate(after) if j == 0 or e != after[j - 1]][:2 * n]
        assert order == [x for i in range(n) for x in (("wait", marks[i][1]), ("use", i))]

def recording_copier(seed: int) -> tuple[HostCopier, list[tuple[str, int]]]:
    """A copier over three random layers' caches (6 blocks) and a 4-slot host pool, whose waits and uses are logged."""
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    dev = [(torch.randn(6, 4, 2, 8, generator=gen), torch.randn(6, 4, 2, 8, generator=gen)) for _ in range(3)]
    log: list[tuple[str, int]] = []
    return HostCopier(dev, allocate_host(spec, 4, torch.device("cpu")), Recording(log)), log


def test_a_graph_replayed_or_unhooked_forward_waits_for_the_last_marker() -> None:
    copier, log = recording_copier(seed=1)
    dev = copier.device_caches

    class Plain:  # a layer without the hook: the forward must wait for everything up front
        pass

    copier.bind_layers([Plain(), Plain(), Plain()])
    assert not copier.layerwise
    copier.submit([(0, 1, 0), (0, 2, 1), (1, 5, 0)])
    copier.wait_all()
    copier.wait_all()  # nothing left: no second wait
    assert log == [("begin", -1), ("mark", 1), ("mark", 2), ("mark", 3), ("wait", 3)]
    assert torch.equal(dev[2][0][5], dev[2][0][1]) and torch.equal(copier.host_caches[0][1][1], dev[0][1][2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_side_stream_copies_are_ordered_against_the_compute_stream() -> None:
    cuda = torch.device("cuda")
    spec, dev = cuda_caches()
    copier = HostCopier.for_device(dev, allocate_host(spec, 32, cuda), cuda)
    for k, v in dev:  # queued on the compute stream before the stores: the stores must see it
        k[0:8].mul_(2)
        v[0:8].mul_(2)
    before = [(k[0:8].cpu(), v[0:8].cpu()) for k, v in dev]
    copier.submit([(0, b, b) for b in range(8)] + [(1, 40 + b, b) for b in range(8)])
    for i, (k, v) in enumerate(dev):  # the forward rewrites the stored blocks once its layer waited
        copier.wait_layer(i)
        k[0:8].zero_()
        v[0:8].zero_()
    copier.wait_all()
    torch.cuda.synchronize()
    assert_stored_then_loaded(dev, before, copier.host_caches)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_side_stream_reloads_are_token_exact_on_cuda(tiny_model: Path, eager: bool, write_policy: str) -> None:
    # eager: layer-by-layer waits; graphs: the per-step wait before decode graphs, per layer before piecewise
    # pieces; write-through stores waited for by the next step
    from appliance.executor.host_copy import SideStream

    common = {"model": str(tiny_model), "dtype": "bfloat16", "block_size": 16, "max_total_tokens": 512, "max_model_len": 256,
                  "device": "cuda", "enforce_eager": eager}
    tiered = LLM(**common, host_cache=True, host_cache_ratio=4, host_cache_write_policy=write_policy)
    cold = LLM(**common, enable_prefix_caching=False)
    assert isinstance(tiered.executor.runner.host_copier.stream, SideStream)
    def ids(seed: int, n: int) -> list[int]:  # distinct prompts within the tiny vocabulary
        rng = random.Random(seed)
        return [rng.randrange(20, 380) for _ in range(n)]

    sessions = [ids(i, 160) for i in range(2)]
    floods = [[ids(100 + 10 * t + j, 180) for j in range(3)] for t in range(2)]
    batches = [sessions, floods[0], [s + ids(50, 40) for s in sessions], floods[1],
               [s + ids(50, 40) + ids(60, 20) for s in sessions]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for batch in batches:
        ours = tiered.generate(batch, greedy)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in cold.generate(batch, greedy)]
    assert tiered.engine.scheduler.cache.host.num_loaded > 0


def test_forward_pieces_wait_for_each_layers_copies_just_before_the_piece_that_stores_into_it() -> None:
    # piecewise.replay: piece i stores layer i's K/V (captured), then its attention runs eagerly
    copier, log = recording_copier(seed=2)

    class Layer:
        kv_ready = None

    class Graph:
        def __init__(self, i: int) -> None:
            self.i = i

        def replay(self) -> None:
            log.append(("piece", self.i))

    layers = [Layer(), Layer(), Layer()]
    copier.bind_layers(layers)
    assert copier.layerwise
    copier.submit([(0, 1, 0), (1, 5, 0)])
    replay(Pieces([Graph(i) for i in range(4)], layers), lambda layer: log.append(("attend", layers.index(layer))))
    assert log == [("begin", -1), ("mark", 1), ("mark", 2), ("mark", 3),
                   ("wait", 1), ("piece", 0), ("attend", 0), ("wait", 2), ("piece", 1), ("attend", 1),
                   ("wait", 3), ("piece", 2), ("attend", 2), ("piece", 3)]
    log.clear()
    replay(Pieces([Graph(i) for i in range(4)], layers), lambda layer: None)  # no copies: no waits
    assert log == [("piece", i) for i in range(4)]


def test_a_step_whose_pieces_are_not_captured_yet_is_known_before_the_waits() -> None:
    pieces = PiecewiseGraphs(torch.nn.Identity(), torch.device("cpu"), torch.float32, max_tokens=64)
    assert not pieces.captured(10)  # the runner then waits for every copy before the capture's forward
    pieces.pieces[bucket_for(10, 64)] = Pieces()
    assert pieces.captured(10) and not pieces.captured(40) and not pieces.captured(65)
    pieces.failed = True
    assert not pieces.captured(10)


def test_write_through_stores_are_waited_for_by_the_next_steps_forward_not_their_own() -> None:
    copier, log = recording_copier(seed=3)
    dev = copier.device_caches
    copier.submit([(0, 1, 0), (1, 5, 0), (0, 2, 1)], writes=1)  # the last: a write-through store
    for i in range(3):
        copier.wait_layer(i)
    copier.wait_all()
    assert log == [("begin", -1), *(("mark", m) for m in range(1, 7)), ("wait", 1), ("wait", 2), ("wait", 3)]
    assert torch.equal(copier.host_caches[1][0][1], dev[1][0][2]) and torch.equal(dev[0][1][5], dev[0][1][1])
    log.clear()
    copier.submit([])  # the next step: its forward waits for the stores, layer by layer, before using the cache
    copier.wait_layer(0)
    copier.wait_all()
    copier.submit([])
    copier.wait_all()
    assert log == [("wait", 4), ("wait", 6)]
