"""Property tests (hypothesis) on scheduler + block pool + prefix cache through EngineCore.

Random arrivals (with shared prefixes), aborts, eos finishes and tiny pools that force preemption: after every
operation each block is owned exactly as often as live request tables hold it, the FakeExecutor sees a
consistent delta stream and a consistent simulated KV cache, the pool is whole again when all requests end,
and every request that was not aborted generated exactly what it generates alone.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine import EngineConfig, EngineCore, IllegalTransition, SamplingParams
from appliance.engine.fake_executor import FakeExecutor, reference_generation
from appliance.engine.request import LEGAL_TRANSITIONS, Request, RequestStatus

EOS = 0
PREFIXES = ([], [11, 12, 13, 14], [11, 12, 13, 14, 15, 16, 17, 18], [31, 32, 33, 34, 35, 36, 37, 38, 39])

config_st = st.builds(
    dict,
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.sampled_from([0, 0, 1, 2, 3, 6, 24]),  # mostly tiny pools: preemption
    max_num_seqs=st.integers(1, 8),
    chunked_prefill_size=st.sampled_from([-1, 3, 8, 16, 64]),
    max_prefill_tokens=st.sampled_from([4, 16, 64]),
    enable_prefix_caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "lpm"]),
)
request_st = st.tuples(
    st.sampled_from(range(len(PREFIXES))),
    st.lists(st.integers(1, 40), min_size=1, max_size=12),  # suffix (0 is eos)
    st.integers(1, 24),  # max_tokens
    st.booleans(),  # ignore_eos
    st.integers(0, 3),  # min_tokens
)
op_st = st.one_of(
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=st.lists(op_st, min_size=6, max_size=50))
def test_random_workloads_never_leak_or_double_own_blocks(cfg: dict, ops: list) -> None:
    max_model_len = 32
    bs = cfg["block_size"]
    num_blocks = -(-max_model_len // bs) + cfg.pop("extra_blocks")  # from "one sequence fits" upwards
    config = EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, eos_token_ids={EOS}, **cfg)
    ex = FakeExecutor(num_blocks, bs, vocab_size=48)  # small vocab: eos comes up now and then
    core = EngineCore(config, ex)
    added: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}

    def run_step() -> None:
        for d in core.step():
            assert d.request_id not in finish, "delta after finish"
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason is not None:
                finish[d.request_id] = d.finish_reason

    for kind, arg in ops:
        if kind == "add":
            pre, suffix, max_tokens, ignore_eos, min_tokens = arg
            rid = f"r{len(added)}"
            prompt = PREFIXES[pre] + suffix
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, min_tokens=min_tokens)
            core.add_request(rid, prompt, sp)
            added[rid] = (prompt, sp)
        elif kind == "abort":
            rid = f"r{arg}"
            live = core.get_request(rid) is not None
            assert core.abort(rid) == live
            if live:
                aborted.add(rid)
        else:
            for _ in range(arg):
                run_step()
        rep = core.check_accounting()
        assert rep.ok, rep.problems

    for _ in range(2000):
        if not core.has_work():
            break
        run_step()
        assert core.check_accounting().ok
    assert not core.has_work(), "requests left unfinished"

    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.blocks_free + stats.blocks_cached == num_blocks
    if not config.enable_prefix_caching:
        assert stats.blocks_cached == 0
    for rid, (prompt, sp) in added.items():
        if rid in aborted:
            assert rid not in finish
            continue
        want, reason = reference_generation(
            ex.next_token, prompt, sp.max_tokens, max_model_len, frozenset({EOS}),
            min_tokens=sp.min_tokens, ignore_eos=sp.ignore_eos,
        )
        assert outputs[rid] == want and finish[rid] == reason, rid


@settings(max_examples=200, deadline=None)
@given(walk=st.lists(st.sampled_from(list(RequestStatus)), max_size=12))
def test_random_walks_follow_the_transition_table(walk: list[RequestStatus]) -> None:
    req = Request("r", [1, 2], SamplingParams(), 0.0)
    for dst in walk:
        src = req.status
        if dst in LEGAL_TRANSITIONS[src]:
            req.transition(dst)
            assert req.status is dst
        else:
            try:
                req.transition(dst)
            except IllegalTransition:
                assert req.status is src
            else:
                raise AssertionError(f"{src} -> {dst} was accepted")
