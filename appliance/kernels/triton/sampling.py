"""Token sampling on the GPU without host syncs: greedy, temperature, min-p, top-k, top-p, seeded.

Op "sample": `(logits[B,V], temperature[B] f32, top_k[B] i32, top_p[B] f32, min_p[B] f32, seeds[B] i64,
steps[B] i64) -> token ids [B] int64`. Every setting is a per-row device tensor, so a batch mixing greedy and
random requests is one launch and nothing is read back but the ids.

Semantics (vLLM's order): temperature <= 0 means greedy argmax of the raw logits (lowest index on ties).
Otherwise l = logits / temperature, then min-p keeps tokens with prob >= min_p * max prob, top-k (0, -1 or >= V:
off) keeps tokens >= the k-th largest value (ties kept), top-p (1: off) keeps the smallest high set whose mass is
>= top_p of what min-p and top-k kept. The draw is a Gumbel race, argmax(l - ln E) with E = -ln u ~ Exp(1),
equivalent to sampling from softmax over the kept set; u in (0, 1) comes from a counter-based hash of (seed, step,
token index), so a request with a seed gets the same tokens on any batch composition. The torch reference
reproduces the uniforms bit for bit and the race values to ~1e-5 (kernels/reference/sampling.py `race_value`).

The race value is computed as l log2(e) - log2(E) (the same argmax) with the GPU's approximate lg2: with exact
logs the split path was bound by their arithmetic (120 us at 256 x 151,936 on the H100). Where u is near 1, E is
taken from a short series in 1 - u (exact in float32) instead, because an approximate log of u there has no
relative accuracy left, and those tokens (E near 0) are the likeliest winners. u has 23 bits plus a half, so it
never rounds to 1 (24 bits did: E = 0 made a random token win ~1% of 150k-token draws).

Thresholds, exactly: with top-k <= BLOCK_V (2048) the k-th largest of the per-lane maxima of the first pass is a
lower bound of the k-th largest value, so one more pass compacts the few tokens above it (<= CAP) into a scratch
row that is loaded into registers, where the top-k and top-p thresholds are found by bisection without further
passes over the row (tl.sort would do too, but compiles slowly and crawls in the CPU interpreter). Otherwise
(top-p without a small top-k, or too many candidates) the thresholds come from bisection over the float32 bit
patterns of the row (a monotone integer key), one pass over the row per step, up to ~32 passes each. Rows using
neither skip both. The torch reference lives in kernels/reference/sampling.py.

Split rows: a greedy row, or a random row without top-k, top-p or min-p, needs no threshold (the first pass only
finds the minimum, and every token is >= it), just an argmax of the raw logits or of the perturbed ones. Those rows
are cut along the vocabulary into chunks, one program each (`_chunk_kernel`, rows x chunks, enough programs to
fill the GPU), that write their local winner (value, lowest index); the per-row kernel then reduces a split row's
chunk winners (max value, lowest index among equals) and runs the full path above for the other rows. The winner
is the lowest index of the maximal value however the row is cut, and the perturbed value of a token depends only
on (seed, step, index), so both paths give the same token, bit for bit. Rows whose 1 / temperature is 0 or inf
(a degenerate threshold) stay on the full path. `sample_per_row` keeps the one-program-per-row launch.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from appliance.kernels.reference.sampling import (  # noqa: F401
    _M32,
    LN2,
    NEAR_ONE,
    sample_reference,
    uniform_reference,
)
from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, LOG2E

BLOCK_V = 2048
CAP = 2048  # top-k candidates kept in registers for the fast path
CHUNK_BLOCK = 1024  # elements per step of a chunk program (and the granularity of the chunk length)
MAX_CHUNKS = 256  # chunks per row at most: the per-row kernel reduces them in one vector
PROGRAMS_PER_SM = 4  # split rows: chunk programs per SM (H100, 256 x 151,936 bf16: 4 -> 120 us, 8 -> 136, 16 -> 124)


@triton.jit
def _fmix32_tl(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_seed(seed_ptr, step_ptr, b):
    step_h = _fmix32_tl(tl.load(step_ptr + b).to(tl.uint32) + 0x632BE5AB)
    return _fmix32_tl(tl.load(seed_ptr + b).to(tl.uint32) ^ step_h)


_LN2, _LOG2E, _NEAR_ONE = tl.constexpr(LN2), tl.constexpr(LOG2E), tl.constexpr(NEAR_ONE)

if INTERPRET:  # the interpreter has no libdevice: exact logs there (the reference's, to float32 rounding)
    @triton.jit
    def _lg2(x):
        return tl.log2(x)
else:
    @triton.jit
    def _lg2(x):
        return libdevice.fast_log2f(x)  # lg2.approx: one special-function instruction


@triton.jit
def _perturbed(lv, offs, s):
    """The race value of tokens offs in log2 units, lv log2(e) - log2(E): E = -ln u, u a hash of (row seed s, token
    index). Far from 1, E = -lg2(u) ln 2; within 1/16 of it, E = -ln(1 - w) = w + w^2/2 + ... + w^6/6 in w = 1 - u,
    which float32 holds exactly (truncation < w^6/7 relative)."""
    h = _fmix32_tl(s ^ _fmix32_tl(offs.to(tl.uint32)))
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    w = 1.0 - u
    series = w * (1.0 + w * (0.5 + w * (1.0 / 3.0 + w * (0.25 + w * (0.2 + w * (1.0 / 6.0))))))
    e = tl.where(w > _NEAR_ONE, -_lg2(u) * _LN2, series)
    return lv * _LOG2E - _lg2(e)


@triton.jit
def _splits(t, k, p, mp, vocab):
    """Whether a row needs no threshold: greedy, or a finite nonzero 1 / t and no min-p, top-k or top-p. Anything
    else (NaN settings too) takes the full path, which is exact by definition: erring that way only costs time."""
    inv_t = 1.0 / tl.where(t > 0.0, t, 1.0)  # the full path's 1 / t where t > 0 (no division by zero)
    unfiltered = (mp <= 0.0) & ((k <= 0) | (k >= vocab)) & (p >= 1.0)
    plain = (t > 0.0) & (inv_t > 0.0) & (inv_t < float("inf")) & unfiltered
    return (t <= 0.0) | plain


@triton.jit
def _chunk_kernel(logits_ptr, stride, vocab, chunk_len, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr,
                  part_val_ptr, part_idx_ptr, BLOCK_V: tl.constexpr):
    """Program (row b, chunk c) of a split row: the winner of tokens [c * chunk_len, (c + 1) * chunk_len)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + b)
    if _splits(t, tl.load(topk_ptr + b), tl.load(topp_ptr + b), tl.load(minp_ptr + b), vocab):
        row_ptr = logits_ptr + b.to(tl.int64) * stride
        start = c * chunk_len
        end = tl.minimum(start + chunk_len, vocab)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK_V], tl.int32)  # lanes that never win report 0, as in the full path
        if t <= 0.0:
            for s0 in range(start, end, BLOCK_V):
                offs = s0 + tl.arange(0, BLOCK_V)
                x = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
                better = x > best
                best_i = tl.where(better, offs, best_i)
                best = tl.where(better, x, best)
        else:
            inv_t = 1.0 / t
            s = _row_seed(seed_ptr, step_ptr, b)
            for s0 in range(start, end, BLOCK_V):
                offs = s0 + tl.arange(0, BLOCK_V)
                lv = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32) * inv_t
                g = tl.where(offs < end, _perturbed(lv, offs, s), float("-inf"))
                better = g > best
                best_i = tl.where(better, offs, best_i)
                best = tl.where(better, g, best)
        top = tl.max(best, 0)
        slot = b * tl.num_programs(1) + c
        tl.store(part_val_ptr + slot, top)
        tl.store(part_idx_ptr + slot, tl.min(tl.where(best == top, best_i, vocab), 0))


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
def _count_ge(row_ptr, vocab, inv_t, v, BLOCK_V: tl.constexpr):
    n = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        lv = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
        n += (lv >= v).to(tl.int32)
    return tl.sum(n, 0)


@triton.jit
def _mass_gt(row_ptr, vocab, inv_t, v, floor, mx, BLOCK_V: tl.constexpr):
    """Sum of exp(l - mx) over tokens with l > v and l >= floor."""
    m = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
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
                   scratch_ptr, part_val_ptr, part_idx_ptr, chunks, BLOCK_V: tl.constexpr, CAP: tl.constexpr,
                   BLOCK_CHUNKS: tl.constexpr):
    """One program per row. chunks >= 1: split rows reduce their chunk winners (see _chunk_kernel); 0: every
    row takes the full path."""
    b = tl.program_id(0)
    row_ptr = logits_ptr + b.to(tl.int64) * stride
    t = tl.load(temp_ptr + b)
    if (chunks > 0) & _splits(t, tl.load(topk_ptr + b), tl.load(topp_ptr + b), tl.load(minp_ptr + b), vocab):
        offs_c = tl.arange(0, BLOCK_CHUNKS)
        vals = tl.load(part_val_ptr + b * chunks + offs_c, mask=offs_c < chunks, other=float("-inf"))
        idxs = tl.load(part_idx_ptr + b * chunks + offs_c, mask=offs_c < chunks, other=vocab)
        top = tl.max(vals, 0)
        tl.store(out_ptr + b, tl.min(tl.where(vals == top, idxs, vocab), 0).to(tl.int64))
        return
    # pass 1: max (with its first index) and min of the raw logits
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_V], tl.int32)
    low = tl.full([BLOCK_V], float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
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
    if (k > 0) & (k <= BLOCK_V) & (k < vocab):
        # Fast path: the k-th largest lane maximum bounds the k-th largest value from below (the lanes hold
        # distinct elements), so the few tokens above it are compacted into scratch and top-k / top-p are found
        # among them in registers. Falls through to the full-row bisection when they overflow CAP.
        offs_l = tl.arange(0, BLOCK_V)
        lb = tl.maximum(_kth_largest(best, k) * inv_t, thr)
        count = vocab * 0
        scratch = scratch_ptr + b.to(tl.int64) * CAP
        for start in range(0, vocab, BLOCK_V):
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
            ok = _count_ge(row_ptr, vocab, inv_t, _unkey(mid), BLOCK_V) >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        thr = tl.maximum(thr, _unkey(lo))
    if (p < 1.0) & (done == 0):
        target = p * _mass_gt(row_ptr, vocab, inv_t, float("-inf"), thr, mx, BLOCK_V)
        lo = _key(thr) - 1  # mass above it is everything kept: not < target
        hi = _key(mx)  # mass above the max is 0 < target
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            ok = _mass_gt(row_ptr, vocab, inv_t, _unkey(mid), thr, mx, BLOCK_V) < target
            lo = tl.where(ok, lo, mid)
            hi = tl.where(ok, mid, hi)
        thr = tl.maximum(thr, _unkey(hi))
    # the race: argmax of l - ln(-ln u) over the kept tokens (in log2 units)
    s = _row_seed(seed_ptr, step_ptr, b)
    gbest = tl.full([BLOCK_V], float("-inf"), tl.float32)
    gbest_i = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        lv = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
        g = tl.where((lv >= thr) & (offs < vocab), _perturbed(lv, offs, s), float("-inf"))
        better = g > gbest
        gbest_i = tl.where(better, offs, gbest_i)
        gbest = tl.where(better, g, gbest)
    gmax = tl.max(gbest, 0)
    tl.store(out_ptr + b, tl.min(tl.where(gbest == gmax, gbest_i, vocab), 0).to(tl.int64))


def chunks_for(batch: int, vocab: int, sms: int, programs_per_sm: int = PROGRAMS_PER_SM,
               chunk_block: int = CHUNK_BLOCK) -> int:
    """Chunks per split row: about programs_per_sm programs on every SM, each at least one chunk_block long."""
    if batch < 1 or vocab < 1 or sms < 1 or programs_per_sm < 1:
        raise ValueError(f"chunks_for: batch, vocab, sms, programs_per_sm must be >= 1, got "
                         f"{(batch, vocab, sms, programs_per_sm)}")
    want = -(-programs_per_sm * sms // batch)
    return max(1, min(want, MAX_CHUNKS, -(-vocab // chunk_block)))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the CPU interpreter runs programs one after another: fewest chunks is fastest
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(logits: torch.Tensor, *settings: torch.Tensor) -> None:
    bsz = logits.shape[0]
    names = ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")
    for name, tensor in zip(names, settings):
        if tensor.shape != (bsz,):
            raise ValueError(f"sample: {name} must be [{bsz}], got {tuple(tensor.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("sample: logits must be contiguous along the vocabulary")


def _launch(logits: torch.Tensor, settings: tuple[torch.Tensor, ...], chunks: int, chunk_block: int) -> torch.Tensor:
    """chunks 0: one program per row for every row (the full path); >= 1: split rows cut into that many chunks."""
    bsz, vocab = logits.shape
    out = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    if not bsz:
        return out
    temperature, top_k, top_p, min_p, seeds, steps = settings
    args = (temperature.float(), top_k.to(torch.int32), top_p.float(), min_p.float(), seeds.to(torch.int64),
            steps.to(torch.int64))
    blocks = -(-vocab // chunk_block)
    chunk_len = chunk_block * -(-blocks // max(chunks, 1))
    chunks = -(-vocab // chunk_len) if chunks else 0  # cut at chunk_block multiples: maybe fewer than asked
    parts = max(bsz * chunks, 1)
    part_val = torch.empty(parts, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(parts, dtype=torch.int32, device=logits.device)
    if chunks:
        _chunk_kernel[(bsz, chunks)](logits, logits.stride(0), vocab, chunk_len, *args, part_val, part_idx,
                                     BLOCK_V=chunk_block, num_warps=4)
    scratch = torch.empty(bsz, CAP, dtype=torch.float32, device=logits.device)
    _sample_kernel[(bsz,)](logits, logits.stride(0), vocab, *args, out, scratch, part_val, part_idx, chunks,
                           BLOCK_V=BLOCK_V, CAP=CAP, BLOCK_CHUNKS=MAX_CHUNKS, num_warps=8)
    return out


def sample_split(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *, chunks: int | None = None,
                 programs_per_sm: int = PROGRAMS_PER_SM, chunk_block: int = CHUNK_BLOCK) -> torch.Tensor:
    """The "sample" op with its knobs: chunks per split row (default: chunks_for this GPU), the chunk granularity
    (a power of two >= 16; tests shrink it to split small vocabularies)."""
    settings = (temperature, top_k, top_p, min_p, seeds, steps)
    _check(logits, *settings)
    if chunk_block < 16 or chunk_block & (chunk_block - 1):
        raise ValueError(f"sample: chunk_block must be a power of two >= 16, got {chunk_block}")
    bsz, vocab = logits.shape
    if chunks is None:
        chunks = chunks_for(bsz, vocab, _num_sms(logits.device), programs_per_sm, chunk_block) if bsz else 1
    if not 1 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"sample: chunks must be in [1, {MAX_CHUNKS}], got {chunks}")
    return _launch(logits, settings, chunks, chunk_block)


def sample_per_row(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One program per row, every row on the full path (the launch before split rows; kept to compare with)."""
    settings = (temperature, top_k, top_p, min_p, seeds, steps)
    _check(logits, *settings)
    return _launch(logits, settings, 0, CHUNK_BLOCK)


@register("sample", "triton")
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    return sample_split(logits, temperature, top_k, top_p, min_p, seeds, steps)
