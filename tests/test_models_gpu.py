"""GPU path of the model runner: memory profiling sizes the KV cache, and greedy decoding matches transformers."""
from __future__ import annotations

import pytest
import torch

from appliance import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [3] * 17]


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_gpu_greedy_matches_transformers(arch, make_tiny_model, hf_greedy):
    path = make_tiny_model(arch)
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.3, attention_backend="torch",
              chunked_prefill_size=16)
    runner = llm.executor.runner
    assert runner.kv_caches[0][0].is_cuda
    # profiling left ~30% of the card to the cache: far more blocks than the CPU default would give
    free_bytes = torch.cuda.get_device_properties(0).total_memory * 0.3
    assert runner.num_blocks > 0.5 * free_bytes / runner.kv_spec.bytes_per_block
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    refs = hf_greedy(path, PROMPTS, 8)  # on the CPU: the oracle
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]


def test_gpu_seeded_sampling_matches_cpu(make_tiny_model):
    path = make_tiny_model("llama")
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    gpu = LLM(model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.3, attention_backend="torch")
    cpu = LLM(model=str(path), device="cpu", dtype="float32", max_total_tokens=512)
    a = gpu.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids
    b = cpu.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids
    assert a == b


def test_gpu_gemv_decode_matches_cublas(make_tiny_model):
    """bf16 on the GPU: the runner binds the Triton GEMV to every linear layer, and a decode-sized forward gives
    the logits of the same forward through cuBLAS (unbound) to bf16 accuracy."""
    path = make_tiny_model("llama", hidden_size=256, intermediate_size=512)
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
              attention_backend="triton", enforce_eager=True)
    model = llm.executor.runner.model
    bound = [m for m in model.modules() if getattr(m, "gemv", None) is not None]
    assert len(bound) >= 4 * 2 + 1  # qkv, o, gate_up, down per layer + lm_head
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fast = [m(x) if m.weight.shape[-1] == 256 else None for m in bound]
        for m in bound:
            m.gemv = None
        slow = [m(x) if m.weight.shape[-1] == 256 else None for m in bound]
    pairs = [(a.float(), b.float()) for a, b in zip(fast, slow) if a is not None]
    assert pairs
    for a, b in pairs:
        assert ((a - b).norm() / b.norm()).item() < 1e-2
