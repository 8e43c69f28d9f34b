"""The offline LLM API: input forms, fan-out, seeds, stops, logprobs, config paths and errors."""
from __future__ import annotations

import pytest
import torch

from appliance import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), dtype="float32", block_size=4, max_total_tokens=4096)


def test_prompt_forms_and_shapes(llm):
    tok = llm.get_tokenizer()
    ids = tok("Hello world").input_ids
    outs = llm.generate(["Hello world", ids, {"prompt_token_ids": ids}], GREEDY)
    assert [o.prompt for o in outs] == ["Hello world", None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    first = outs[0].outputs[0]
    assert len(first.token_ids) == 8 and first.finish_reason == "length" and first.stop_reason is None
    assert first.text == tok.decode(first.token_ids, skip_special_tokens=True)
    single = llm.generate(ids, GREEDY)  # one token-id list is one prompt
    assert len(single) == 1 and single[0].outputs[0].token_ids == first.token_ids
    assert len(llm.generate({"prompt": "Hello world"}, GREEDY)) == 1


def test_per_prompt_params(llm):
    outs = llm.generate([[5, 6], [7, 8]], [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate([[5], [6]], [GREEDY])


def test_n_fans_out_and_seeds_reproduce(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=11, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], sp)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # samples differ
    # same seed, different company in the batch: identical samples
    b = llm.generate([[9] * 20, [5, 6, 7], [1, 2]], [SamplingParams(temperature=0.7, max_tokens=4), sp,
                                                     SamplingParams(temperature=1.0, max_tokens=9)])[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_stop_token_ids(llm):
    ref = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    target = ref.token_ids[3]
    first = ref.token_ids.index(target)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_stop_string(llm):
    prompt = llm.get_tokenizer()("The quick").input_ids
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    printable = [i for i in range(1, len(ref.text) - 1) if ref.text[i : i + 2].isprintable()]
    assert printable, f"reference text too short to pick a stop string from: {ref.text!r}"
    stop = ref.text[printable[len(printable) // 2] :][:2]
    cut = ref.text.find(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[:cut]
    assert out.token_ids == ref.token_ids[: len(out.token_ids)] and len(out.token_ids) <= len(ref.token_ids)
    assert llm.engine.check_accounting().ok  # the aborted request gave its blocks back


def test_logprobs_and_prompt_logprobs_match_transformers(llm, tiny_model):
    from transformers import AutoModelForCausalLM

    prompt = list(range(10, 40))  # 30 tokens: several prefill chunks with chunked_prefill_size 16 below
    small = LLM(model=str(tiny_model), dtype="float32", block_size=4, chunked_prefill_size=16,
                max_total_tokens=1024)
    out = small.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=4, prompt_logprobs=2,
                                                  ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    with torch.no_grad():
        full = torch.log_softmax(hf(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].float(), -1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(full[pos - 1, prompt[pos]].item(), abs=1e-4)
        top = full[pos - 1].topk(2)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4) and entry[t].rank == rank
    gen = out.outputs[0]
    assert len(gen.logprobs) == 3
    for i, (tok_id, entry) in enumerate(zip(gen.token_ids, gen.logprobs)):
        row = full[len(prompt) - 1 + i]
        assert entry[tok_id].logprob == pytest.approx(row[tok_id].item(), abs=1e-4)
        assert entry[tok_id].rank == 1  # greedy picks the raw argmax
        assert len(entry) == 4 and set(row.topk(4).indices.tolist()) == set(entry)
        assert entry[tok_id].decoded_token == small.get_tokenizer().decode([tok_id])


def test_skip_tokenizer_init(tiny_model):
    llm = LLM(model=str(tiny_model), dtype="float32", skip_tokenizer_init=True, max_total_tokens=512)
    out = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text", GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([[5]], SamplingParams(stop=["x"]))


def test_config_object_and_conflicts(tiny_model):
    from appliance.config import build_config

    cfg = build_config(flat={"model": str(tiny_model), "dtype": "float32", "max_total_tokens": 512}, env={})
    llm = LLM(config=cfg)
    assert llm.generate([[5, 6]], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="either"):
        LLM(model=str(tiny_model), config=cfg)


def test_bad_prompts(llm):
    with pytest.raises(TypeError):
        llm.generate([1.5], GREEDY)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        llm.generate([], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"text": "x"}, GREEDY)


def test_eos_stops_unless_ignored_and_min_tokens_masks_it(tiny_model):
    free = LLM(model=str(tiny_model), dtype="float32", max_total_tokens=512)
    ref = free.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    eos = ref.token_ids[2]
    first = ref.token_ids.index(eos)
    llm = LLM(model=str(tiny_model), dtype="float32", max_total_tokens=512, hf_overrides={"eos_token_id": eos})
    assert eos in llm.executor.eos_token_ids
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and len(out.token_ids) == first + 1
    ignored = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == ref.token_ids and ignored.finish_reason == "length"
    held = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, min_tokens=first + 2))[0].outputs[0]
    assert eos not in held.token_ids[: first + 2] and held.token_ids[:first] == ref.token_ids[:first]


def test_failed_generate_leaves_the_engine_clean(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5, 6], [7] * 10_000], GREEDY)  # the second prompt is too long for the model
    assert not llm.engine.has_work() and llm.engine.check_accounting().ok
    assert llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_repetition_penalty_matches_transformers(llm, tiny_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    prompt = [5, 6, 7, 5, 6, 7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, repetition_penalty=1.8,
                          eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
    plain = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                 repetition_penalty=1.8))[0].outputs[0].token_ids
    assert ours == ref
    assert ours != plain  # the penalty changed something, so the comparison means something


def test_a_setting_this_build_cannot_honour_is_refused_at_start(tiny_model):
    # the offline API applies the same gate as `appliance run`: accepted-but-ignored settings are defects
    with pytest.raises(ValueError, match=r"scheduler\.policy.*chunked prefill"):
        LLM(model=str(tiny_model), dtype="float32", scheduling_policy="slo", chunked_prefill_size=-1)
