"""Online fp8 KV scales (`precision.kv_cache_calibration_tokens`): each attention layer's per-tensor k and v
scales are the amax of the keys / values of the first N prefill tokens served, divided by the format's largest
value (448 for e4m3), then frozen.

The scales move while the window is open, and every token stored so far must stay readable with the current one.
So a layer observes a step's prefill keys and values before they are stored (the scale already covers them), and
when its scale grows from s to s' it rewrites its whole cache as stored * s / s' (values only shrink: no new
saturation). Decode tokens stored meanwhile (decode graphs and the batch-1 chain included) use the scale of their
step and are rewritten the same way. The scale tensors are updated in place, so captured graphs read them.

While the window is open the runner runs prefill steps eagerly (no piecewise graphs) and Llama-family layers
take the unfused norm / rope / store path: the observation needs the post-rotary keys. Under tensor parallelism
each rank scales its own kv heads. Only the paged K/V cache of `Attention` is calibrated: an MLA latent cache is
refused at start-up.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from appliance.kernels.reference.kv_quant import FP8_MAX, is_fp8
from appliance.layers.attention import Attention, AttentionMetadata

log = logging.getLogger(__name__)

_RESCALE_BYTES = 64 << 20  # float32 working set of one rescale chunk


def rescale_cache(cache: torch.Tensor, factor: float) -> None:
    """cache (fp8, [blocks, ...]) <- cache * factor, in place and in chunks of blocks (factor <= 1)."""
    per_block = max(1, cache[0].numel() * 4)
    step = max(1, _RESCALE_BYTES // per_block)
    for i in range(0, cache.shape[0], step):
        part = cache[i : i + step]
        part.copy_((part.float() * factor).to(cache.dtype))


@dataclass
class LayerCalibration:
    """One layer's running amax and the scales it has set (None before its first prefill token)."""
    remaining: int
    amax: dict[str, float] = field(default_factory=lambda: {"k": 0.0, "v": 0.0})
    scale: dict[str, float | None] = field(default_factory=lambda: {"k": None, "v": None})


class KVCalibration:
    """The open calibration window of a runner's fp8 attention layers; `done` once every layer saw N tokens."""

    def __init__(self, layers: list[Attention], tokens: int) -> None:
        if tokens < 1:
            raise ValueError(f"kv_cache_calibration_tokens must be at least 1, got {tokens}")
        self.tokens = tokens
        self.layers = layers
        self.state = {id(layer): LayerCalibration(tokens) for layer in layers}
        for layer in layers:
            layer.calibration = self

    @property
    def done(self) -> bool:
        return all(s.remaining == 0 for s in self.state.values())

    def observe(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Before layer stores k / v ([T, Hkv, D]): fold this step's first remaining prefill rows into its amax and
        grow its scales to cover them. Decode rows (the first num_decode_tokens) and padding rows (slot -1) do not
        count."""
        st = self.state[id(layer)]
        nd = meta.num_decode_tokens
        if st.remaining == 0 or nd == k.shape[0]:
            return
        real = meta.slot_mapping[nd:] >= 0  # a host sync: the window is eager and short
        rows = {"k": k[nd:][real][: st.remaining], "v": v[nd:][real][: st.remaining]}
        n = rows["k"].shape[0]
        if n == 0:
            return
        st.remaining -= n
        for which, x in rows.items():
            st.amax[which] = max(st.amax[which], float(x.abs().amax()))
            self._grow(layer, st, which)
        if st.remaining == 0:
            layer.calibration = None
            if self.done:
                self._report()

    def _grow(self, layer: Attention, st: LayerCalibration, which: str) -> None:
        cache = layer.k_cache if which == "k" else layer.v_cache
        scale = layer.k_scale if which == "k" else layer.v_scale
        assert cache is not None and scale is not None and is_fp8(cache.dtype)
        if st.amax[which] == 0.0:
            return  # nothing to scale yet; the first non-zero amax sets it
        new = st.amax[which] / FP8_MAX[cache.dtype]
        old = st.scale[which]
        if old is not None and new <= old:
            return
        if old is not None:  # before the first scale nothing valid is stored (warm-up's writes are garbage)
            rescale_cache(cache, old / new)
        scale.fill_(new)
        st.scale[which] = new

    def _report(self) -> None:
        ks = [s.scale["k"] or 0.0 for s in self.state.values()]
        vs = [s.scale["v"] or 0.0 for s in self.state.values()]
        log.info("fp8 KV scales calibrated over the first %d prefill tokens and frozen: k %.3g..%.3g, v %.3g..%.3g "
                 "over %d layers", self.tokens, min(ks), max(ks), min(vs), max(vs), len(ks))


def arm(layers: list[Attention], tokens: int) -> KVCalibration | None:
    """Open the window over the layers with a bound fp8 cache (16-bit high-precision layers keep none); None when
    calibration is off. Call after the warm-up, whose KV writes would count otherwise. executor/kv_scales.py has
    refused the caches this cannot calibrate."""
    fp8 = [layer for layer in layers if layer.kv_scales]
    return KVCalibration(fp8, tokens) if tokens > 0 and fp8 else None
