"""The gated delta rule (Gated DeltaNet linear attention) and its causal short convolution, over per-request state
slots: the torch oracle and the CPU path.

State of one sequence and value head: S [Dk, Dv] (float32). Per token t, with q and k L2-normalised and q scaled
by Dk^-1/2: S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t. `recurrent_*` runs that
token by token; `chunked_*` computes the same in chunks of `chunk` tokens (the WY / UT form: within a chunk
the delta updates are one triangular solve, across chunks one state carry), which is what prefill uses.

Slots: `states[slot]` is a request's state; `fresh[i]` says sequence i starts from zero (its first token is
position 0) instead of reading its slot. Results are written back into the slots. Slot 0 is a scratch slot for
padding rows and for steps run without request rows (profiling, warm-up).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.kernels.registry import register


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prepare(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised, scaled float32 q and k with each key head repeated for its group of value heads."""
    rep = hv // q.shape[-2]
    q, k = _l2norm(q.float()), _l2norm(k.float())
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def recurrent_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token: q, k [L, H, Dk] (already prepared), v [L, H, Dv], g, beta [L, H] float32,
    state [H, Dk, Dv] -> (o [L, H, Dv] float32, final state)."""
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        kv = torch.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - kv) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out), state


def chunked_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_sequence's result in chunks of `chunk` tokens (same arguments)."""
    length = q.shape[0]
    pad = -length % chunk
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # [H, L', D]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))  # [H, L']
    h = q.shape[0]
    q, k, v = (x.reshape(h, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(h, -1, chunk), beta.reshape(h, -1, chunk)
    cum = g.cumsum(-1)  # [H, N, C] log decay from the chunk start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strictly-lower(diag(beta) K K^T * decay)) u = v_beta, and the same for the decayed keys
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~causal, 0.0).tril(-1) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ v_new
        state = state * cum[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, -1, out.shape[-1])[:, :length].transpose(0, 1), state


def _initial(states: torch.Tensor, slot: int, fresh: bool) -> torch.Tensor:
    return torch.zeros_like(states[slot], dtype=torch.float32) if fresh else states[slot].float()


@register("gated_delta_prefill", "torch")
def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        cu_seqlens: list[int], states: torch.Tensor, slots: list[int], fresh: list[bool],
                        chunk: int = 64) -> torch.Tensor:
    """Sequences of cu_seqlens over rows of q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv]; states [S, Hv, Dk,
    Dv]. Returns o [T, Hv, Dv] in v's dtype; each sequence's final state goes to its slot."""
    q, k = _prepare(q, k, v.shape[-2])
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for i, (slot, is_fresh) in enumerate(zip(slots, fresh)):
        a, b = cu_seqlens[i], cu_seqlens[i + 1]
        if b == a:
            continue
        o, final = chunked_sequence(q[a:b], k[a:b], v[a:b].float(), g[a:b].float(), beta[a:b].float(),
                                    _initial(states, slot, is_fresh), chunk)
        out[a:b] = o
        states[slot] = final.to(states.dtype)
    return out.to(v.dtype)


@register("gated_delta_decode", "torch")
def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """One token per row b: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], slots [B] int64, fresh [B] bool.
    Returns o [B, Hv, Dv]; the rows' states are updated in their slots (no host sync)."""
    q, k = _prepare(q, k, v.shape[-2])
    state = states.index_select(0, slots).float() * (~fresh).float()[:, None, None, None]
    state = state * g.float().exp()[..., None, None]
    kv = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v.float() - kv) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    states.index_copy_(0, slots, state.to(states.dtype))
    return torch.einsum("bhkv,bhk->bhv", state, q).to(v.dtype)


@register("causal_conv1d", "torch")
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int], conv_states: torch.Tensor,
                  slots: list[int], fresh: list[bool]) -> torch.Tensor:
    """Depthwise causal convolution + SiLU of the sequences of cu_seqlens over x [T, C]; weight [C, K];
    conv_states [S, C, K - 1] hold each request's last K - 1 inputs (zeros before its first token)."""
    out = torch.empty_like(x)
    for i, (slot, is_fresh) in enumerate(zip(slots, fresh)):
        a, b = cu_seqlens[i], cu_seqlens[i + 1]
        if b == a:
            continue
        prev = torch.zeros_like(conv_states[slot]) if is_fresh else conv_states[slot]
        seq = torch.cat([prev, x[a:b].t().to(conv_states.dtype)], dim=-1)  # [C, K - 1 + L]
        conv_states[slot] = seq[:, seq.shape[-1] - conv_states.shape[-1]:]
        y = F.conv1d(seq[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
        out[a:b] = F.silu(y).t().to(x.dtype)
    return out


@register("causal_conv1d_decode", "torch")
def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                         fresh: torch.Tensor) -> torch.Tensor:
    """One token per row of x [B, C]: causal_conv1d's result without leaving the device."""
    prev = conv_states.index_select(0, slots) * (~fresh).to(conv_states.dtype)[:, None, None]
    seq = torch.cat([prev, x[:, :, None].to(conv_states.dtype)], dim=-1)  # [B, C, K]
    conv_states.index_copy_(0, slots, seq[:, :, 1:])
    return F.silu((seq.to(weight.dtype) * weight).sum(-1)).to(x.dtype)


@register("gdn_gating", "torch")
def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's gates from its projections a, b [T, Hv] (or [T, Hk, G]: grouped per key head, value
    head h = kh * G + j): (g = -exp(A_log) softplus(a + dt_bias) [T, Hv] float32, the log decay; beta = sigmoid(b)
    [T, Hv] in b's dtype), as transformers computes them."""
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()
