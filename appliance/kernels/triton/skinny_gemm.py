"""Skinny GEMM y = x W^T (+ b) for decode steps of 17..256 rows, where cuBLAS is launch- and ramp-latency bound.

A small model's decode step (Qwen3-0.6B: weights of 4-13 MB, M = 17..256 tokens) spends its linear layers in
cuBLAS GEMMs of 6-9 us inside CUDA graphs, much of it launch and pipeline ramp rather than bytes or FLOPs.
This kernel goes after that time in two ways:

- it fills the GPU: tiles are chosen (tuned_table, measured; config_for, the guess a sweep starts from) so that the
  grid has about one program per SM or more even at a few dozen rows, where a square-tile GEMM leaves most SMs
  idle; programs that share a weight tile are
  adjacent in launch order (the M blocks vary fastest), so the weight is read from HBM once and from L2 after;
- programmatic dependent launch inside captured graphs (common.py): its programs start while the kernel before
  (a norm, SiLU-and-mul) still runs, and may load their first PREFETCH weight tiles into registers before
  gdc_wait, since no kernel of the step writes weights. Only x (the kernel before's output) waits.

Two orientations, a constexpr each way so the GPU can decide: x W^T with the x tile as the MMA's left operand
(the plain TN GEMM), or y^T = W x^T with the weight tile on the left as stored (gemv.py's), which keeps the
warpgroup MMA's 64-row side on the weight when BLOCK_M is the smaller block. Accumulation is fp32, the bias is
added in fp32 before the one rounding to x's dtype. tools/lab_gemm.py times the configs against cuBLAS.

The registered op routes: a weight shape and row count that tools/lab_gemm.py measured faster than cuBLAS on the
H100 (`tuned_table`) runs this kernel with the config that won; every other call goes to cuBLAS, which won there or was
not measured: through kernels/cublaslt.py, which runs the library's fastest measured algorithm where its own
table has one and F.linear elsewhere. `config=` runs the kernel whatever the table says (tests, tuning).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from appliance.kernels import cublaslt, tuned
from appliance.kernels.capability import capability
from appliance.kernels.reference.linear import SKINNY_GEMM_MAX_ROWS as MAX_M
from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, mma, pdl_kwargs

MAX_PREFETCH = 2  # tiles held in registers across gdc_wait: each costs BLOCK_N * BLOCK_K / threads registers
MIN_PROGRAMS = 100  # about one program per SM of an H100 (132): fewer leave SMs idle for the whole GEMM
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SkinnyGemmConfig:
    """One launch's tiling. `w_left`: compute y^T = W x^T (weight tile as the MMA's left operand) instead of
    x W^T. `prefetch`: weight K-tiles loaded before gdc_wait (0 = none; any launch, PDL or not)."""
    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    prefetch: int = 0
    w_left: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SkinnyGemmConfig: {name} = {v} must be a power of two >= 16 (tl.dot)")
        if not 0 <= self.prefetch <= MAX_PREFETCH:
            raise ValueError(f"SkinnyGemmConfig: prefetch = {self.prefetch} must be in 0..{MAX_PREFETCH}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("SkinnyGemmConfig: num_warps and num_stages must be >= 1")


def config_for(m: int, n: int, k: int) -> SkinnyGemmConfig:
    """A guess until tools/lab_gemm.py has measured it: the largest tile (an M block of 64 rows up to M = 64, of
    128 or else 64 above; the widest N block) whose grid has MIN_PROGRAMS programs, else the most programs there
    can be (64 x 16 tiles): wide tiles reuse each x and weight tile more, narrow ones fill the SMs. The weight is
    the MMA's left operand when its block is the larger one."""
    if INTERPRET:  # the CPU interpreter's time goes with tile count and size alike: small tiles, few of them
        return SkinnyGemmConfig(block_m=32, block_n=32, block_k=32, num_stages=1)
    bm, bn = 64, 16
    for cand_m, cand_n in itertools.product((64,) if m <= 64 else (128, 64), (128, 64, 32)):
        if triton.cdiv(max(m, 1), cand_m) * triton.cdiv(n, cand_n) >= MIN_PROGRAMS:
            bm, bn = cand_m, cand_n
            break
    big = bm * bn >= 128 * 128
    return SkinnyGemmConfig(block_m=bm, block_n=bn, block_k=64 if big else 128, num_warps=8 if big else 4,
                            num_stages=3 if big else 4, w_left=bn > bm)


SkinnyTable = dict[tuple[int, int], tuple[tuple[int, SkinnyGemmConfig | None], ...]]


@functools.cache
def tuned_table(arch: str) -> SkinnyTable:
    """(N, K) -> ((up to this many rows, the config), ...), rows ascending; None: cuBLAS. The data file
    kernels/tuned/<arch>_skinny_gemm.json (sm_90: Qwen3-0.6B's shapes, timed in CUDA graphs of 20 [PDL elementwise
    kernel -> GEMM] pairs at 32 / 64 / 128 / 192 / 256 rows, each bucket reaching halfway to the next measured
    count; kept: wins of >= 1.08x over cuBLAS. Llama-3.1-8B's shapes won at most 1.06x, so they stay on cuBLAS)."""
    return {tuned.parse_shape(shape): tuple((int(rows), None if cfg is None else SkinnyGemmConfig(**cfg))
                                            for rows, cfg in buckets)
            for shape, buckets in tuned.load("skinny_gemm", arch).items()}


def tuned_config(m: int, n: int, k: int, arch: str) -> SkinnyGemmConfig | None:
    """The measured winner for an [m, k] x [n, k]^T product on a GPU of `arch` (e.g. "sm90"), or None (cuBLAS)."""
    for rows, cfg in tuned_table(arch).get((n, k), ()):
        if m <= rows:
            return cfg
    return None


@triton.jit
def _tile_product(acc, x_tile, w_tile, W_LEFT: tl.constexpr, UPCAST: tl.constexpr):
    # both operands are K-contiguous tiles; the transposes are layout changes in shared memory, not copies
    if W_LEFT:  # an if / else: the compiler does not stop at a return inside a constexpr if
        acc += mma(w_tile, tl.trans(x_tile), UPCAST)
    else:
        acc += mma(x_tile, tl.trans(w_tile), UPCAST)
    return acc


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PREFETCH: tl.constexpr, W_LEFT: tl.constexpr, HAS_BIAS: tl.constexpr,
                        UPCAST: tl.constexpr, GDC: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the programs reading one weight tile run side by side (L2 reuse)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    # weights are written by no kernel of the step: their first tiles may be in flight before the wait
    if PREFETCH >= 1:
        w0 = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    if PREFETCH >= 2:
        w1 = tl.load(w_rows + (BLOCK_K + offs_k)[None, :], mask=n_mask[:, None] & (BLOCK_K + offs_k < K)[None, :],
                     other=0.0)
    if GDC:  # launched early: x is the kernel before's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if W_LEFT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PREFETCH >= 1:
        x0 = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = _tile_product(acc, x0, w0, W_LEFT, UPCAST)
    if PREFETCH >= 2:
        x1 = tl.load(x_rows + (BLOCK_K + offs_k)[None, :], mask=m_mask[:, None] & (BLOCK_K + offs_k < K)[None, :],
                     other=0.0)
        acc = _tile_product(acc, x1, w1, W_LEFT, UPCAST)
    for k0 in range(PREFETCH * BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = (ks < K)[None, :]
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
        acc = _tile_product(acc, x, w, W_LEFT, UPCAST)
    if W_LEFT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@register("skinny_gemm", "triton")
def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: SkinnyGemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype; M <= MAX_M, x, weight and bias all fp16
    or all bf16. Without `config`: the kernel where tuned_table has a winner for this GPU, shape and row count, else
    cuBLAS (kernels/cublaslt.py). `config` runs the kernel with it (tests, tuning)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} "
                         "(expected x [M, K] and weight [N, K])")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M:
        raise ValueError(f"skinny_gemm: x has {m} rows, at most {MAX_M} (larger batches belong to cuBLAS)")
    if x.dtype != weight.dtype or x.dtype not in _HALF:
        raise ValueError(f"skinny_gemm: x {x.dtype} and weight {weight.dtype} must be one dtype, fp16 or bf16")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"skinny_gemm: bias {tuple(bias.shape)} {bias.dtype} must be [{n}] in {x.dtype}")
    if weight.stride(-1) != 1:
        raise ValueError("skinny_gemm: the weight's K axis must be contiguous")
    cfg = config or (tuned_config(m, n, k, tuned.arch_name(capability(x))) if x.is_cuda else None)
    if cfg is None:  # cuBLAS: with the algorithm measured fastest where cublaslt.LtTables.algos has one
        return cublaslt.linear(x, weight, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        b = bias.contiguous() if bias is not None else y  # never read without HAS_BIAS
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
        _skinny_gemm_kernel[grid](
            x, weight, b, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PREFETCH=cfg.prefetch,
            W_LEFT=cfg.w_left, HAS_BIAS=bias is not None, UPCAST=INTERPRET, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **pdl_kwargs(x))
    return y
