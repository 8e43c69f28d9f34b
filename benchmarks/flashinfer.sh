#!/usr/bin/env bash
# The flashinfer backend on a GPU host, in one command (< 8 minutes on a fresh H100; most of it is flashinfer's
# JIT compile: ~80 s per prefill module, two of them):
#   1. decode attention timed, flashinfer against our Triton kernel, on Llama-8B heads (32 q / 8 kv heads,
#      head_dim 128, bf16, page 16) at batch 1 x 1024 and batch 64 x 1024 tokens: us per call, plus the host
#      cost of flashinfer's per-step plan (first: it compiles only the decode module, ~15 s);
#   2. the GPU tests, tests/test_flashinfer_gpu.py (every flashinfer op against the torch reference, tiny
#      Llama / Qwen3 greedy against the triton backend); they compile the rest (2 x ~80 s of FA3 prefill).
# Prepare: WITH_FLASHINFER=1 bash tools/device_wheels.sh, copy .whl/ with the checkout, then on the GPU host:
#   bash benchmarks/flashinfer.sh
#   TIMING_TIMEOUT_S=90 TESTS_TIMEOUT_S=360 (defaults) bound the two parts.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}"  # JIT cache: writable, local
export TVM_FFI_CACHE_DIR="${TVM_FFI_CACHE_DIR:-/tmp/tvm_ffi_cache}"
mkdir -p "$FLASHINFER_WORKSPACE_BASE" "$TVM_FFI_CACHE_DIR"

if ! "$py" -c "import flashinfer, pydantic" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "== installing .whl/ into /tmp/site" >&2
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "benchmarks/flashinfer.sh: installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="${PYTHONPATH:-$PWD}"
if ! "$py" -c "import flashinfer; print('flashinfer', flashinfer.__version__)"; then
  echo "benchmarks/flashinfer.sh: flashinfer does not import: run WITH_FLASHINFER=1 tools/device_wheels.sh and copy .whl/ here" >&2
  exit 1
fi
"$py" -m pytest --version >/dev/null 2>&1 || { echo "benchmarks/flashinfer.sh: pytest is missing on this host" >&2; exit 1; }

status=0
echo "== decode timing: flashinfer vs triton, Llama-8B heads" >&2
timeout --kill-after=10 "${TIMING_TIMEOUT_S:-90}" "$py" - <<'PY' || status=1
import statistics
import time

import torch

from appliance.kernels import registry
from appliance.kernels.flashinfer import attention as fi_attention

H, HKV, D, PAGE, DT = 32, 8, 128, 16, torch.bfloat16
dev = torch.device("cuda")
fi, tr = registry.get("decode_attention", "flashinfer"), registry.get("decode_attention", "triton")


def inputs(batch: int, kv: int) -> tuple:
    per = -(-kv // PAGE)
    blocks = batch * per + 1
    k = torch.randn(blocks, PAGE, HKV, D, dtype=DT, device=dev)
    v = torch.randn(blocks, PAGE, HKV, D, dtype=DT, device=dev)
    table = (torch.randperm(blocks - 1, device=dev)[: batch * per] + 1).view(batch, per).to(torch.int32)
    lens = torch.full((batch,), kv, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, D, dtype=DT, device=dev)
    return q, k, v, table, lens, D**-0.5


def per_call_us(fn, calls: int = 100, reps: int = 7) -> float:
    """Median over reps of (CUDA-event time of `calls` back-to-back calls) / calls: launch cost included."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def plan_us(args: tuple, reps: int = 20) -> float:
    """Host time of one flashinfer decode plan (the per-step cost every layer then shares), GPU idle before."""
    q, k, _, table, lens, scale = args
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fi_attention._plan_decode(q, k, table, lens, scale)
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


print(f"{'shape':<18} {'flashinfer us':>14} {'triton us':>10} {'fi/triton':>10} {'fi GB/s':>8} {'fi plan us':>11}")
for batch, kv in ((1, 1024), (64, 1024)):
    args = inputs(batch, kv)
    ref = registry.get("decode_attention", "torch")(*args)
    for name, fn in (("flashinfer", fi), ("triton", tr)):
        err = ((fn(*args).float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 2e-2, f"{name} decode b{batch} x {kv}: relative error {err:.3g}"
    t_fi = per_call_us(lambda: fi(*args))
    t_tr = per_call_us(lambda: tr(*args))
    kv_bytes = 2 * batch * kv * HKV * D * 2
    print(f"b{batch} x kv{kv:<10} {t_fi:>14.1f} {t_tr:>10.1f} {t_fi / t_tr:>10.2f} {kv_bytes / t_fi / 1e3:>8.0f} "
          f"{plan_us(args):>11.1f}")
print("us per call: back-to-back eager calls (launch cost included; at batch 1 both are launch-bound); "
      "flashinfer plan: once per step, shared by every layer")
PY
echo "== GPU tests (first use JIT-compiles flashinfer's modules into $FLASHINFER_WORKSPACE_BASE)" >&2
timeout --kill-after=10 "${TESTS_TIMEOUT_S:-360}" "$py" -m pytest -q -p no:cacheprovider --durations=8 \
  -m gpu tests/test_flashinfer_gpu.py || status=1

exit "$status"
