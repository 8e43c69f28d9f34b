"""Sampling routing: greedy on the device, plain random rows through the GPU op, the rest through Sampler."""
from __future__ import annotations

import pytest
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.executor.batch_sampler import (
    FAST,
    GREEDY,
    TORCH,
    BatchSampler,
    gpu_sample_op,
    route,
    sampling_row,
)
from appliance.executor.request_table import RequestState
from appliance.executor.sampler import Sampler

CPU = torch.device("cpu")


@pytest.mark.parametrize("params, generated, expected", [
    (SamplingParams(temperature=0.0), 0, GREEDY),
    (SamplingParams(temperature=1e-6), 0, GREEDY),
    (SamplingParams(temperature=0.0, logprobs=0), 0, TORCH),
    (SamplingParams(temperature=0.0, repetition_penalty=1.1), 0, TORCH),
    (SamplingParams(temperature=0.0, min_tokens=3), 2, TORCH),
    (SamplingParams(temperature=0.0, min_tokens=3), 3, GREEDY),
    (SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.1), 0, FAST),
    (SamplingParams(temperature=0.8, seed=5), 0, TORCH),
    (SamplingParams(temperature=0.8, top_n_sigma=1.0), 0, TORCH),
    (SamplingParams(temperature=0.8, presence_penalty=0.5), 0, TORCH),
    (SamplingParams(temperature=0.8, frequency_penalty=-0.5), 0, TORCH),
])
def test_route(params: SamplingParams, generated: int, expected: str) -> None:
    assert route(params, generated) == expected


def _state(i: int, params: SamplingParams, generated: int = 2) -> RequestState:
    return RequestState(f"r{i}", list(range(5 + generated)), 5, 4 + generated, [0, 1], params, noise_seed=1000 + i)


class FakeOp:
    """Stands in for the Triton op: records its inputs, answers the argmax shifted by one (distinguishable)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, list]] = []

    def __call__(self, logits, temperature, top_k, top_p, min_p, seeds, steps) -> torch.Tensor:
        for x in (temperature, top_k, top_p, min_p, seeds, steps):  # 16-byte aligned parameter vectors
            assert (x.storage_offset() * x.element_size()) % 16 == 0
        self.calls.append({"rows": logits.shape[0], "temperature": temperature.tolist(), "top_k": top_k.tolist(),
                           "top_p": top_p.tolist(), "min_p": min_p.tolist(), "seeds": seeds.tolist(),
                           "steps": steps.tolist()})
        return (logits.argmax(-1) + 1) % logits.shape[1]


def test_mixed_batch_routes_each_row() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    states = [_state(0, SamplingParams(temperature=0.0)),
              _state(1, SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05), generated=3),
              _state(2, SamplingParams(temperature=0.9, seed=7)),
              _state(3, SamplingParams(temperature=0.0, logprobs=2)),
              _state(4, SamplingParams(temperature=1.0))]
    op = FakeOp()
    results = BatchSampler(Sampler(seed=1), CPU, op)(logits, states)
    assert len(op.calls) == 1
    call = op.calls[0]
    assert call["rows"] == 3  # rows 0, 1, 4
    assert call["temperature"] == pytest.approx([0.0, 0.7, 1.0])
    assert call["top_k"] == [0, 5, 0] and call["top_p"] == pytest.approx([1.0, 0.8, 1.0])
    assert call["min_p"] == pytest.approx([0.0, 0.05, 0.0])
    assert call["seeds"] == [1000, 1001, 1004] and call["steps"] == [2, 3, 2]
    shifted = ((logits.argmax(-1) + 1) % 40).tolist()
    assert [results[i].token_id for i in (0, 1, 4)] == [shifted[0], shifted[1], shifted[4]]
    # the torch rows are exactly what the torch Sampler gives for them alone (seeded: batch-independent)
    alone = Sampler(seed=1)(logits[[2, 3]], [sampling_row(states[2]), sampling_row(states[3])])
    assert results[2].token_id == alone[0].token_id
    assert results[3] == alone[1] and results[3].logprob is not None and len(results[3].top_logprobs) == 2
    assert results[0].logprob is None


def test_all_greedy_skips_the_op_and_takes_argmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    op = FakeOp()
    results = BatchSampler(Sampler(), CPU, op)(logits, [_state(i, SamplingParams(temperature=0)) for i in range(4)])
    assert op.calls == [] and [r.token_id for r in results] == logits.argmax(-1).tolist()


def test_without_gpu_op_random_rows_use_the_torch_sampler() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    states = [_state(i, SamplingParams(temperature=1.0, top_k=4)) for i in range(3)]
    got = BatchSampler(Sampler(seed=3), CPU, None)(logits, states)
    want = Sampler(seed=3)(logits, [sampling_row(s) for s in states])
    assert got == want


def test_seeded_rows_are_the_same_with_and_without_the_gpu_op() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(4))
    states = [_state(0, SamplingParams(temperature=0.8, seed=9)), _state(1, SamplingParams(temperature=1.0))]
    with_op = BatchSampler(Sampler(), CPU, FakeOp())(logits, states)
    without = BatchSampler(Sampler(), CPU, None)(logits, states)
    assert with_op[0] == without[0]


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 logit rows for 1"):
        BatchSampler(Sampler(), CPU, None)(torch.zeros(2, 5), [_state(0, SamplingParams())])


def test_the_torch_backend_never_takes_the_gpu_op() -> None:
    """backends.sampling = torch: random rows go through the torch Sampler even on a GPU."""
    assert gpu_sample_op(torch.device("cuda"), "torch") is None
    assert gpu_sample_op(CPU, "auto") is None

