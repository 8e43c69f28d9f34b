"""What the attention kernels share: the matmul wrapper that dodges the CPU interpreter's bf16 dot bug."""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter (3.9, CPU) returns garbage for tl.dot on bf16 operands; there we upcast to fp32 first.
# On the GPU the operands go to the tensor cores as they are.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)
