"""cuBLASLt with a chosen algorithm, for the decode GEMMs where cuBLAS's own pick measured slower.

F.linear asks cuBLAS for y = x W^T and cuBLAS picks its kernel (tile, pipeline stages, thread-block cluster)
with a heuristic. At the odd row counts a decode step runs (a capture size such as 216 rows), the pick is not
the fastest: on the H100, Llama-3.1-8B's down_proj at 216 rows ran 62.5 us with cuBLAS's pick and 52.5 with
another of the library's own kernels, o_proj 19.9 against 16.5 (tools/lab_cublaslt.py, docs/kernels.md
"cuBLASLt algorithms"). This module calls the same library through its cuBLASLt interface with the algorithm
that won (`LtTables.algos`, a measured table per GPU architecture, weight shape and row count: the data files
kernels/tuned/<arch>_cublaslt_*.json) and leaves every other call to F.linear.

Why ctypes rather than an extension: torch already maps libcublasLt into the process (F.linear runs on it), so
calling it needs no build step and no second copy of the library; the handful of calls below are the whole
interface. The algorithms are stored as their configuration ids (tile, stages, cluster shape ...) and rebuilt
with cublasLtMatmulAlgoInit + ConfigSetAttribute, then cublasLtMatmulAlgoCheck must accept them for the problem
and ask for no workspace (so that no two streams can share one); anything else falls back to F.linear, once
logged. Only a GPU whose architecture has tables (sm_90), bf16, 2-D inputs with contiguous rows and no bias take it.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from appliance.kernels import tuned
from appliance.kernels.capability import capability

log = logging.getLogger(__name__)

COMPUTE_32F, R_32F, R_16BF, OP_N, OP_T = 68, 0, 14, 0, 1  # cublasComputeType_t, cudaDataType_t, cublasOperation_t
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 3, 4, 1
# cublasLtMatmulAlgoConfigAttributes_t ids and the byte width of each value
CONFIG_ATTRS = {"algo_id": (0, 4), "tile": (1, 4), "splitk": (2, 4), "reduction": (3, 4), "swizzle": (4, 4),
                "custom": (5, 4), "stages": (6, 4), "inner": (7, 2), "cluster": (8, 2)}


@dataclass(frozen=True)
class LtAlgo:
    """One cuBLASLt algorithm as its configuration ids (cublasLtMatmulTile_t, cublasLtMatmulStages_t, ...)."""
    tile: int
    stages: int
    cluster: int
    custom: int = 0
    swizzle: int = 0
    splitk: int = 1
    reduction: int = 0
    inner: int = 0
    algo_id: int = 66


@dataclass(frozen=True)
class LtTables:
    """One architecture's measured tables (kernels/tuned/<arch>_cublaslt_algos.json, <arch>_cublaslt_padded.json).

    algos: (N, K) of the weight -> {rows: the algorithm that beat cuBLAS's pick there}; a row count not listed goes
    to F.linear. Rows are exact: a decode graph replays at its capture size. padded: (N, K) -> {rows: the larger
    row count cuBLAS's own pick runs faster at}: at some row counts the library's heuristic picks a kernel far
    slower than the one it picks a few rows later (Llama-3.1-8B's gate_up: 293 us at 448 rows, 162 at 512); a call
    there runs on zero-padded input and keeps its own rows."""
    algos: dict[tuple[int, int], dict[int, LtAlgo]]
    padded: dict[tuple[int, int], dict[int, int]]


@functools.cache
def tables(arch: str) -> LtTables:
    """The tables measured on `arch` (e.g. "sm90"); empty where nothing was measured."""
    algos = {tuned.parse_shape(shape): {int(rows): LtAlgo(**{k: v for k, v in e.items() if k != "speedup"})
                                        for rows, e in by_rows.items()}
             for shape, by_rows in tuned.load("cublaslt_algos", arch).items()}
    padded = {tuned.parse_shape(shape): {int(rows): int(to) for rows, to in by_rows.items()}
              for shape, by_rows in tuned.load("cublaslt_padded", arch).items()}
    return LtTables(algos, padded)


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t: opaque


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # cublasLtMatmulHeuristicResult_t


class LtError(RuntimeError):
    pass


def _library() -> ctypes.CDLL:
    """The libcublasLt torch has mapped (initialising cuBLAS first), so both use one library version."""
    torch.cuda.current_blas_handle()
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            if "libcublasLt.so" in line:
                return ctypes.CDLL(line.split()[-1])
    return ctypes.CDLL("libcublasLt.so")


class Problem:
    """y[m, n] = x[m, k] W[n, k]^T in cuBLASLt's column-major terms: D[n, m] = op(W)[n, k] x[k, m] with W
    transposed, as torch itself calls it. Holds the descriptor and the A, B, C(=D) layouts."""

    def __init__(self, lt: Lt, m: int, n: int, k: int) -> None:
        self.m, self.n, self.k = m, n, k
        self.desc = ctypes.c_void_p()
        lt.ok(lt.lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "MatmulDescCreate")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(op)
            lt.ok(lt.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "DescSetAttribute")
        self.layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):
            lay = ctypes.c_void_p()
            lt.ok(lt.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), R_16BF, ctypes.c_uint64(rows),
                                                    ctypes.c_uint64(cols), ctypes.c_int64(ld)), "LayoutCreate")
            self.layouts.append(lay)


class Lt:
    """One cuBLASLt handle and the calls the op and tools/lab_cublaslt.py need; every status is checked."""

    def __init__(self) -> None:
        self.lib = _library()
        self.handle = ctypes.c_void_p()
        self.ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "Create")

    @staticmethod
    def ok(status: int, what: str) -> None:
        if status != 0:
            raise LtError(f"cublasLt{what} returned status {status}")

    def candidates(self, p: Problem, count: int, workspace: int = 0) -> list[Heuristic]:
        """The library's heuristic's best `count` algorithms for the problem that need at most `workspace` bytes."""
        pref = ctypes.c_void_p()
        self.ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        ws = ctypes.c_uint64(workspace)
        self.ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8),
                "MatmulPreferenceSetAttribute")
        out, got = (Heuristic * count)(), ctypes.c_int(0)
        a, b, c = p.layouts
        self.ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, p.desc, a, b, c, c, pref, count, out,
                                                        ctypes.byref(got)), "MatmulAlgoGetHeuristic")
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [out[i] for i in range(got.value) if out[i].state == 0]

    def describe(self, algo: Algo) -> LtAlgo:
        values = {}
        for name, (attr, size) in CONFIG_ATTRS.items():
            v, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
            self.ok(self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), size,
                                                                  ctypes.byref(written)), f"AlgoConfigGet {name}")
            values[name] = int(v.value)
        return LtAlgo(**values)

    def build(self, spec: LtAlgo) -> Algo:
        """The algorithm with `spec`'s configuration (AlgoInit, then every id set)."""
        algo = Algo()
        self.ok(self.lib.cublasLtMatmulAlgoInit(self.handle, COMPUTE_32F, R_32F, R_16BF, R_16BF, R_16BF, R_16BF,
                                                spec.algo_id, ctypes.byref(algo)), "MatmulAlgoInit")
        for f in fields(LtAlgo):
            if f.name == "algo_id":
                continue
            attr, size = CONFIG_ATTRS[f.name]
            v = (ctypes.c_uint16 if size == 2 else ctypes.c_uint32)(getattr(spec, f.name))
            self.ok(self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), size),
                    f"AlgoConfigSet {f.name}")
        return algo

    def workspace(self, p: Problem, algo: Algo) -> int | None:
        """Workspace bytes `algo` needs for the problem; None when it cannot run it."""
        out = Heuristic()
        a, b, c = p.layouts
        st = self.lib.cublasLtMatmulAlgoCheck(self.handle, p.desc, a, b, c, c, ctypes.byref(algo), ctypes.byref(out))
        return int(out.workspace) if st == 0 else None

    def matmul(self, p: Problem, algo: Algo, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
               workspace: torch.Tensor | None = None) -> None:
        """y = x w^T on the current stream (capturable: it only launches kernels); `workspace`: a uint8 buffer
        the algorithm may use (tools only: the op passes none)."""
        ws_ptr = ctypes.c_void_p(workspace.data_ptr() if workspace is not None else None)
        ws_len = ctypes.c_size_t(workspace.numel() if workspace is not None else 0)
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        a, b, c = p.layouts
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        self.ok(self.lib.cublasLtMatmul(
            self.handle, p.desc, ctypes.byref(one), ctypes.c_void_p(w.data_ptr()), a, ctypes.c_void_p(x.data_ptr()),
            b, ctypes.byref(zero), ctypes.c_void_p(y.data_ptr()), c, ctypes.c_void_p(y.data_ptr()), c,
            ctypes.byref(algo), ws_ptr, ws_len, stream), "Matmul")


_LT: dict[int, Lt] = {}  # device index -> handle
_READY: dict[tuple[int, int, int, int], tuple[Problem, Algo] | None] = {}  # (device, m, n, k) -> built, or refused


def handle(device: torch.device) -> Lt:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _LT:
        with torch.cuda.device(index):
            _LT[index] = Lt()
    return _LT[index]


def _prepare(x: torch.Tensor, n: int, k: int, spec: LtAlgo) -> tuple[Problem, Algo] | None:
    m = x.shape[0]
    key = (x.device.index or 0, m, n, k)
    if key not in _READY:
        try:
            lt = handle(x.device)
            p = Problem(lt, m, n, k)
            algo = lt.build(spec)
            need = lt.workspace(p, algo)
            if need != 0:
                raise LtError(f"cublasLtMatmulAlgoCheck: {'refused' if need is None else f'{need} B of workspace'}")
            _READY[key] = (p, algo)
        except (LtError, OSError, AttributeError) as e:  # no library, symbol or algorithm: cuBLAS's own pick
            log.warning("cuBLASLt algorithm %s for [%d, %d] x [%d, %d]^T not usable (%s); using F.linear",
                        spec, m, k, n, k, e)
            _READY[key] = None
    return _READY[key]


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> LtTables | None:
    """The tables of x's GPU for the calls they were measured for (bf16, no bias, plain row-major 2-D operands),
    or None."""
    if not (x.is_cuda and bias is None and x.dtype == torch.bfloat16 == weight.dtype
            and x.dim() == 2 == weight.dim() and x.is_contiguous() and weight.is_contiguous()):
        return None
    return tables(tuned.arch_name(capability(x)))


def tuned_algo(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> LtAlgo | None:
    """The measured algorithm for this call, or None: an eligible call whose (shape, rows) pair is tabled."""
    t = _eligible(x, weight, bias)
    return None if t is None else t.algos.get((weight.shape[0], weight.shape[1]), {}).get(x.shape[0])


def padded_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    """The row count to run this call at instead (LtTables.padded), or None."""
    t = _eligible(x, weight, bias)
    return None if t is None else t.padded.get((weight.shape[0], weight.shape[1]), {}).get(x.shape[0])


def padded_linear(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """x W^T computed for x and rows - len(x) zero rows after it (rows of a GEMM are independent), cut back."""
    return unpadded_linear(torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0])), weight)[: x.shape[0]]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b): padded to the row count the padded table gives for this call, with the cuBLASLt algorithm
    the algos table gives, else F.linear."""
    rows = padded_rows(x, weight, bias)  # (the two tables hold different row counts: tests/test_cublaslt.py)
    if rows is not None:
        return padded_linear(x, weight, rows)
    return unpadded_linear(x, weight, bias)


def unpadded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) at x's own row count: the tabled cuBLASLt algorithm, else F.linear."""
    spec = tuned_algo(x, weight, bias)
    ready = _prepare(x, weight.shape[0], weight.shape[1], spec) if spec is not None else None
    if ready is None:
        return torch.nn.functional.linear(x, weight, bias)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    handle(x.device).matmul(ready[0], ready[1], x, weight, y)
    return y
