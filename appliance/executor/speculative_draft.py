"""Drafting with a separate model: a standalone draft model sharing the tokenizer (speculative.algorithm =
STANDALONE; SGLang's STANDALONE, vLLM's draft_model) and EAGLE / EAGLE-3 heads (models/eagle.py). Their KV
caches live beside the target's in the same blocks (of their own shape where their KV heads or head size
differ: kv_cache.KVCacheSpec.drafter), so they share the block tables and the KV budget.

Standalone: the draft model runs over the chunk's confirmed positions and the token just sampled (row i: the
token at i), so its cache holds every computed position; the last row drafts the first token, then num_steps - 1
one-token steps chain its own drafts.
EAGLE-3 / EAGLE: like MTP (row i: the token at i + 1 and the target's hidden state at i: the captured layers'
outputs for EAGLE-3, the last hidden state for EAGLE); the chain feeds the head's own output back.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from appliance.executor.catch_up_graphs import make_catch_up_graphs
from appliance.executor.draft_graphs import make_chain_graphs
from appliance.executor.input_batch import Chunk
from appliance.executor.model_loader import init_dummy_weights, iterate_weights, load_hf_config, resolve_model_dir
from appliance.executor.speculative import Speculator
from appliance.models.eagle import AuxCapture, Eagle3Head, EagleHead, default_capture_layers, head_class
from appliance.models.registry import model_class

log = logging.getLogger(__name__)


def load_draft_model(config: Any, runner: Any) -> nn.Module:
    """Build and load the drafter of a STANDALONE / EAGLE / EAGLE3 config on the runner's device and dtype (and,
    for EAGLE-3, set up the target's capture of hidden states)."""
    s, m = config.speculative, config.model
    path = resolve_model_dir(s.draft_model_path, None, m.download_dir)
    cfg = load_hf_config(path, None, m.trust_remote_code)
    head = head_class(cfg)
    want = {"EAGLE3": Eagle3Head, "EAGLE": EagleHead}.get(s.algorithm)
    if head is not want:
        found = head.__name__ if head is not None else f"an ordinary model ({cfg.architectures})"
        raise ValueError(f"speculative.draft_model_path={s.draft_model_path!r} is {found}; algorithm "
                         f"{s.algorithm} needs {want.__name__ if want else 'an ordinary model sharing the tokenizer'}")
    if head is None and int(cfg.vocab_size) != int(runner.hf_config.vocab_size):
        raise ValueError(f"speculative.draft_model_path: the draft model's vocabulary ({cfg.vocab_size}) differs "
                         f"from the target's ({runner.hf_config.vocab_size}); STANDALONE needs a shared tokenizer")
    backend = _drafter_backend(config, runner)
    model = _construct(runner, lambda: (_draft_model(cfg, backend, config) if head is None
                                        else head(cfg, runner.hf_config, backend)))
    if m.load_format == "dummy":
        init_dummy_weights(model, m.seed + 1)
    else:
        _load(model, path, m.load_format, runner.model, head is not None)
    if runner.device.type == "cuda":
        from appliance.layers.linear import use_gemv_kernel

        use_gemv_kernel(model, backend)
    if head is Eagle3Head:
        _capture(config, runner, cfg)
    return model.eval()


def _drafter_backend(config: Any, runner: Any) -> str:
    """backends.drafter_attention, or the target's backend when unset."""
    name = config.backends.drafter_attention
    if name is None:
        return runner.backend
    from appliance.executor.runner_setup import resolve_backend

    return resolve_backend(name, runner.device)


def _draft_model(cfg: Any, backend: str, config: Any) -> nn.Module:
    cls = model_class(cfg)
    if not getattr(cls, "is_moe", False):
        return cls(cfg, backend=backend)
    from appliance.layers.moe import resolve_moe_backend

    return cls(cfg, backend=backend, moe_backend=resolve_moe_backend(config.backends.draft_moe or config.backends.moe,
                                                                      backend))


def _construct(runner: Any, build: Any) -> nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(runner.dtype)
    try:
        with torch.device(runner.device):
            return build()
    finally:
        torch.set_default_dtype(previous)


def _load(model: nn.Module, path: Any, load_format: str, target: nn.Module, is_head: bool) -> None:
    """Checkpoint weights; a head without its own embedding (or, with the target's vocabulary, LM head) uses the
    target's. Any other parameter left unfilled is an error."""
    loaded = model.load_weights(iterate_weights(path, load_format))  # type: ignore[operator]
    shared = []
    if is_head and "embed_tokens.weight" not in loaded:
        model.embed_tokens.weight = target.model.embed_tokens.weight
        shared.append("embed_tokens")
    head = getattr(model, "lm_head", None)
    if is_head and head is not None and "lm_head.weight" not in loaded:
        if head.num_embeddings != target.lm_head.num_embeddings:
            raise ValueError(f"draft head in {path} has no lm_head and a vocabulary of {head.num_embeddings}")
        model.lm_head.weight = target.lm_head.weight
        shared.append("lm_head")
    tied = {"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded and n not in tied
                     and n.split(".")[0] not in shared)
    if missing:
        raise ValueError(f"draft checkpoint in {path} lacks parameters: {missing[:8]}")
    if shared:
        log.info("draft head uses the target's %s", " and ".join(shared))


def capture_layers(config: Any, draft_cfg: Any, num_layers: int) -> list[int]:
    """The target layers whose outputs feed an EAGLE-3 head: speculative.eagle3_layers_to_capture, else the
    checkpoint's eagle_aux_hidden_state_layer_ids, else the usual three."""
    given = config.speculative.eagle3_layers_to_capture
    if given is None:
        eagle = getattr(draft_cfg, "eagle_config", None) or {}
        given = eagle.get("eagle_aux_hidden_state_layer_ids") or getattr(
            draft_cfg, "eagle_aux_hidden_state_layer_ids", None)
    layers = list(given) if given else default_capture_layers(num_layers)
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"speculative.eagle3_layers_to_capture={layers}: an EAGLE-3 head reads three layers of "
                         f"the target's {num_layers}")
    return layers


def _capture(config: Any, runner: Any, draft_cfg: Any) -> None:
    inner = getattr(runner.model, "model", None)
    if not hasattr(inner, "aux"):
        raise ValueError(f"speculative.algorithm=EAGLE3 captures hidden states of Llama-family targets (Llama, "
                         f"Mistral, Qwen2, Qwen3); {type(runner.model).__name__} does not expose them")
    layers = capture_layers(config, draft_cfg, len(inner.layers))
    sched = config.scheduler
    rows = (max(sched.chunked_prefill_size, sched.max_prefill_tokens)
            + sched.max_num_seqs * config.speculative.effective_num_draft_tokens)
    inner.aux = AuxCapture(layers, int(runner.hf_config.hidden_size), rows, runner.dtype, runner.device)


class DraftModelSpeculator(Speculator):
    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.model = runner.draft_model
        if self.tree is None:  # trees draft eagerly (tree_drafting.py)
            self.chains = make_chain_graphs(self, None, self.model, _drafter_backend(runner.config, runner))
        self.catch_up_graphs = make_catch_up_graphs(self, None, None, 0)

    def draft_step(self, tokens: torch.Tensor, positions: torch.Tensor, meta: Any, hidden: Any
                   ) -> tuple[torch.Tensor, None]:
        return self.model.compute_logits(self.model(tokens, positions, meta)), None

    def catch_up_chunk(self, c: Chunk, emitted: dict[str, int], verifying: dict[str, int]) -> Chunk:
        """Row i reads the token at i; the token just sampled is the first draft's input, if its position fits
        the table and the model."""
        rid = c.state.request_id
        n = emitted[rid] if rid in verifying else c.num_tokens
        fits = c.sample and c.start + n < self.draft_limit(c.state)
        return Chunk(c.state, c.start, n + 1 if fits else n, fits)

    def first_position(self, state: Any) -> int:
        return state.num_computed + 1

    def _propose(self, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
                 emitted: dict[str, int], verifying: dict[str, int]) -> None:
        if self.propose_on_graphs(chunks, row_starts, emitted, verifying):
            return
        inputs = self.runner.host_inputs([self.catch_up_chunk(c, emitted, verifying) for c in chunks])
        h = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        states, rows = self.last_rows(inputs)
        if not states:
            return
        self.chain(states, self.model.compute_logits(h[rows]), [self.first_position(s) for s in states], None)


class EagleSpeculator(Speculator):
    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.head = runner.draft_model
        self.target = runner.model
        self.eagle3 = isinstance(self.head, Eagle3Head)
        size = int(self.head.config.hidden_size)
        self.id_map = self.head.target_ids() if self.eagle3 else None  # the head's vocabulary -> the target's
        if self.tree is None:  # trees draft eagerly (tree_drafting.py)
            self.chains = make_chain_graphs(self, size, self.head, _drafter_backend(runner.config, runner),
                                            self.id_map)
        self.catch_up_graphs = make_catch_up_graphs(self, self.catch_up_source(), size, 1)

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The head's logits (an EAGLE-3 head's own vocabulary, mapped to the target's by head.target_ids)."""
        return self.head.lm_head.compute_logits(normed) if self.eagle3 else self.target.compute_logits(normed)

    def draft_step(self, tokens: torch.Tensor, positions: torch.Tensor, meta: Any, hidden: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, pre = self.head(tokens, positions, hidden, meta)
        return self._logits(normed), pre

    def catch_up_source(self) -> torch.Tensor | None:
        """EAGLE-3: the captured target layers' buffer; EAGLE: the verify graphs' output."""
        if self.eagle3:
            return self.target.model.aux.buffer
        return self.verify_graphs.hidden if self.verify_graphs is not None else None

    def _propose(self, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor,
                 emitted: dict[str, int], verifying: dict[str, int]) -> None:
        if self.propose_on_graphs(chunks, row_starts, emitted, verifying):
            return
        inputs, input_ids, take = self.shifted_inputs(chunks, row_starts, emitted, verifying, hidden.device)
        features = self.target.model.aux.rows(take) if self.eagle3 else hidden[take]
        normed, pre = self.head(input_ids, inputs.positions, features, inputs.meta)
        states, rows = self.last_rows(inputs)
        if not states:
            return
        self.chain(states, self._logits(normed[rows]), [self.first_position(s) for s in states], pre[rows],
                   self.id_map)
