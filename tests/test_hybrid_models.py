"""Qwen3-Next (Gated DeltaNet + gated full attention + MoE with a shared expert) and Qwen3.5 (dense, MoE): greedy
tokens and logprobs equal transformers' under batching, chunked prefill (prompts longer than one chunk carry the
recurrent state across chunks) and preemption by recompute; the state cache's slots follow the requests (aborts,
preemption) and are counted in the memory plan. CPU, float32, a tiny random-weight model with both layer kinds; on a
GPU, second turns that restore a state snapshot equal the same turns recomputed."""
from __future__ import annotations

import pytest

from appliance import LLM, SamplingParams
from tests.test_models_vs_transformers import NEW, PROMPTS, each_setup_matching, greedy_params

LONG = [list(range(3, 3 + 45)), [9, 8, 7] * 13]  # 45 and 39 tokens: three 16-token chunks


@pytest.fixture(scope="module")
def hybrid_model(make_tiny_model):
    return make_tiny_model("qwen3_next")


@pytest.fixture(scope="module")
def references(hybrid_model, hf_greedy):
    return hf_greedy(hybrid_model, PROMPTS + LONG, NEW)


def test_model_has_both_layer_kinds(hybrid_model):
    llm = LLM(model=str(hybrid_model), dtype="float32", block_size=4)
    model = llm.executor.runner.model
    assert len(model.state_layers()) == 2 and len(model.attention_layers()) == 2
    runner = llm.executor.runner
    assert runner.num_state_slots == llm.config.scheduler.max_num_seqs
    # per slot: 2 layers x (conv 128 ch x 3 + state 4 heads x 16 x 16), float32
    assert runner.state_cache.spec.bytes_per_slot == 2 * (128 * 3 * 4 + 4 * 16 * 16 * 4)
    assert runner.state_cache_bytes == (runner.num_state_slots + 1) * runner.state_cache.spec.bytes_per_slot


def test_greedy_matches_transformers(hybrid_model, references):
    for name, overrides, llm in each_setup_matching(hybrid_model, references[: len(PROMPTS)]):
        engine = llm.engine
        # no state snapshots: the prefix is recomputed rather than reused from KV blocks alone
        assert engine.config.enable_prefix_caching is False
        if name.startswith("preempt"):
            assert engine.stats().num_preemptions > 0, "the tiny cache should have forced preemption"
        again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params())
        assert [o.outputs[0].token_ids for o in again] == [r[0] for r in references[: len(PROMPTS)]]
        assert sum(o.num_cached_tokens for o in again) == 0
        assert engine.stats().num_running == 0
        assert engine.check_accounting().ok


@pytest.mark.parametrize("chunk", [16, 8192])
def test_long_prompts_across_chunks(hybrid_model, references, chunk):
    llm = LLM(model=str(hybrid_model), dtype="float32", block_size=4, chunked_prefill_size=chunk)
    outs = llm.generate([{"prompt_token_ids": p} for p in LONG + PROMPTS[:2]], greedy_params())
    expected = references[len(PROMPTS):] + references[:2]
    for out, (tokens, lps) in zip(outs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)] == pytest.approx(lps, abs=1e-4)


def test_abort_frees_state_slot_and_reused_slot_starts_fresh(hybrid_model, references):
    llm = LLM(model=str(hybrid_model), dtype="float32", block_size=4, chunked_prefill_size=16, max_num_seqs=2)
    engine, runner = llm.engine, llm.executor.runner
    engine.add_request("a", LONG[0], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    engine.add_request("b", LONG[1], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    for _ in range(4):  # 16-token steps: "a" prefills, then "b" starts; both slots hold partial states
        engine.step()
        if runner.block_table.num_free == 0:
            break
    assert runner.block_table.num_free == 0 and engine.stats().num_running == 2
    assert engine.abort("a") and engine.abort("b")
    # the next requests take the two freed slots (a leaked slot would leave none): a stale state would show
    outs = llm.generate([{"prompt_token_ids": p} for p in (PROMPTS[2], LONG[0])], greedy_params())
    assert [o.outputs[0].token_ids for o in outs] == [references[2][0], references[len(PROMPTS)][0]]
    # workers drop finished requests when the next plan names them: live + free slots are all the slots
    assert runner.block_table.num_free + len(runner.requests) == 2
    assert engine.check_accounting().ok


def test_prefix_hit_restores_a_state_snapshot(hybrid_model, hf_greedy):
    """Checkpoints every 8 tokens: the second turn's prompt shares 43 tokens with the first, so the KV hit of 40
    tokens (10 blocks) comes with the snapshot taken at 40, and the output equals transformers' cold run. With
    one snapshot slot, a prompt sharing 20 tokens finds no snapshot at 16 (overwritten) and is recomputed."""
    first = LONG[0]
    second = first[:43] + [200, 201, 202, 203, 204]
    third = first[:20] + [300, 301, 302]
    refs = hf_greedy(hybrid_model, [first, second, third], NEW)
    for slots in (64, 1):
        llm = LLM(model=str(hybrid_model), dtype="float32", block_size=4, chunked_prefill_size=16,
                  enable_prefix_caching=True, ssm_checkpoint_interval=8, ssm_cache_slots=slots)
        snaps = llm.engine.scheduler.snapshots
        outs = [llm.generate([{"prompt_token_ids": p}], greedy_params())[0] for p in (first, second, third)]
        assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]
        assert [o.num_cached_tokens for o in outs] == [0, 40, 0 if slots == 1 else 16]
        assert snaps.num_restored == (1 if slots == 1 else 2)
        # one snapshot per chunk, at its last checkpoint: 16, 32, 40 (a 16-token chunk cut at 40) of the first
        # prompt, 48 of the second; the third adds none
        assert len(snaps) == (1 if slots == 1 else 4)
        assert llm.engine.check_accounting().ok


@pytest.mark.gpu
def test_snapshot_turns_equal_recomputed_turns_on_gpu(hybrid_model):
    """On a GPU (fla's kernels where installed: one upload of a step's offsets, slots and fresh flags for every
    layer): second turns that restore a snapshot and prefill the rest in 64-token chunks make the greedy tokens of
    the same turns recomputed from the start without prefix caching (the same chunk boundaries, so the same sums)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    firsts = [list(range(3, 3 + 150)) * 2, [7, 8, 9, 10] * 70]  # 300 and 280 tokens
    tails = [[200 + i for i in range(30)], [250 + i for i in range(20)]]
    runs = []
    for snapshots in (False, True):
        extra = {"enable_prefix_caching": True, "ssm_checkpoint_interval": 64} if snapshots else {}
        llm = LLM(model=str(hybrid_model), dtype="bfloat16", block_size=16, chunked_prefill_size=64,
                  max_total_tokens=8192, skip_tokenizer_init=True, **extra)
        turns = []
        for first, tail in zip(firsts, tails):  # one session at a time, as the benchmark runs them
            out = llm.generate([{"prompt_token_ids": first}], greedy_params())[0]
            again = llm.generate([{"prompt_token_ids": first + out.outputs[0].token_ids + tail}], greedy_params())[0]
            turns.append((out.outputs[0].token_ids, again.outputs[0].token_ids, again.num_cached_tokens))
        runs.append(turns)
        del llm
    plain, snap = runs
    assert [t[:2] for t in snap] == [t[:2] for t in plain]
    assert [t[2] for t in plain] == [0, 0] and [t[2] for t in snap] == [256, 256]  # the last checkpoint: 256


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_text_models_match_transformers(arch, make_tiny_model, hf_greedy):
    """Qwen3.5 dense and MoE (separate linear-attention projections): batching, 16-token chunks, preemption."""
    path = make_tiny_model(arch)
    refs = hf_greedy(path, PROMPTS, NEW)
    for name, _, llm in each_setup_matching(path, refs):
        if name.startswith("preempt"):
            assert llm.engine.stats().num_preemptions > 0
        assert llm.engine.check_accounting().ok


TRITON_TURNS = """
import json
from appliance import LLM, SamplingParams
path, first, second = MODEL_PATH, list(range(3, 48)), list(range(3, 46)) + [200, 201, 202, 203, 204]
greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
for backend in ("torch", "triton"):
    llm = LLM(model=path, dtype="float32", block_size=4, chunked_prefill_size=16, attention_backend=backend,
              enable_prefix_caching=True, ssm_checkpoint_interval=8)
    runner = llm.executor.runner
    layer = runner.model.state_layers()[0]
    outs = [llm.generate([{"prompt_token_ids": p}], greedy)[0] for p in (first, second)]
    print(json.dumps({"case": backend, "tokens": [o.outputs[0].token_ids for o in outs],
                      "cached": [o.num_cached_tokens for o in outs],
                      "ops": [getattr(f, "__module__", "") for f in (layer._conv, layer._gates, layer.norm._op)]}))
"""


def test_triton_ops_give_the_torch_tokens_interpreted(hybrid_model):
    """The hybrid model's Triton path on the CPU (TRITON_INTERPRET=1: the Gated DeltaNet's convolution, gates and
    gated norm, the MoE's expert sort and GEMMs, the attention kernels; the gated delta rule itself stays the torch
    reference without fla) gives the torch path's greedy tokens, over chunked prefill and a second turn that
    restores a state snapshot."""
    from selfcheck_runner import interpreted_script_rows

    code = TRITON_TURNS.replace("MODEL_PATH", repr(str(hybrid_model)))
    rows = {r["case"]: r for r in interpreted_script_rows(code, timeout=600)}
    assert rows["triton"]["tokens"] == rows["torch"]["tokens"]
    assert rows["triton"]["cached"] == rows["torch"]["cached"] == [0, 40]
    assert all(m.startswith("appliance.kernels.triton") for m in rows["triton"]["ops"]), rows["triton"]["ops"]
    assert not any(m.startswith("appliance.kernels.triton") for m in rows["torch"]["ops"])
