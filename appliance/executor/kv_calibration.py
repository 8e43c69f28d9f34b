"""Online fp8 KV scales (`precision.kv_cache_calibration_tokens`): each attention layer's per-tensor k and v
scales are the amax of the keys / values of the first N prefill tokens served, divided by the format's largest
value (448 for e4m3), then frozen. An MLA latent cache (layers/mla.py: one tensor, one scale) is calibrated the
same way from the amax of its stored latents (c_kv and the rotated k_pe, concatenated).

The scales move while the window is open, and every token stored so far must stay readable with the current one.
So a layer observes a step's prefill keys and values before they are stored (the scale already covers them), and
when its scale grows from s to s' it rewrites its whole cache as stored * s / s' (values only shrink: no new
saturation). Decode tokens stored meanwhile (decode graphs and the batch-1 chain included) use the scale of their
step and are rewritten the same way. The scale tensors are updated in place, so captured graphs read them.

While the window is open the runner runs prefill steps eagerly (no piecewise graphs) and Llama-family layers
take the unfused norm / rope / store path: the observation needs the post-rotary keys. Under tensor parallelism
each rank scales its own kv heads (an MLA latent is replicated: every rank reaches the same scale).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch

from appliance.kernels.reference.kv_quant import FP8_MAX, is_fp8
from appliance.layers.attention import Attention, AttentionMetadata

if TYPE_CHECKING:
    from appliance.layers.mla import MLAAttention

    Calibrated: TypeAlias = Attention | MLAAttention

log = logging.getLogger(__name__)

_RESCALE_BYTES = 64 << 20  # float32 working set of one rescale chunk


def _is_mla(layer: Calibrated) -> bool:
    """Whether layer is an MLA layer, without importing the MLA layers and their kernels into a worker whose model
    has none (an MLA layer exists only once its module is imported)."""
    mla = sys.modules.get("appliance.layers.mla")
    return mla is not None and isinstance(layer, mla.MLAAttention)


def calibrated_caches(layer: Calibrated) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """A layer's fp8 caches and their scale tensors, by the name its state keeps them under."""
    if _is_mla(layer):
        return {"latent": (layer.k_cache, layer.kv_scale)}
    return {"k": (layer.k_cache, layer.k_scale), "v": (layer.v_cache, layer.v_scale)}


def rescale_cache(cache: torch.Tensor, factor: float) -> None:
    """cache (fp8, [blocks, ...]) <- cache * factor, in place and in chunks of blocks (factor <= 1)."""
    per_block = max(1, cache[0].numel() * 4)
    step = max(1, _RESCALE_BYTES // per_block)
    for i in range(0, cache.shape[0], step):
        part = cache[i : i + step]
        part.copy_((part.float() * factor).to(cache.dtype))


@dataclass
class LayerCalibration:
    """One layer's running amax and the scales it has set (None before its first prefill token), by cache name."""
    remaining: int
    names: tuple[str, ...]
    amax: dict[str, float] = field(init=False)
    scale: dict[str, float | None] = field(init=False)

    def __post_init__(self) -> None:
        self.amax = {name: 0.0 for name in self.names}
        self.scale = {name: None for name in self.names}


class KVCalibration:
    """The open calibration window of a runner's fp8 attention layers; `done` once every layer saw N tokens."""

    def __init__(self, layers: list[Calibrated], tokens: int) -> None:
        if tokens < 1:
            raise ValueError(f"kv_cache_calibration_tokens must be at least 1, got {tokens}")
        self.tokens = tokens
        self.layers = layers
        self.state = {id(layer): LayerCalibration(tokens, tuple(calibrated_caches(layer))) for layer in layers}
        for layer in layers:
            layer.calibration = self

    @property
    def done(self) -> bool:
        return all(s.remaining == 0 for s in self.state.values())

    def observe(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Before layer stores k / v ([T, Hkv, D]): fold this step's first remaining prefill rows into its amax and
        grow its scales to cover them."""
        self._fold(layer, {"k": k, "v": v}, meta)

    def observe_latent(self, layer: MLAAttention, latent: torch.Tensor, meta: AttentionMetadata) -> None:
        """Before an MLA layer stores its latents ([T, R + dr]): as `observe`."""
        self._fold(layer, {"latent": latent}, meta)

    def _fold(self, layer: Calibrated, x: dict[str, torch.Tensor], meta: AttentionMetadata) -> None:
        """Decode rows (the first num_decode_tokens) and padding rows (slot -1) do not count."""
        st = self.state[id(layer)]
        nd = meta.num_decode_tokens
        t = next(iter(x.values())).shape[0]
        if st.remaining == 0 or nd == t:
            return
        real = meta.slot_mapping[nd:] >= 0  # a host sync: the window is eager and short
        rows = {name: y[nd:][real][: st.remaining] for name, y in x.items()}
        n = next(iter(rows.values())).shape[0]
        if n == 0:
            return
        st.remaining -= n
        for name, y in rows.items():
            st.amax[name] = max(st.amax[name], float(y.abs().amax()))
            self._grow(layer, st, name)
        if st.remaining == 0:
            layer.calibration = None
            if self.done:
                self._report()

    def _grow(self, layer: Calibrated, st: LayerCalibration, which: str) -> None:
        cache, scale = calibrated_caches(layer)[which]
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
        ranges = []
        for name in ("k", "v", "latent"):
            got = [s.scale[name] or 0.0 for s in self.state.values() if name in s.scale]
            if got:
                ranges.append(f"{name} {min(got):.3g}..{max(got):.3g}")
        log.info("fp8 KV scales calibrated over the first %d prefill tokens and frozen: %s over %d layers",
                 self.tokens, ", ".join(ranges), len(self.state))


def arm(layers: list[Calibrated], tokens: int) -> KVCalibration | None:
    """Open the window over the layers with a bound fp8 cache (16-bit high-precision layers keep none); None when
    calibration is off. Call after the warm-up, whose KV writes would count otherwise."""
    fp8 = [layer for layer in layers if layer.kv_scales]
    return KVCalibration(fp8, tokens) if tokens > 0 and fp8 else None
