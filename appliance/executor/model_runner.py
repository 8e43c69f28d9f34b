"""ModelRunner: one worker's model, KV cache and sampler; runs StepPlans (engine/step.py's delta protocol).

The runner remembers every live request (tokens, block table, params) between steps; a plan brings new
requests, how many tokens each scheduled request computes now, appended blocks, and requests to forget.
Block tables and computed lengths also live on the device (request_table.py: one row per live request,
written by deltas), so a step sends only the block ids that are new and a length where the host's mirror
disagrees with a chunk's start; decode rows' positions, slots and seq_lens are computed on the device.
One forward runs decodes and prefill chunks together; logits are computed only for rows that sample (and for
prompt rows of requests that asked for prompt logprobs).
"""
from __future__ import annotations

import contextlib
import logging
import random
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.engine.config import StepTokens
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.step import NewRequestData, StepPlan, StepResult
from appliance.executor import (
    compile_ahead,
    inflight,
    kv_cache,
    kv_calibration,
    logits_processors,
    memory_profile,
    runner_caches,
    speculative,
    state_cache,
    step_sampling,
    swap_cost,
    warmup,
)
from appliance.executor.batch_sampler import BatchSampler, gpu_sample_op
from appliance.executor.cuda_graph import (
    GRAPH_CONTEXT,
    DecodeGraphs,
    decode_unsplit_from,
    graph_settings,
    lm_head_rows,
    rows_view,
    width_bucket,
)
from appliance.executor.inflight import StepHandle
from appliance.executor.input_batch import (
    Chunk,
    Stager,
    StepInputs,
    build_inputs,
    table_width,
)
from appliance.executor.memory_check import check_weight_memory
from appliance.executor.model_loader import (
    build_model,
    load_hf_config,
    resolve_dtype,
    resolve_model_dir,
)
from appliance.executor.piecewise import PiecewiseGraphs, piecewise_max_tokens
from appliance.executor.request_table import (
    LiveRequests,
    RequestState,
)
from appliance.executor.runner_setup import (
    _check_supported,
    read_eos_token_ids,
    resolve_backend,
    resolve_device,
    resolve_max_model_len,
)
from appliance.executor.sampler import Sampler
from appliance.executor.startup import STARTUP
from appliance.layers.parallel_state import get_tp_size
from appliance.models.registry import model_class

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: ApplianceConfig) -> None:
        self.config = config
        STARTUP.enter("reading the model config")  # ends where the next phase begins
        self._settle(config)
        # its start-up phases: executor/startup.py
        self.model, kv_scales = build_model(self, config.model.load_format, config.model.seed)
        self.eos_token_ids = read_eos_token_ids(self.model_dir, self.hf_config)
        # a drafter's caches share the block table and the KV budget (none without speculation, or for n-gram)
        self.draft_model = speculative.load_drafter(config, self)
        for module in (self.model, self.draft_model):  # the weights go with the runner: on a GPU a dropped 8B
            if isinstance(module, torch.nn.Module):  # engine kept 17 GiB of them, held as the KV cache was
                weakref.finalize(self, kv_cache.free_storage, list(module.parameters()))  # (buffers: shared tables)
        layers = self.model.attention_layers() + speculative.draft_attention_layers(config, self.model,
                                                                                    self.draft_model)
        runner_caches.build_caches(self, config, layers, kv_scales)
        self._build_step_state(config)
        self._prepare_serving(config, layers)

    def _settle(self, config: ApplianceConfig) -> None:
        """Device, model directory and config, dtype, backend and lengths (runner_setup.py); the weights' memory
        is checked here, before anything is allocated."""
        from appliance.config import resolve_model_path

        m = config.model
        self.device = resolve_device(m.device)
        _check_supported(config, self.device)
        self.model_dir = resolve_model_dir(resolve_model_path(m.path), m.revision, m.download_dir)
        self.hf_config = load_hf_config(self.model_dir, m.hf_overrides, m.trust_remote_code)
        self.dtype = resolve_dtype(config.precision.dtype, self.hf_config, self.device)
        # the Triton variants an earlier start listed compile in other processes meanwhile (compile_ahead.py)
        self.compile_ahead = compile_ahead.begin(config, self.model_dir, self.device, self.dtype)
        self.backend = resolve_backend(config.backends.attention, self.device)
        windowed = bool(getattr(model_class(self.hf_config), "sliding_window_attention", False))
        self.max_model_len = resolve_max_model_len(m.max_model_len, self.hf_config, windowed)
        sched = config.scheduler
        self.step_tokens = StepTokens.of(sched.chunked_prefill_size, sched.max_prefill_tokens, self.max_model_len)
        self.block_size = config.cache.block_size
        check_weight_memory(config, self.hf_config, self.dtype, self.device, self.backend,
                            self.model_dir)  # fail before allocating
        self._mem_baseline = memory_profile.allocated_by_others(self.device)

    def _build_step_state(self, config: ApplianceConfig) -> None:
        """Samplers, the live requests, the upload stagers, the steps in flight and the graphs."""
        self.sampler = Sampler(self.eos_token_ids, config.model.seed)
        self.batch_sampler = BatchSampler(self.sampler, self.device,
                                          gpu_sample_op(self.device, config.backends.sampling))
        self.requests = LiveRequests(self.block_table)  # adding a request gives it a table row, dropping frees it
        # per-request grammar / thinking-budget processors, made on the first request that needs them
        self.logits_processors: logits_processors.LogitsProcessors | None = None
        self._noise_seeds = random.Random(config.model.seed)  # per-request streams of the GPU sampler
        self._stager = Stager(self.device)
        self._pending_stager, self._rows_stager = Stager(self.device), Stager(self.device)
        self._inflight: deque[StepHandle] = deque()  # launched, not finished (overlap mode), in launch order
        self.graphs = self._make_graphs()
        self.use_graphs = self.graphs is not None  # benchmarks flip it to compare with eager on one model
        self.pieces = self._make_pieces()  # mixed / prefill steps' forward in graph pieces (piecewise.py)
        # Llama-family kernels on a GPU: prefill batches padded so the Triton variants recur (input_batch.py)
        self._pad_prefills = self.device.type == "cuda" and bool(getattr(self.model, "supports_cuda_graphs", False))

    def _prepare_serving(self, config: ApplianceConfig, layers: list[torch.nn.Module]) -> None:
        """The warm-up, the start-up measurements, fp8 KV calibration and the speculator, in that order."""
        self.spec: speculative.Speculator | None = None  # the warm-up's steps run without it
        self.kv_calibration: kv_calibration.KVCalibration | None = None  # and without calibration (armed below)
        self.warmup_s = self.warmup() if self.graphs is not None else 0.0
        if self.compile_ahead is not None:
            self.compile_ahead.finish()  # stops the pool; lists what this start met, for the next one
        # scheduler.preemption_mode auto prices swaps with rates measured here, before serving (swap_cost.py)
        self.swap_costs = swap_cost.measure(self) if swap_cost.wanted(self) else None
        # online fp8 KV scales: armed after the warm-up, whose writes must not count (kv_calibration.py)
        self.kv_calibration = kv_calibration.arm(layers, config.precision.kv_cache_calibration_tokens)
        # speculative decoding runs whole steps (executor/speculative.py)
        if config.speculative.algorithm is not None:
            with STARTUP.phase("building the speculator"):
                self.spec = speculative.make_speculator(self)

    def warmup(self, graph_context: int = GRAPH_CONTEXT) -> float:
        """Pay every first-use cost a run would meet (executor/warmup.py); returns the seconds taken. It writes
        KV into block 0: call it before serving (the constructor does), never with blocks cached."""
        return warmup.warm_up(self, graph_context)

    def host_inputs(self, chunks: list[Chunk]) -> StepInputs:
        """One step's inputs with positions and tables built on the host (no device table rows): the warm-up's
        and the MTP drafter's own steps."""
        return build_inputs(chunks, self.block_size, self.device, 1, self._stager, self._pad_prefills,
                            with_states=self.state_cache is not None)

    @contextlib.contextmanager
    def noise_seeds_kept(self) -> Iterator[None]:
        """Requests added inside draw their GPU-sampler noise seeds from a stream given back afterwards, so the
        seeds of the requests served later do not depend on what ran inside (the warm-up)."""
        state = self._noise_seeds.getstate()
        try:
            yield
        finally:
            self._noise_seeds.setstate(state)

    @property
    def num_state_slots(self) -> int:
        """Request slots of the state cache (0: the model keeps no recurrent state)."""
        return self.state_cache.num_slots if self.state_cache is not None else 0

    @property
    def state_cache_bytes(self) -> int:
        return self.state_cache.nbytes if self.state_cache is not None else 0

    def _make_pieces(self) -> PiecewiseGraphs | None:
        limit = piecewise_max_tokens(self.config, self.model, self.graphs is not None, get_tp_size(),
                                     self.step_tokens)
        return None if limit is None else PiecewiseGraphs(self.model, self.device, self.dtype, limit,
                                                          len(self.kv_layout.groups))

    def _make_graphs(self) -> DecodeGraphs | None:
        sizes = graph_settings(self.config, self.model, self.device, self.backend)
        if sizes is None:
            return None
        hidden = int(self.hf_config.hidden_size)
        return DecodeGraphs(self.model, hidden, self.dtype, self.device, sizes, self.max_blocks, self.block_size,
                            self.block_table, decode_unsplit_from(self.model.attention_layers(), self.device),
                            with_states=self.state_cache is not None)

    # ---- the step ----------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> StepHandle:
        """Start a step. When every sampled row samples on the device (inflight.py), its ids stay there until
        finish(), so the caller can plan and launch the next step meanwhile; any other step first finishes the
        steps in flight (its sampling reads the complete token history) and runs to completion here; so does a
        speculative step, unless decided and drafted on the device (speculative.py `Speculator.launch`), which a
        verification of the same requests is launched ahead of (verify_ahead.py)."""
        if self.spec is not None:
            if (ahead := self.spec.launch_ahead(plan)) is not None:  # behind the step in flight, read afterwards
                self._inflight.append(ahead)
                return ahead
            self.flush()  # the speculative step in flight: this one starts from where it ended
        # issued before anything of this step reads or writes those blocks; the forward waits for them
        self.host_copier.submit(plan.host_copies, plan.host_writes)
        if self.spec is not None:
            self.host_copier.wait_all()
            spec_handle = self.spec.launch(plan)
            if not spec_handle.done:
                self._inflight.append(spec_handle)
            return spec_handle
        for rid in plan.finished_ids:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = self._new_state(new)
        state_cache.restore_snapshots(self.state_cache, plan, self.requests)
        chunks = [self._chunk(s.request_id, s.num_tokens, s.new_block_ids, s.sample) for s in plan.scheduled]
        if not chunks:
            return StepHandle(plan.step_id, StepResult(plan.step_id))
        deferred = step_sampling.deferrable(self, chunks)
        if not deferred:
            self.flush()
        with torch.inference_mode():
            ordered, row_starts, hidden = self._forward(chunks)
            self.host_copier.wait_all()  # a step's copies are all waited for by its end
            # rows run decodes first; when that moved chunks, results go back to the plan's order
            order = None if ordered is chunks else {s.request_id: i for i, s in enumerate(plan.scheduled)}
            if deferred:
                handle = step_sampling.sample_deferred(self, plan.step_id, ordered, row_starts, hidden, order)
            else:
                sampled, prompt_lps = step_sampling.sample_now(self, ordered, row_starts, hidden)
                if order is not None:
                    sampled.sort(key=lambda t: order[t.request_id])
                handle = StepHandle(plan.step_id, StepResult(plan.step_id, sampled, prompt_lps))
        for c in ordered:
            c.state.num_computed += c.num_tokens
        state_cache.save_snapshots(self.state_cache, plan, self.requests)
        if not handle.done:
            self._inflight.append(handle)
        return handle

    def finish(self, handle: StepHandle) -> StepResult:
        """The result of a launched step (waiting for its sampled ids); earlier steps finish first."""
        while not handle.done:
            inflight.complete(self._inflight.popleft())
        return handle.result  # type: ignore[return-value]

    def flush(self) -> None:
        """Finish every step in flight: afterwards every request's token_ids is complete."""
        while self._inflight:
            inflight.complete(self._inflight.popleft())

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The LM head over these rows of hidden. Its GEMM runs on a padded row count, a decode-graph capture
        size (cuda_graph.lm_head_rows), and the pad rows are dropped: cuBLAS chooses and loads a kernel for each
        new shape on first use, which the warm-up pays for these few sizes (executor/warmup.py) instead of a run
        paying it for every batch size it meets. Rows are independent in a GEMM, so pad rows change nothing."""
        n = len(rows)
        m = lm_head_rows(self.graphs.sizes if self.graphs is not None else None, n)
        if rows == list(range(n)):  # a decode step: its rows lead hidden, no gather
            padded = rows_view(hidden, m)
            if padded is not None:
                return self.model.compute_logits(padded)[:n]
        index = np.zeros(m, dtype=np.int64)  # pad rows read row 0
        index[:n] = rows
        # a staged upload: a plain torch.tensor(..., device) would wait for the GPU to catch up
        return self.model.compute_logits(hidden[self._rows_stager.send(index)])[:n]

    def _forward(self, chunks: list[Chunk]) -> tuple[list[Chunk], list[int], torch.Tensor]:
        """Rows in order, each chunk's first row, hidden states: a decode-only step replays a CUDA graph."""
        if self.graphs is not None and self.use_graphs and all(c.num_tokens == 1 and not c.wants_prompt_logprobs
                                                                for c in chunks):
            key = self.graphs.key_for(chunks)
            if key is not None:
                self.graphs.bind(self.block_table, self.window_table)  # a no-op unless swapped in (tests, benchmarks)
                self.host_copier.wait_all()  # the graph's cache accesses are captured: no layer hooks
                return chunks, list(range(len(chunks))), self.graphs.run(
                    chunks, key, lambda ids: inflight.resolve_pending_ids(chunks, ids, self._pending_stager))
        decodes = [c for c in chunks if c.num_tokens == 1]
        # decode tables padded like the graphs' (the split-K factor follows the width): same numerics either way
        width = width_bucket(table_width(decodes), self.max_blocks) if decodes else 1
        inputs = build_inputs(chunks, self.block_size, self.device, width, self._stager, self._pad_prefills,
                              self.block_table, with_states=self.state_cache is not None, windows=self.window_table)
        inflight.resolve_pending_ids(inputs.chunks, inputs.input_ids, self._pending_stager)
        hidden = None
        calibrating = self.kv_calibration is not None and not self.kv_calibration.done  # observed eagerly
        if self.pieces is not None and self.use_graphs and not calibrating and inputs.meta.tree is None:
            # layer by layer: each piece waits for its layer's copies (piecewise.replay), unless it is captured now
            if not self.host_copier.layerwise or not self.pieces.captured(int(inputs.input_ids.shape[0])):
                self.host_copier.wait_all()
            hidden = self.pieces.run(inputs.input_ids, inputs.positions, inputs.meta)
        if hidden is None:
            if not self.host_copier.layerwise:
                self.host_copier.wait_all()
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return inputs.chunks, inputs.row_starts, hidden

    def capture_graphs(self, max_context: int, on_captured: Callable[[], None] | None = None) -> int:
        """Capture every decode graph a run up to max_context tokens can use (else they are captured on first
        use), calling on_captured after each; returns how many graphs exist."""
        if self.graphs is None:
            return 0
        self.graphs.bind(self.block_table, self.window_table)
        with torch.inference_mode():
            return self.graphs.capture_all(min(max_context, self.max_model_len), on_captured)

    def _new_state(self, new: NewRequestData) -> RequestState:
        if not 0 <= new.num_computed_tokens <= len(new.token_ids):
            raise ValueError(f"request {new.request_id!r}: num_computed_tokens {new.num_computed_tokens} outside "
                             f"0..{len(new.token_ids)}")
        if len(new.window_block_ids) != len(self.kv_layout.groups):
            raise ValueError(f"request {new.request_id!r} carries {len(new.window_block_ids)} sliding-window tables; "
                             f"this worker has {len(self.kv_layout.groups)} sliding-window KV cache groups")
        return RequestState(new.request_id, list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                            list(new.block_ids), SamplingParams.from_dict(dict(new.sampling)),
                            noise_seed=self._noise_seeds.getrandbits(63),
                            window_tables=[list(t) for t in new.window_block_ids])

    def _chunk(self, rid: str, num_tokens: int, new_blocks: list[int], sample: bool) -> Chunk:
        state = self.requests.get(rid)
        if state is None:
            raise KeyError(f"step schedules request {rid!r}, which the worker does not know")
        if state.window_tables and new_blocks:  # the full table's new ids, then as many for each sliding group
            n = len(new_blocks) // (1 + len(state.window_tables))
            for g, table in enumerate(state.window_tables, 1):
                table.extend(new_blocks[g * n:(g + 1) * n])
            new_blocks = new_blocks[:n]
        state.block_ids.extend(new_blocks)
        end = state.num_computed + num_tokens
        if num_tokens < 1 or end > state.num_tokens:
            raise ValueError(f"request {rid!r}: cannot compute {num_tokens} tokens from {state.num_computed}; "
                             f"it has {state.num_tokens}")
        if sample and end != state.num_tokens:
            raise ValueError(f"request {rid!r}: asked to sample after token {end} of {state.num_tokens}")
        return Chunk(state, state.num_computed, num_tokens, sample)
