"""Token sampling on the GPU without host syncs: greedy, temperature, min-p, top-k, top-p, seeded.

Op "sample": `(logits[B,V], temperature[B] f32, top_k[B] i32, top_p[B] f32, min_p[B] f32, seeds[B] i64,
steps[B] i64) -> token ids [B] int64`. Every setting is a per-row device tensor, so a batch mixing greedy and
random requests is one launch and nothing is read back but the ids.

Semantics (vLLM's order): temperature <= 0 means greedy argmax of the raw logits (lowest index on ties).
Otherwise l = logits / temperature, then min-p keeps tokens with prob >= min_p * max prob, top-k (0, -1 or >= V:
off) keeps tokens >= the k-th largest value (ties kept), top-p (1: off) keeps the smallest high set whose mass is
>= top_p of what min-p and top-k kept. The draw is a Gumbel race, argmax(l - log(-log u)), equivalent to sampling
from softmax over the kept set; u comes from a counter-based hash of (seed, step, token index), so a request with
a seed gets the same tokens on any batch composition and the torch reference below reproduces the kernel bit for
bit in its random numbers.

Thresholds, exactly: with top-k <= BLOCK (2048) the k-th largest of the per-lane maxima of the first pass is a
lower bound of the k-th largest value, so one more pass compacts the few tokens above it (<= CAP) into a scratch
row that is loaded into registers, where the top-k and top-p thresholds are found by bisection without further
passes over the row (tl.sort would do too, but compiles slowly and crawls in the CPU interpreter). Otherwise
(top-p without a small top-k, or too many candidates) the thresholds come from bisection over the float32 bit
patterns of the row (a monotone integer key), one pass over the row per step, up to ~32 passes each. Rows using
neither skip both. The torch reference lives in kernels/reference/sampling.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.reference.sampling import _M32, sample_reference, uniform_reference  # noqa: F401
from appliance.kernels.registry import register

BLOCK = 2048
CAP = 2048  # top-k candidates kept in registers for the fast path


@triton.jit
def _fmix32_tl(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


# ---------------------------------------------------------------- triton
@triton.jit
def _key(v):
    """float32 -> int64 key with the same order."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _unkey(k):
    bits = k.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _count_ge(row_ptr, vocab, inv_t, v, BLOCK: tl.constexpr):
    n = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lv = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
        n += (lv >= v).to(tl.int32)
    return tl.sum(n, 0)


@triton.jit
def _mass_gt(row_ptr, vocab, inv_t, v, floor, mx, BLOCK: tl.constexpr):
    """Sum of exp(l - mx) over tokens with l > v and l >= floor."""
    m = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lv = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
        m += tl.where((lv > v) & (lv >= floor), tl.exp(lv - mx), 0.0)
    return tl.sum(m, 0)


@triton.jit
def _kth_largest(vals, k):
    """The k-th largest of a register vector (-inf = empty slot; needs >= k real values): key bisection."""
    lo = _key(tl.min(tl.where(vals > float("-inf"), vals, float("inf")), 0))
    hi = _key(tl.max(vals, 0)) + 1
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        ok = tl.sum((vals >= _unkey(mid)).to(tl.int32), 0) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return _unkey(lo)


@triton.jit
def _top_p_floor(vals, thr, mx, p):
    """Smallest kept value of the top-p set among vals >= thr (a register vector): key bisection on the mass."""
    w = tl.where(vals >= thr, tl.exp(vals - mx), 0.0)
    target = p * tl.sum(w, 0)
    lo = _key(thr) - 1
    hi = _key(tl.max(vals, 0))
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        ok = tl.sum(tl.where(vals > _unkey(mid), w, 0.0), 0) < target
        lo = tl.where(ok, lo, mid)
        hi = tl.where(ok, mid, hi)
    return _unkey(hi)


@triton.jit
def _sample_kernel(logits_ptr, stride, vocab, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, out_ptr,
                   scratch_ptr, BLOCK: tl.constexpr, CAP: tl.constexpr):
    b = tl.program_id(0)
    row_ptr = logits_ptr + b.to(tl.int64) * stride
    t = tl.load(temp_ptr + b)
    # pass 1: max (with its first index) and min of the raw logits
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        better = x > best
        best_i = tl.where(better, offs, best_i)
        best = tl.where(better, x, best)
        low = tl.minimum(low, tl.where(offs < vocab, x, float("inf")))
    raw_max = tl.max(best, 0)
    greedy_i = tl.min(tl.where(best == raw_max, best_i, vocab), 0)
    if t <= 0.0:
        tl.store(out_ptr + b, greedy_i.to(tl.int64))
        return
    inv_t = 1.0 / t
    mx = raw_max * inv_t
    mn = tl.min(low, 0) * inv_t
    thr = mn
    mp = tl.load(minp_ptr + b)
    if mp > 0.0:
        thr = tl.maximum(thr, mx + tl.log(mp))
    k = tl.load(topk_ptr + b)
    p = tl.load(topp_ptr + b)
    done = vocab * 0  # runtime int32 0: the fast path has not decided yet
    if (k > 0) & (k <= BLOCK) & (k < vocab):
        # Fast path: the k-th largest lane maximum bounds the k-th largest value from below (the lanes hold
        # distinct elements), so the few tokens above it are compacted into scratch and top-k / top-p are found
        # among them in registers. Falls through to the full-row bisection when they overflow CAP.
        offs_l = tl.arange(0, BLOCK)
        lb = tl.maximum(_kth_largest(best, k) * inv_t, thr)
        count = vocab * 0
        scratch = scratch_ptr + b.to(tl.int64) * CAP
        for start in range(0, vocab, BLOCK):
            offs = start + offs_l
            lv = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
            hit = (lv >= lb) & (offs < vocab)
            dst = count + tl.cumsum(hit.to(tl.int32), 0) - 1
            tl.store(scratch + dst, lv, mask=hit & (dst < CAP))
            count += tl.sum(hit.to(tl.int32), 0)
        tl.debug_barrier()  # the stores above come from other threads of this program
        if count <= CAP:
            offs_c = tl.arange(0, CAP)
            cand = tl.load(scratch + offs_c, mask=offs_c < count, other=float("-inf"))
            thr = tl.where(count >= k, tl.maximum(thr, _kth_largest(cand, k)), thr)  # < k left after min-p: no-op
            if p < 1.0:
                thr = tl.maximum(thr, _top_p_floor(cand, thr, mx, p))
            done = count * 0 + 1
    if (k > 0) & (k < vocab) & (done == 0):
        lo = _key(mn)  # count(l >= lo) = V >= k
        hi = _key(mx) + 1  # count(l >= hi) = 0 < k
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            ok = _count_ge(row_ptr, vocab, inv_t, _unkey(mid), BLOCK) >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        thr = tl.maximum(thr, _unkey(lo))
    if (p < 1.0) & (done == 0):
        target = p * _mass_gt(row_ptr, vocab, inv_t, float("-inf"), thr, mx, BLOCK)
        lo = _key(thr) - 1  # mass above it is everything kept: not < target
        hi = _key(mx)  # mass above the max is 0 < target
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            ok = _mass_gt(row_ptr, vocab, inv_t, _unkey(mid), thr, mx, BLOCK) < target
            lo = tl.where(ok, lo, mid)
            hi = tl.where(ok, mid, hi)
        thr = tl.maximum(thr, _unkey(hi))
    # the race: argmax of l - log(-log u) over the kept tokens
    s = _fmix32_tl(tl.load(seed_ptr + b).to(tl.uint32) ^ _fmix32_tl(tl.load(step_ptr + b).to(tl.uint32) + 0x632BE5AB))
    gbest = tl.full([BLOCK], float("-inf"), tl.float32)
    gbest_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lv = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
        h = _fmix32_tl(s ^ _fmix32_tl(offs.to(tl.uint32)))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        g = tl.where((lv >= thr) & (offs < vocab), lv - tl.log(-tl.log(u)), float("-inf"))
        better = g > gbest
        gbest_i = tl.where(better, offs, gbest_i)
        gbest = tl.where(better, g, gbest)
    gmax = tl.max(gbest, 0)
    tl.store(out_ptr + b, tl.min(tl.where(gbest == gmax, gbest_i, vocab), 0).to(tl.int64))


@register("sample", "triton")
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    bsz, vocab = logits.shape
    for name, tensor in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                         ("seeds", seeds), ("steps", steps)):
        if tensor.shape != (bsz,):
            raise ValueError(f"sample: {name} must be [{bsz}], got {tuple(tensor.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("sample: logits must be contiguous along the vocabulary")
    out = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    if bsz:
        scratch = torch.empty(bsz, CAP, dtype=torch.float32, device=logits.device)
        _sample_kernel[(bsz,)](logits, logits.stride(0), vocab, temperature.float(), top_k.to(torch.int32),
                               top_p.float(), min_p.float(), seeds.to(torch.int64), steps.to(torch.int64), out,
                               scratch, BLOCK=BLOCK, CAP=CAP, num_warps=8)
    return out
