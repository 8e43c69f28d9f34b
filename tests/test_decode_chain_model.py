"""The Llama family through the fused decode chain (layers/decode_chain.py): greedy tokens and logprobs equal
transformers' under batching, chunked prefill, prefix caching and preemption, with every batch of up to 16 rows
taking the chain (CPU, float32, the chain's torch reference ops; the Triton kernels are checked against those in
tests/test_decode_chain.py). Also which models the chain serves, and the runner turning it on by itself on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from appliance import LLM
from appliance.kernels.registry import get
from appliance.layers import decode_chain
from test_models_vs_transformers import PROMPTS, each_setup_matching, greedy_references

# head_dim 64: the chain's rotary epilogue serves heads whose half is a multiple of 32 (kernels/reference/gemv_chain)
ARCHS = {"llama": {"head_dim": 64}, "llama3": {"head_dim": 64}, "mistral": {"head_dim": 64},
         "qwen2": {"head_dim": 64}}


def bind_chain(llm: LLM, calls: list[int]) -> None:
    """Bind the torch GEMV (what the runner binds on a GPU is the Triton one) so the layers qualify, turn the
    chain on, and count the forwards it serves."""
    model = llm.executor.runner.model
    for module in model.modules():
        if hasattr(module, "gemv"):
            module.gemv = get("gemv", "torch")
    assert model.model.use_decode_chain("torch"), decode_chain.unserved_reason(model.model, "torch")
    chain = model.model.chain
    forward = chain.forward

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return forward(*args, **kwargs)

    chain.forward = counted


@pytest.mark.parametrize("arch", list(ARCHS))
def test_chain_greedy_matches_transformers(arch, make_tiny_model, hf_greedy):
    path = make_tiny_model(arch, **ARCHS[arch])
    refs = greedy_references([arch], lambda _arch: path, hf_greedy)[arch]
    calls: list[int] = []
    for _name, _overrides, llm in each_setup_matching(path, refs, prepare=lambda llm: bind_chain(llm, calls)):
        assert llm.engine.check_accounting().ok
    assert calls and max(calls) <= 16, "the chain served no forward"
    assert len(set(calls)) > 1  # decode batches of several sizes (and short prefill chunks)


def test_chain_is_off_where_a_layer_is_not_served(make_tiny_model):
    cases = [("qwen3", {}, "q/k norm"), ("llama", {}, "attention prologue"),  # head_dim 16: half not a multiple of 32
             ("llama", {"head_dim": 64, "mlp_bias": True}, "bias")]
    for arch, overrides, reason in cases:
        llm = LLM(model=str(make_tiny_model(arch, **overrides)), dtype="float32", block_size=4)
        model = llm.executor.runner.model
        for module in model.modules():
            if hasattr(module, "gemv"):
                module.gemv = get("gemv", "torch")
        assert reason in (decode_chain.unserved_reason(model.model, "torch") or ""), arch
        assert not model.model.use_decode_chain("torch") and model.model.chain is None
    # served layers, but nothing bound (the CPU default): the chain stays off
    llm = LLM(model=str(make_tiny_model("llama", head_dim=64)), dtype="float32", block_size=4)
    assert "without a bound GEMV" in decode_chain.unserved_reason(llm.executor.runner.model.model, "torch")
    assert llm.executor.runner.model.model.chain is None


def test_chain_serves_only_small_batches():
    assert decode_chain.DecodeChain.serves(torch.zeros(16, 8))
    assert not decode_chain.DecodeChain.serves(torch.zeros(17, 8))
    assert not decode_chain.DecodeChain.serves(torch.zeros(0, 8))


def test_backends_decode_chain_decides_whether_the_runner_builds_it(make_tiny_model):
    """bind_decode_kernels (what the runner calls on a GPU) with backends.decode_chain on builds the chain for served
    layers, off leaves none; the setting reaches the runner from the config."""
    from appliance.executor.runner_setup import bind_decode_kernels

    llm = LLM(model=str(make_tiny_model("llama", head_dim=64)), dtype="float32", block_size=4, decode_chain=False)
    runner = llm.executor.runner
    assert runner.config.backends.decode_chain is False
    model = runner.model
    for module in model.modules():
        if hasattr(module, "gemv"):
            module.gemv = get("gemv", "torch")
    bind_decode_kernels(model, "torch", runner.config.backends.decode_chain)
    assert model.model.chain is None
    bind_decode_kernels(model, "torch", True)
    assert model.model.chain is not None
    bind_decode_kernels(model, "torch", False)
    assert model.model.chain is None


def divergence_at_near_ties(on: list, off: list, tol: float) -> list[str]:
    """Two greedy runs' outputs (logprobs >= 2): where the first differs from the second, both runs' chosen
    tokens must be within `tol` of each other in the first run's logprobs (a near tie that rounding may flip);
    before that, the chosen logprobs must agree to `tol`. Returns the violations."""
    bad = []
    for a, b in zip(on, off):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            la, lb = a.logprobs[i], b.logprobs[i]
            if ta != tb:
                if tb not in la or abs(la[ta].logprob - la[tb].logprob) > tol:
                    bad.append(f"step {i}: {ta} vs {tb}, not a near tie ({la})")
                break
            if abs(la[ta].logprob - lb[tb].logprob) > tol:
                bad.append(f"step {i}: logprob {la[ta].logprob} vs {lb[tb].logprob}")
    return bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [8192, 16], ids=["decode_graphs", "piecewise_chunks_of_16"])
def test_gpu_runner_turns_the_chain_on_and_it_matches_the_layers(make_tiny_model, chunk: int):
    """bf16 with the Triton backend: the runner builds the chain, and decode graphs replay it (and, with 16-token
    chunks, the piecewise graphs of the mixed steps); greedy runs with and without it agree up to bf16 rounding
    (logprobs close; a token differs only at a near tie)."""
    from appliance import SamplingParams

    path = make_tiny_model("llama3", hidden_size=256, intermediate_size=512, head_dim=128)
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
              attention_backend="triton", chunked_prefill_size=chunk)
    runner = llm.executor.runner
    inner = runner.model.model
    assert inner.chain is not None and (chunk > 16 or runner.pieces is not None)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    on = [o.outputs[0] for o in llm.generate(prompts, params)]
    chain, inner.chain = inner.chain, None
    runner.graphs, runner.pieces = runner._make_graphs(), runner._make_pieces()  # recaptured without the chain
    off = [o.outputs[0] for o in llm.generate(prompts, params)]
    inner.chain = chain
    assert not divergence_at_near_ties(on, off, 0.1)  # bf16 logprobs near -3: an ulp is 0.016


def test_calibration_window_bypasses_the_chain(make_tiny_model):
    """Online fp8 KV calibration observes each layer's stores; the chain stores K/V itself, so while the window is
    open the rows it would serve (16-token prefill chunks included) take the layers, and it serves again after."""
    from test_fp8_kv_cache import SEQS, _prompt_logprobs

    path = make_tiny_model("llama3", head_dim=64)
    llm = LLM(model=str(path), dtype="float32", block_size=16, chunked_prefill_size=16, skip_tokenizer_init=True,
              kv_cache_dtype="fp8", kv_cache_calibration_tokens=40)
    calls: list[int] = []
    bind_chain(llm, calls)
    cal = llm.executor.runner.kv_calibration
    assert cal is not None and not cal.done
    _prompt_logprobs(llm)
    assert cal.done, [s.remaining for s in cal.state.values()]
    assert sum(map(len, SEQS)) > 40 and calls  # the chain served the decodes and chunks after the window
