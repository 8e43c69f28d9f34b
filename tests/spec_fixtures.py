"""What the speculative-decoding tests share (a plain module they import, fixtures included): the tiny Llama's
prompts, LLM builders and greedy reference with its drafters (tests/spec_heads.py); the tiny DeepSeek-V3 with one
MTP layer, its reference and the oracle that forces its drafts; and for stop strings, the count of tokens fed one
by one, outputs of several tokens each and a case on tiny_v3. A fixture applies in a test module that imports it,
with the fixtures it takes (tiny_v3 for mtp_reference and tiny_v3_tok); one_thread applies to every test there."""
from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_VOCAB
from spec_heads import append_mtp_layer, build_eagle3_head, build_eagle_head
from test_moe_models import one_thread  # noqa: F401  (autouse where a test module takes it)

from appliance import LLM, SamplingParams
from appliance.engine.delta import RequestDelta
from appliance.engine.step import StepResult
from appliance.executor.speculative_mtp import MtpSpeculator
from appliance.server.engine_client import RequestOutput
from appliance.tokenization import Detokenizer

# ---- the tiny Llama (conftest's tiny_model) and its drafters ---------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
           list(range(40, 60)) + list(range(40, 50)), [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 50, 51]]
NEW = 16
# (algorithm, drafters key or None): every drafter this build has, besides MTP (tests/test_spec_mtp.py)
SETUPS = [("NGRAM", None), ("STANDALONE", "draft"), ("EAGLE3", "eagle3"), ("EAGLE3", "eagle3_speculators"),
          ("EAGLE", "eagle")]


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head", TINY_VOCAB, 128)


@pytest.fixture(scope="module")
def drafters(make_tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A one-layer draft model and a head of each layout (its EAGLE-3 head equals eagle3_head)."""
    out = tmp_path_factory.mktemp("drafters")
    return {"draft": make_tiny_model("llama", seed=1, num_hidden_layers=1),
            "eagle3": build_eagle3_head(out / "eagle3", TINY_VOCAB, 128),
            "eagle3_speculators": build_eagle3_head(out / "eagle3_s", TINY_VOCAB, TINY_VOCAB, seed=2,
                                                    layout="layers", with_embedding=True),
            "eagle": build_eagle_head(out / "eagle", TINY_VOCAB)}


def make_llm(model: Path, **overrides: Any) -> LLM:
    """The CPU set-up: float32, 4-token blocks, token ids in and out."""
    return LLM(model=str(model), dtype="float32", block_size=4, skip_tokenizer_init=True, **overrides)


def gpu_llm(model: Path, **overrides: Any) -> LLM:
    """The GPU set-up: float32 on the Triton kernels, 16-token blocks, a small share of the memory."""
    return LLM(model=str(model), device="cuda", dtype="float32", gpu_memory_utilization=0.3, block_size=16,
               attention_backend="triton", skip_tokenizer_init=True, **overrides)


def spec_kwargs(algorithm: str, drafter: Path | None, steps: int = 3) -> dict[str, Any]:
    kw: dict[str, Any] = {"speculative_algorithm": algorithm, "speculative_num_steps": steps}
    if drafter is not None:
        kw["speculative_draft_model_path"] = str(drafter)
    return kw


def tree_kwargs(algorithm: str, drafter: Path, topk: int, steps: int, tokens: int) -> dict[str, Any]:
    return {"speculative_algorithm": algorithm, "speculative_num_steps": steps, "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": tokens, "speculative_draft_model_path": str(drafter)}


def generate(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> list[Any]:
    """Each prompt's completion (its first output)."""
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, EOS ignored."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in generate(llm, params, prompts)]


def seeded_and_penalised(max_tokens: int) -> list[SamplingParams]:
    """One request each: seeded top-k (with logprobs), repetition-penalised greedy, seeded top-p with min_tokens,
    presence- and frequency-penalised greedy."""
    return [SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=max_tokens, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, seed=11, min_tokens=3, max_tokens=max_tokens),
            SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=max_tokens,
                           ignore_eos=True)]


def logprobs_of(o: Any) -> list[float]:
    return [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)]


def seeded_and_penalised_unchanged(target: Path, drafters: dict[str, Path], algorithm: str, key: str | None,
                                   **overrides: Any) -> LLM:
    """seeded_and_penalised's requests drafted by `algorithm` give the target's own tokens, and the first request
    its logprobs; returns the drafting LLM (make_llm's `overrides`) for the caller's checks. STANDALONE drafts with
    the target itself (drafts are accepted often, so verification paths really run), others with drafters[key]."""
    params = seeded_and_penalised(NEW)
    base = generate(make_llm(target), params)
    drafter = target if algorithm == "STANDALONE" else drafters.get(key or "")
    llm = make_llm(target, **spec_kwargs(algorithm, drafter), **overrides)
    outs = generate(llm, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert logprobs_of(outs[0]) == pytest.approx(logprobs_of(base[0]), abs=1e-4)
    return llm


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[Any]:
    """The tiny Llama without speculation: greedy outputs with their logprobs."""
    return generate(make_llm(tiny_model), SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1))


# ---- the tiny DeepSeek-V3 with one MTP layer -------------------------------------------------------------------
MTP_VOCAB = 384
MTP_TINY: dict[str, Any] = {
    "vocab_size": MTP_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "initializer_range": 0.1, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "moe_intermediate_size": 32, "q_lora_rank": 48, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
    "num_nextn_predict_layers": 1,
}
MTP_PROMPTS = [[5, 6, 7, 8, 9], [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 50, 51], [90] * 3 + list(range(100, 120)),
               [7, 11, 13, 17, 19, 23, 29, 31, 60]]
MTP_NEW = 10


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random transformers DeepSeek-V3 checkpoint plus one MTP layer (spec_heads.append_mtp_layer). Real-scale
    random weights: load_format dummy's tiny uniform weights make every logit nearly equal and every cache row
    nearly zero."""
    import transformers
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny_v3_mtp")
    cfg = transformers.DeepseekV3Config(**{**MTP_TINY, "num_nextn_predict_layers": 0})
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).to(torch.float32).save_pretrained(str(out))
    tensors = load_file(str(out / "model.safetensors"))
    append_mtp_layer(tensors, MTP_TINY["num_hidden_layers"], MTP_TINY["hidden_size"],
                     torch.Generator().manual_seed(1))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.num_nextn_predict_layers = 1
    cfg.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def dummy_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Config only, for load_format dummy (which builds the MTP layer too)."""
    import transformers

    out = tmp_path_factory.mktemp("dummy_v3_mtp")
    cfg = transformers.DeepseekV3Config(**MTP_TINY)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def mtp_reference(tiny_v3: Path) -> dict[str, Any]:
    """tiny_v3 without speculation: greedy outputs (long, for the oracle) and their logprobs."""
    outs = generate(make_llm(tiny_v3), SamplingParams(temperature=0.0, max_tokens=MTP_NEW + 8, ignore_eos=True,
                                                      logprobs=1), MTP_PROMPTS)
    return {"tokens": {tuple(p): o.token_ids for p, o in zip(MTP_PROMPTS, outs)},
            "logprobs": [logprobs_of(o)[:MTP_NEW] for o in outs]}


def oracle(monkeypatch: pytest.MonkeyPatch, refs: dict[tuple, list[int]], wrong: int) -> None:
    """After each step's drafting, replace each request's drafts by its true continuation with about one in
    `wrong` corrupted (beyond the reference the MTP's own drafts stay)."""
    real = MtpSpeculator.complete_step

    def propose(self: MtpSpeculator, *args: Any) -> StepResult:
        result = real(self, *args)
        for rid, drafts in self.drafts.items():
            st = self.runner.requests[rid]
            done = len(st.token_ids) - st.num_prompt_tokens
            want = refs.get(tuple(st.token_ids[: st.num_prompt_tokens]), [])[done : done + len(drafts)]
            fixed = [(t + 1) % MTP_VOCAB if (done * 7 + j * 5) % wrong == 0 else t for j, t in enumerate(want)]
            self.drafts[rid] = fixed + drafts[len(fixed):]
        return result

    monkeypatch.setattr(MtpSpeculator, "complete_step", propose)


@pytest.fixture(scope="module")
def tiny_v3_served(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config-only tiny DeepSeek-V3 with the tiny tokenizer, for served pipelines (load_format dummy)."""
    import transformers

    out = tmp_path_factory.mktemp("spec_served")
    cfg = transformers.DeepseekV3Config(**{**MTP_TINY, "vocab_size": TINY_VOCAB})
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(str(out))
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def spec_serve_config(model: Path, port: int, speculative: str, observability: str = "") -> str:
    """The serve TOML of the tiny DeepSeek-V3 + MTP pipelines of the spec tests; `speculative` and
    `observability` are extra lines of those sections."""
    return f'''
[model]
path = "{model}"
device = "cpu"
load_format = "dummy"
[precision]
dtype = "float32"
[speculative]
algorithm = "MTP"
{speculative}
[cache]
max_total_tokens = 2048
block_size = 4
[api]
port = {port}
served_model_name = "tiny"
[observability]
log_level = "warning"
{observability}
'''


# ---- stop strings: the one-by-one count, multi-token outputs, tiny_v3 with a tokenizer -------------------------
@pytest.fixture(scope="module")
def tiny_v3_tok(tiny_v3: Path, tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("spec_stop_v3")
    for src in (tiny_v3, tiny_tokenizer_dir):
        for f in src.iterdir():
            shutil.copy(f, out / f.name)
    return out


def one_by_one_count(tok: Any, ids: list[int], stop: str, **kw: Any) -> tuple[int, str]:
    """The reference: tokens fed one at a time; how many were consumed when the stop string matched, and the text."""
    d = Detokenizer(tok, stop=[stop], **kw)
    text = ""
    for t in ids:
        text += d.update([t])
        if d.finished:
            break
    assert d.finished, "the stop string must occur in the test text"
    return d.num_output_tokens, text


def pick_stop(tok: Any, ids: list[int]) -> tuple[str, int]:
    """A stop string whose first match is completed by token k (k >= 4, so speculative steps precede it)."""
    for k in range(4, len(ids) - 2):
        text = tok.decode(ids[: k + 1])
        for m in range(1, 6):
            s = text[-m:]
            if s.strip() and "\ufffd" not in s:
                try:
                    count, _ = one_by_one_count(tok, ids, s)
                except AssertionError:
                    continue
                if count == k + 1:
                    return s, k + 1
    raise AssertionError("no usable stop string in the reference output")


def chunked_outputs(request_id: str, num_prompt_tokens: int, script: list[int], chunk: int,
                    sampling: SamplingParams) -> Iterator[RequestOutput]:
    """`script` (cut at max_tokens) as outputs of `chunk` tokens (a speculative step's shape), logprob -0.01 *
    position; the last one finishes with "length"."""
    limit = min(sampling.max_tokens or 16, len(script))
    for start in range(0, limit, chunk):
        toks = script[start : min(start + chunk, limit)]
        lps = top = None
        if sampling.logprobs is not None:
            lps = [-0.01 * (start + j + 1) for j in range(len(toks))]
            top = [[(t, lp)] for t, lp in zip(toks, lps)]
        yield RequestOutput(request_id, toks, lps, top, None, "length" if start + chunk >= limit else None,
                            num_prompt_tokens, 0)


@dataclass(frozen=True)
class StopCase:
    """One prompt's greedy run on tiny_v3_tok without speculation, and a stop string its output completes mid-way
    (token `keep`, after speculative steps could have run)."""

    prompt: list[int]
    ref: list[int]  # the greedy tokens, no stop
    stop: str
    keep: int
    params: SamplingParams  # greedy with the stop string, logprobs 1
    want: Any  # the output under params


def stop_case(model: Path) -> StopCase:
    base = LLM(model=str(model), dtype="float32", block_size=4)
    prompt = [7, 11, 13, 17, 19, 23, 29, 31]
    ref = base.generate({"prompt_token_ids": prompt},
                        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))[0].outputs[0].token_ids
    stop, keep = pick_stop(base.tokenizer, ref)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, stop=[stop], logprobs=1)
    want = base.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    return StopCase(prompt, ref, stop, keep, params, want)


def delta_lengths(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> list[int]:
    """A list that fills, as llm's engine steps, with how many tokens each request delta carries."""
    seen: list[int] = []
    real_step = llm.engine.step

    def step() -> list[RequestDelta]:
        deltas = real_step()
        seen.extend(len(d.new_token_ids) for d in deltas)
        return deltas

    monkeypatch.setattr(llm.engine, "step", step)
    return seen
