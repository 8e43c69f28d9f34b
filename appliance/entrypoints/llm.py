"""The offline API: `LLM(model=PATH, **overrides).generate(prompts, params)`, shaped like vLLM's.

LLM builds the config (flat familiar names, or a ready ApplianceConfig), an InProcessExecutor (or, with
tensor_parallel_size > 1, a WorkerGroupExecutor of one worker process per rank) and an EngineCore, then drives
the engine to completion. Fan-out of n > 1, stop strings (through the Detokenizer,
which aborts the request in the engine) and the result records live here; the engine sees one sequence per
request.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from appliance.engine.delta import RequestDelta
from appliance.engine.sampling_params import SamplingParams
from appliance.entrypoints.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from appliance.runtime.gc_heap import frozen_heap
from appliance.tokenization.detokenizer import Detokenizer

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

PromptInput = str | Sequence[int] | Mapping[str, Any]


@dataclass
class _Sequence:
    """One engine request: the j-th of n samples of prompt i (mutable while it runs)."""

    request_id: str
    prompt_index: int
    index: int
    params: SamplingParams
    detok: Detokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str | None = None, *, config: ApplianceConfig | None = None, **overrides: Any) -> None:
        from appliance.config import build_config, check_supported

        if config is not None and (model is not None or overrides):
            raise ValueError("pass either config= or model=/overrides, not both")
        if config is None:
            flat = dict(overrides)
            if model is not None:
                flat["model"] = model
            config = build_config(flat=flat)
        problems = check_supported(config)
        if problems:  # the same gate as `appliance run`: nothing accepted is silently ignored
            raise ValueError("this build cannot honour these settings:\n  " + "\n  ".join(problems))
        self.config = config
        self._build_engine()
        self.tokenizer = None if config.model.skip_tokenizer_init else self._load_tokenizer()
        self._counter = 0
        self._prompt_lps: dict[str, PromptLogprobs] = {}  # of the generate() call in progress

    def _build_engine(self) -> None:
        from appliance.engine.config import EngineConfig
        from appliance.engine.core import EngineCore
        from appliance.executor.in_process import InProcessExecutor

        from appliance.executor.compile_cache import use_compile_cache

        use_compile_cache(self.config.cache.compile_cache_dir)  # before the first kernel compiles
        p = self.config.parallelism
        if p.tp * p.dp > 1:  # one worker process per rank, driven from here (runtime/worker_group.py)
            from appliance.runtime.worker_group import WorkerGroupExecutor

            self.executor = WorkerGroupExecutor(self.config)
        else:
            self.executor = InProcessExecutor(self.config)
        engine_config = EngineConfig.from_appliance(self.config, self.executor.num_blocks,
                                                    self.executor.eos_token_ids, self.executor.max_model_len,
                                                    self.executor.num_host_blocks,
                                                    self.executor.num_state_slots,
                                                    self.executor.state_cache_bytes,
                                                    self.executor.swap_costs, self.executor.num_disk_blocks,
                                                    self.executor.window_groups)
        self.engine = EngineCore(engine_config, self.executor, overlap=self.config.overlap_enabled())

    def _load_tokenizer(self) -> Any:
        from appliance.config import resolve_model_path
        from appliance.tokenization.tokenizer import load_tokenizer

        m = self.config.model
        return load_tokenizer(m.tokenizer or resolve_model_path(m.path), mode=m.tokenizer_mode,
                              trust_remote_code=m.trust_remote_code, revision=None if m.tokenizer else m.revision,
                              download_dir=m.download_dir)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine and drop the executor's request state. The model stays loaded until the LLM is dropped;
        then its runner empties the weights' and the KV cache's storage, whoever still holds one of their tensors."""
        self.engine.shutdown()

    # ---- generate ----------------------------------------------------------------------------------------
    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a dict with `prompt_token_ids` or
        `prompt`); params are one for all or one per prompt. use_tqdm shows a progress bar of finished sequences."""
        items = self._prompt_list(prompts)
        params = self._params_list(sampling_params, len(items))
        inputs = [self._tokenize(p) for p in items]
        seqs: list[_Sequence] = []
        for i, ((_, ids), sp) in enumerate(zip(inputs, params)):
            self._check_params(sp)
            for j in range(sp.n):
                child = dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j)
                self._counter += 1
                seqs.append(_Sequence(f"{self._counter}", i, j, child, self._detokenizer(ids, child)))
        self._prompt_lps = {}
        self._run(seqs, {s.request_id: inputs[s.prompt_index][1] for s in seqs}, use_tqdm)
        return self._collect(inputs, seqs)

    def _run(self, seqs: list[_Sequence], prompt_ids: dict[str, list[int]], use_tqdm: bool = False) -> None:
        by_id = {s.request_id: s for s in seqs}
        pending = deque(seqs)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="seq")
        try:
            with frozen_heap():  # what exists now stays out of the collector's passes (runtime/gc_heap.py)
                self._drive(pending, prompt_ids, by_id, bar)
        except BaseException:
            for s in seqs:  # leave the engine empty for the next call (errors, KeyboardInterrupt)
                self.engine.abort(s.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()

    def _drive(self, pending: deque[_Sequence], prompt_ids: dict[str, list[int]], by_id: dict[str, _Sequence],
               bar: Any) -> None:
        while pending or self.engine.has_work():
            while pending and self.engine.can_queue():
                s = pending.popleft()
                self.engine.add_request(s.request_id, prompt_ids[s.request_id], s.params)
            steps_before = self.engine.stats().num_steps
            deltas = self.engine.step()
            if not deltas and self.engine.stats().num_steps == steps_before and self.engine.has_work():
                raise RuntimeError("the engine has requests but scheduled nothing (KV cache too small?)")
            for d in deltas:
                s = by_id[d.request_id]
                self._apply(s, d)
                if bar is not None and s.finish_reason is not None:
                    bar.update(1)

    def _apply(self, s: _Sequence, d: RequestDelta) -> None:
        ids, lps, piece = d.new_token_ids, d.new_logprobs, ""
        if s.detok is not None:
            before = s.detok.num_output_tokens
            piece = s.detok.update(ids)
            # a speculative step's delta can carry tokens past the one that completed a stop string: drop them
            kept = s.detok.num_output_tokens - before
            ids, lps = ids[:kept], None if lps is None else lps[:kept]
        s.token_ids.extend(ids)
        s.num_cached_tokens = d.num_cached_tokens
        if lps is not None:
            s.logprobs = s.logprobs or []
            for tl in lps:
                s.logprobs.append(self._logprob_dict(tl.token_id, tl.logprob, tl.top_logprobs,
                                                     getattr(tl, "rank", None)))
                if tl.logprob is not None:
                    s.cumulative_logprob = (s.cumulative_logprob or 0.0) + tl.logprob
        if d.prompt_logprobs is not None:
            self._prompt_lps[s.request_id] = [
                None if e is None else self._logprob_dict(e[0][0], e[0][1], e[1:]) for e in d.prompt_logprobs]
        if s.detok is not None:
            s.text += piece
            if s.detok.finished:
                if d.finish_reason is None:
                    self.engine.abort(s.request_id)
                s.finish_reason, s.stop_reason = "stop", s.detok.stop_reason
                return
        if d.finish_reason is not None:
            s.finish_reason = d.finish_reason
            if s.detok is not None:
                s.text += s.detok.flush()
            last = s.token_ids[-1] if s.token_ids else None
            if d.finish_reason == "stop" and last in s.params.stop_token_ids:
                s.stop_reason = last

    def _logprob_dict(self, token: int, logprob: float | None, top: Sequence[tuple[int, float]],
                      rank: int | None = None) -> dict[int, Logprob]:
        """The chosen token first, then the top alternatives (best first, so their rank is their position).
        The chosen token's rank comes from the engine when it carries one (TokenLogprob.rank), else from its
        place in the top list, else it is None."""
        ranks = {t: r for r, (t, _) in enumerate(top, start=1)}
        rank = rank if rank is not None else ranks.get(token)
        out = {token: Logprob(float("nan") if logprob is None else logprob, rank, self._decode1(token))}
        for t, lp in top:
            if t not in out:
                out[t] = Logprob(lp, ranks[t], self._decode1(t))
        return out

    def _decode1(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], skip_special_tokens=False)

    def _collect(self, inputs: list[tuple[str | None, list[int]]], seqs: list[_Sequence]) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        for i, (text, ids) in enumerate(inputs):
            mine = sorted((s for s in seqs if s.prompt_index == i), key=lambda s: s.index)
            completions = [CompletionOutput(s.index, s.text, s.token_ids, s.cumulative_logprob, s.logprobs,
                                            s.finish_reason, s.stop_reason) for s in mine]
            outs.append(RequestOutput(mine[0].request_id, text, ids, self._prompt_lps.get(mine[0].request_id),
                                      completions, True, mine[0].num_cached_tokens))
        return outs

    # ---- input normalisation -------------------------------------------------------------------------------
    @staticmethod
    def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
        if isinstance(prompts, (str, Mapping)):
            return [prompts]
        items = list(prompts)
        if not items:
            raise ValueError("no prompts given")
        if all(isinstance(x, int) for x in items):
            return [items]  # one prompt of token ids
        return items

    @staticmethod
    def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        plist = list(params)
        if len(plist) != n:
            raise ValueError(f"{len(plist)} sampling params for {n} prompts")
        return plist

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; skip_tokenizer_init is set, pass token ids")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_params(self, sp: SamplingParams) -> None:
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; skip_tokenizer_init is set (use stop_token_ids)")
        from appliance.structured import structured_spec_of
        from appliance.structured.validate import check_spec

        spec = structured_spec_of(sp.extra)  # StructuredOutputError is a ValueError
        if spec is not None:
            check_spec(spec)
            if sp.ignore_eos or sp.min_tokens:
                raise ValueError("ignore_eos and min_tokens cannot be combined with structured outputs (the "
                                 "grammar ends the output with EOS)")

    def _detokenizer(self, prompt_ids: list[int], sp: SamplingParams) -> Detokenizer | None:
        if self.tokenizer is None:
            return None
        return Detokenizer(self.tokenizer, prompt_ids, stop=sp.stop, include_stop_str_in_output=sp.include_stop_str_in_output,
                           skip_special_tokens=sp.skip_special_tokens,
                           spaces_between_special_tokens=sp.spaces_between_special_tokens, min_tokens=sp.min_tokens)
