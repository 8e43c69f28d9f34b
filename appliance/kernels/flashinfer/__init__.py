"""The optional flashinfer kernel backend (`backends.attention = "flashinfer"`; never picked by `auto`).

flashinfer provides: store_kv (its paged-KV append), decode_attention and prefill_attention (its paged wrappers,
planned once per step on the host: plans.py), rms_norm (with the fused residual add) and silu_and_mul. The
registry's fallback order (kernels/registry.py FALLBACK) takes rope and gemv from the Triton kernels, so the rest of
a Llama step runs as it does with backends.attention = "triton"; without triton, from torch. sample is not provided: flashinfer's samplers draw from their own Philox streams, which cannot
reproduce the per-request (seed, step) uniforms that the torch and Triton samplers share bit for bit
(executor/batch_sampler.py keeps using the Triton sampler on a GPU).

Importing this package imports flashinfer; when that fails the ImportError says which package is missing, and
runner_setup.resolve_backend turns it into a start-up error naming backends.attention.
"""
from __future__ import annotations

TESTED_WITH = "flashinfer-python==0.6.14 with apache-tvm-ffi==0.1.15.post2"

try:
    import flashinfer  # noqa: F401
except Exception as exc:  # ImportError, or a broken install failing inside its own imports
    raise ImportError(f"the flashinfer kernel backend needs the flashinfer-python package (tested: {TESTED_WITH}); "
                      f"`import flashinfer` failed: {type(exc).__name__}: {exc}") from exc

from appliance.kernels.flashinfer import attention, elementwise  # noqa: F401  (register on import)
