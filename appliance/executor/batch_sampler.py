"""Routes each sampling row to the cheapest path that keeps its semantics, with one device->host copy.

- greedy rows without penalties / min_tokens / logprobs: argmax of the raw logits on the device;
- random rows without seed, penalties, min_tokens, top-n-sigma or logprobs: the Triton `sample` op on a GPU
  (one launch for the batch; its noise is a counter-based hash of (per-request noise seed, step), so the
  draw does not depend on the batch either);
- everything else (seeded rows, penalties, logit_bias, min_tokens, top-n-sigma, logprobs) and every random row
  on a CPU: the torch Sampler (executor/sampler.py).

Seeded rows always take the torch path, whatever the device: their noise comes from a CPU generator keyed on
(seed, tokens generated so far), so a seed reproduces the same tokens on CPU and GPU, alone or in any batch,
before and after a preemption. (The Triton op's hash stream differs from that generator; mixing the two for
seeded rows would make a seed's tokens depend on the machine.)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.executor.input_batch import Stager
from appliance.executor.request_table import RequestState
from appliance.executor.sampler import _GREEDY_EPS, Sampler, SampleResult, SamplingRow

GREEDY, FAST, TORCH = "greedy", "fast", "torch"


def route(params: SamplingParams, num_generated: int) -> str:
    """Which path samples a row (see the module docstring)."""
    if (params.logprobs is not None or params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0 or params.logit_bias or num_generated < params.min_tokens):
        return TORCH
    if params.temperature < _GREEDY_EPS:
        return GREEDY
    if params.seed is not None or params.top_n_sigma > 0:
        return TORCH
    return FAST


def sampling_row(state: RequestState) -> SamplingRow:
    # only the repetition penalty reads the prompt: skip copying long prompts every step otherwise
    prompt = state.token_ids[: state.num_prompt_tokens] if state.params.repetition_penalty != 1.0 else ()
    return SamplingRow(state.params, prompt, state.output_ids)


class BatchSampler:
    def __init__(self, sampler: Sampler, device: torch.device, gpu_op: Callable[..., torch.Tensor] | None) -> None:
        """gpu_op: the registry's ("sample", "triton") op, or None (random rows then use the torch Sampler)."""
        self.sampler, self.device, self.gpu_op = sampler, device, gpu_op
        # one stager per upload of a step: reusing one within a step would wait for the forward to finish
        self._f32, self._i64, self._idx = Stager(device), Stager(device), Stager(device)

    def kinds(self, states: Sequence[RequestState]) -> list[str]:
        """The path of each row (route(), with FAST falling back to TORCH where there is no GPU op)."""
        kinds = [route(s.params, s.num_generated) for s in states]
        return kinds if self.gpu_op is not None else [TORCH if k == FAST else k for k in kinds]

    def on_device(self, states: Sequence[RequestState]) -> bool:
        """Whether every row samples on the device (no host round trip: the overlap mode can defer the copy)."""
        return TORCH not in self.kinds(states)

    def sample_on_device(self, logits: torch.Tensor, states: Sequence[RequestState],
                         kinds: list[str] | None = None) -> torch.Tensor:
        """Token ids [rows] left on the device; every row must take a device path (see on_device)."""
        kinds = self.kinds(states) if kinds is None else kinds
        if TORCH in kinds:
            raise ValueError("sample_on_device() got rows that need the torch Sampler")
        if all(k == GREEDY for k in kinds):
            return logits.argmax(dim=-1)
        return self._gpu_sample(logits, list(states), kinds)

    def __call__(self, logits: torch.Tensor, states: Sequence[RequestState]) -> list[SampleResult]:
        if logits.shape[0] != len(states):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(states)} requests")
        kinds = self.kinds(states)
        device_rows = [i for i, k in enumerate(kinds) if k != TORCH]
        torch_rows = [i for i, k in enumerate(kinds) if k == TORCH]
        results: list[SampleResult | None] = [None] * len(states)
        if torch_rows:
            # this path reads its results back itself (a sync), so a plain copy of the index is fine
            sub = logits if len(torch_rows) == len(states) else \
                logits[torch.tensor(torch_rows, dtype=torch.int64, device=logits.device)]
            for i, r in zip(torch_rows, self.sampler(sub.float(), [sampling_row(states[i]) for i in torch_rows])):
                results[i] = r
        if device_rows:
            sub = logits if len(device_rows) == len(states) else \
                logits[self._idx.send(np.asarray(device_rows, dtype=np.int64))]
            tokens = self.sample_on_device(sub, [states[i] for i in device_rows], [kinds[i] for i in device_rows])
            for i, t in zip(device_rows, tokens.tolist()):  # the step's one device -> host copy
                results[i] = SampleResult(int(t))
        return results  # type: ignore[return-value]

    def _gpu_sample(self, logits: torch.Tensor, states: list[RequestState], kinds: list[str]) -> torch.Tensor:
        assert self.gpu_op is not None
        m = len(states)
        # rows padded to 4 columns: each parameter vector starts 16-byte aligned, as Triton specialises pointer
        # arguments on alignment (unaligned views would compile new variants as the batch size changes)
        w = 4 * -(-m // 4)
        f = np.zeros((3, w), dtype=np.float32)
        f[0, :m] = [0.0 if k == GREEDY else s.params.temperature for s, k in zip(states, kinds)]
        f[1, :m] = [s.params.top_p for s in states]
        f[2, :m] = [s.params.min_p for s in states]
        n = np.zeros((3, w), dtype=np.int64)
        n[0, :m] = [s.params.top_k for s in states]
        n[1, :m] = [s.noise_seed for s in states]
        n[2, :m] = [s.num_generated for s in states]
        fd = self._f32.send(f.reshape(-1)).view(3, w)[:, :m]
        nd = self._i64.send(n.reshape(-1)).view(3, w)[:, :m]
        return self.gpu_op(logits, fd[0], nd[0], fd[1], fd[2], nd[1], nd[2])


def gpu_sample_op(device: torch.device, backend: str) -> Callable[..., Any] | None:
    """The Triton sampling op when this device can run it and backends.sampling (auto or torch) allows it."""
    if backend == "torch" or device.type != "cuda":
        return None
    try:
        import appliance.kernels.triton  # noqa: F401  (registers the triton ops)
        from appliance.kernels import registry

        return registry.get("sample", "triton")
    except (ImportError, KeyError):
        return None
