"""Multi-head latent attention over a paged latent cache (DeepSeek-V2/V3); importing registers the ops.

The cache holds one row per token: the normalized compressed KV (kv_lora_rank values) followed by the
rotated shared key (qk_rope_head_dim values), laid out [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
so it is an ordinary one-head paged cache.

    mla_store(latent[N, R+dr], cache, slot_mapping[N] int64) -> None          (slot -1: skip)
    mla_decode(q[B, H, R+dr], cache, block_tables, seq_lens, scale, kv_lora_rank) -> [B, H, R]
        absorbed queries (q_nope @ W_UK, then q_pe) against the latents; the result is still in latent
        space (the caller applies W_UV)
    mla_prefill(q[T, H, dn+dr], cache, cu_seqlens_q, seq_lens, block_tables, w_uk[H, dn, R], w_uv[H, dv, R],
                scale) -> [T, H, dv]
        the plain path: latents of the whole context (cached prefix included) expanded to per-head keys and
        values, causal attention as in prefill_attention
"""
from __future__ import annotations

from appliance.kernels.mla import reference  # noqa: F401  (registers "torch")

try:  # the Triton kernels need only `triton` to import; they run on a GPU or under TRITON_INTERPRET=1
    from appliance.kernels.mla import triton_mla, triton_prefill
except ImportError:  # pragma: no cover - triton missing: the torch reference still serves
    triton_mla = triton_prefill = None  # type: ignore[assignment]
