"""The Gated DeltaNet layer's short causal convolution over a prefill step's sequences, in two launches: the
depthwise convolution + SiLU of every token (its first K - 1 taps from the sequence's conv state, zeros for a
fresh sequence), then each sequence's new conv state (its last K - 1 inputs). The torch reference
(kernels/reference/gated_delta.py `causal_conv1d`) loops over the sequences on the host, five small ops each; the
step's offsets, slots and fresh flags are the uploads the gated delta rule's prefill shares (triton/gated_delta.py
`prefill_args`: one pinned copy per step). The states are written by the second launch, after every program of
the first has read them. Rounding follows the reference: inputs pass through the state dtype, the convolution's
sum is rounded to the weight's dtype before the SiLU.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register
from appliance.kernels.triton.gated_delta import prefill_args

_TOKENS = 32  # tokens per program
_CHANNELS = 128  # channels per program


@triton.jit
def _conv_kernel(x_ptr, w_ptr, states_ptr, out_ptr, cu_ptr, slots_ptr, keep_ptr, channels, stride_x, stride_o,
                 stride_ss, stride_sc, stride_w, WIDTH: tl.constexpr, TOKENS: tl.constexpr, CHANNELS: tl.constexpr):
    seq = tl.program_id(0)
    start, end = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    pos = tl.program_id(1) * TOKENS + tl.arange(0, TOKENS)  # positions within the sequence
    if tl.program_id(1) * TOKENS >= end - start:
        return
    ch = tl.program_id(2) * CHANNELS + tl.arange(0, CHANNELS)
    cmask = ch < channels
    state = states_ptr + tl.load(slots_ptr + seq) * stride_ss
    keep = tl.load(keep_ptr + seq)  # 0.0 for a fresh sequence, which reads zeros before its first token
    acc = tl.zeros([TOKENS, CHANNELS], tl.float32)
    for k in tl.static_range(WIDTH + 1):  # tap k reads the input at pos - WIDTH + k
        src = pos - WIDTH + k
        from_x = tl.load(x_ptr + (start + tl.maximum(src, 0))[:, None] * stride_x + ch[None, :],
                         mask=((src >= 0) & (pos < end - start))[:, None] & cmask[None, :], other=0.0)
        from_state = tl.load(state + ch[None, :] * stride_sc + (src + WIDTH)[:, None],
                             mask=(src < 0)[:, None] & cmask[None, :], other=0.0)
        from_state = (from_state.to(tl.float32) * keep).to(states_ptr.dtype.element_ty)
        val = tl.where((src >= 0)[:, None], from_x.to(states_ptr.dtype.element_ty), from_state)
        w = tl.load(w_ptr + ch * stride_w + k, mask=cmask, other=0.0)
        acc += val.to(w_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)[None, :]
    y = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    y = (y * tl.sigmoid(y)).to(w_ptr.dtype.element_ty)
    tl.store(out_ptr + (start + pos)[:, None] * stride_o + ch[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(pos < end - start)[:, None] & cmask[None, :])


@triton.jit
def _state_kernel(x_ptr, states_ptr, cu_ptr, slots_ptr, keep_ptr, channels, stride_x, stride_ss, stride_sc,
                  WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, CHANNELS: tl.constexpr):
    """The sequence's last WIDTH inputs (older state entries where it is shorter than WIDTH) into its slot."""
    seq = tl.program_id(0)
    start, end = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    length = end - start
    ch = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    j = tl.arange(0, BLOCK_W)
    state = states_ptr + tl.load(slots_ptr + seq) * stride_ss
    keep = tl.load(keep_ptr + seq)
    src = length - WIDTH + j  # entry j of the new state is input src of the sequence (< 0: old entry src + WIDTH)
    cmask = (ch < channels)[None, :]
    jmask = (j < WIDTH)[:, None]
    from_x = tl.load(x_ptr + (start + tl.maximum(src, 0))[:, None] * stride_x + ch[None, :],
                     mask=jmask & (src >= 0)[:, None] & cmask, other=0.0)
    from_state = tl.load(state + ch[None, :] * stride_sc + tl.maximum(src + WIDTH, 0)[:, None],
                         mask=jmask & (src < 0)[:, None] & cmask, other=0.0)
    from_state = (from_state.to(tl.float32) * keep).to(states_ptr.dtype.element_ty)
    new = tl.where((src >= 0)[:, None], from_x.to(states_ptr.dtype.element_ty), from_state)
    tl.debug_barrier()  # a sequence shorter than WIDTH moves entries within its slot: every read before any write
    tl.store(state + ch[None, :] * stride_sc + j[:, None], new, mask=jmask & cmask)


@register("causal_conv1d", "triton")
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int], conv_states: torch.Tensor,
                  slots: list[int], fresh: list[bool]) -> torch.Tensor:
    """kernels/reference/gated_delta.py's causal_conv1d: x [T, C] (rows may be strided), weight [C, K],
    conv_states [S, C, K - 1]."""
    t, channels = x.shape
    width = conv_states.shape[-1]
    if weight.shape != (channels, width + 1) or conv_states.shape[1] != channels:
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)} and conv states "
                         f"{tuple(conv_states.shape)} disagree")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(t, channels, dtype=x.dtype, device=x.device)
    seqs = len(slots)
    if not t or not seqs:
        return out
    args = prefill_args(cu_seqlens, slots, fresh, x.device)
    longest = max(b - a for a, b in itertools.pairwise(cu_seqlens))
    ss, sc = conv_states.stride(0), conv_states.stride(1)
    if conv_states.stride(2) != 1:
        raise ValueError("causal_conv1d: conv states must be contiguous in their last dim")
    cblocks = triton.cdiv(channels, _CHANNELS)
    _conv_kernel[(seqs, triton.cdiv(longest, _TOKENS), cblocks)](
        x, weight, conv_states, out, args.cu_seqlens, args.slots, args.keep, channels, x.stride(0), out.stride(0),
        ss, sc, weight.stride(0), WIDTH=width, TOKENS=_TOKENS, CHANNELS=_CHANNELS)
    _state_kernel[(seqs, cblocks)](x, conv_states, args.cu_seqlens, args.slots, args.keep, channels, x.stride(0),
                                   ss, sc, WIDTH=width, BLOCK_W=triton.next_power_of_2(width), CHANNELS=_CHANNELS)
    return out
