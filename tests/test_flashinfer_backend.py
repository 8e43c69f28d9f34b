"""The optional flashinfer kernel backend (appliance/kernels/flashinfer).

CPU: start-up errors (flashinfer missing, CUDA missing, flashinfer sampling), `auto` never picking it, graphs off,
and the backend's glue (block tables -> flashinfer page lists, one plan per step, slot -1 rows dropped) run
against the torch reference through a stand-in for flashinfer written from its documented semantics
(tests/flashinfer_fake.py). The GPU tests are tests/test_flashinfer_gpu.py.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flashinfer_cases import (
    check_close,
    decode_case,
    mixed_step,
    paged_kv,
    prefill_case,
    store_case,
)
from flashinfer_fake import _fake_module

from appliance.config import build_config
from appliance.config import support as config_support
from appliance.executor.cuda_graph import graph_settings
from appliance.executor.runner_setup import _check_supported, resolve_backend
from appliance.kernels import registry

OUR_MODULES = "appliance.kernels.flashinfer"


def _ours(name: str) -> bool:
    return name == OUR_MODULES or name.startswith(OUR_MODULES + ".")


@pytest.fixture
def fresh_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Registry and modules as if the flashinfer backend had never been imported; afterwards, exactly as before
    (whatever this test imported over a stand-in or a blocked flashinfer is dropped)."""
    import appliance.kernels as kernels_pkg

    # in place: other backends' modules imported meanwhile must keep their registrations
    saved_ops = {op: impls.pop("flashinfer") for op, impls in registry._REGISTRY.items() if "flashinfer" in impls}
    was_loaded = "flashinfer" in registry._LOADED
    registry._LOADED.discard("flashinfer")
    saved = {n: m for n, m in sys.modules.items() if _ours(n)}
    saved_attr = kernels_pkg.__dict__.get("flashinfer")
    for n in saved:
        del sys.modules[n]
    kernels_pkg.__dict__.pop("flashinfer", None)
    try:
        yield
    finally:
        for impls in registry._REGISTRY.values():
            impls.pop("flashinfer", None)
        for op, fn in saved_ops.items():
            registry._REGISTRY[op]["flashinfer"] = fn
        registry._LOADED.discard("flashinfer")
        if was_loaded:
            registry._LOADED.add("flashinfer")
        for n in [n for n in sys.modules if _ours(n)]:
            del sys.modules[n]
        sys.modules.update(saved)
        kernels_pkg.__dict__.pop("flashinfer", None)
        if saved_attr is not None:
            kernels_pkg.flashinfer = saved_attr  # type: ignore[attr-defined]


@pytest.fixture
def flashinfer_missing(fresh_backend: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError


@pytest.fixture
def without_attention_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """config/support.py refuses backends.attention = flashinfer when the package cannot be found (find_spec, which a
    blocked or stand-in import does not fool); lifted here so the executor's own start-up check is what answers."""
    monkeypatch.setattr(config_support, "UNSUPPORTED",
                        [u for u in config_support.UNSUPPORTED if u.path != "backends.attention"])


# ---- start-up ---------------------------------------------------------------------------------------------------

def test_config_gate_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.config import check_supported

    monkeypatch.setattr(config_support, "_importable", lambda package: False)
    problems = check_supported(build_config(flat={"attention_backend": "flashinfer"}))
    assert len(problems) == 1 and problems[0].startswith("backends.attention:") and "flashinfer-python" in problems[0]
    monkeypatch.setattr(config_support, "_importable", lambda package: package == "flashinfer")
    assert not check_supported(build_config(flat={"attention_backend": "flashinfer"}))
    assert check_supported(build_config(flat={"attention_backend": "fa3"}))  # other names stay refused

def test_missing_flashinfer_fails_at_start_up_naming_setting_and_package(flashinfer_missing: None) -> None:
    with pytest.raises(ValueError) as err:
        resolve_backend("flashinfer", torch.device("cuda"))
    msg = str(err.value)
    assert "backends.attention = 'flashinfer'" in msg and "flashinfer-python" in msg and "0.6.14" in msg
    assert resolve_backend("triton", torch.device("cuda")) == "triton"  # the others are untouched


def test_runner_start_up_refuses_flashinfer_when_missing(flashinfer_missing: None, without_attention_gate: None,
                                                          tiny_model: Any) -> None:
    from appliance.executor.model_runner import ModelRunner

    cfg = build_config(flat={"model": str(tiny_model), "attention_backend": "flashinfer", "max_total_tokens": 256},
                       env={})
    with pytest.raises(ValueError, match=r"backends.attention = 'flashinfer'.*flashinfer-python"):
        ModelRunner(cfg)


def test_llm_refuses_flashinfer_at_start_up_when_missing(flashinfer_missing: None, tiny_model: Any) -> None:
    """Through the public entry point, with whatever config/support.py says today: refused before any work with
    the setting named (by support.py's gate today; by the executor, package named, once the gate lets it in)."""
    from appliance import LLM

    with pytest.raises(ValueError) as err:
        LLM(model=str(tiny_model), attention_backend="flashinfer", max_total_tokens=256)
    msg = str(err.value)
    assert "backends.attention" in msg
    if "attention backends exist in this build" not in msg:  # past the gate: the executor's message
        assert "flashinfer-python" in msg


@pytest.fixture
def fake_importable(fresh_backend: None, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The backend imported over a stand-in flashinfer module (see _fake_module), with a small workspace."""
    fake = _fake_module()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    registry.get("store_kv", "flashinfer")  # imports appliance.kernels.flashinfer over the stand-in
    from appliance.kernels.flashinfer import attention, plans

    monkeypatch.setattr(plans, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(plans, "_STATES", {})
    monkeypatch.setattr(attention, "_DECODE_COMPILED", set())
    # the real kernels take CUDA float16/bfloat16 only; the stand-in computes in float64 on the CPU
    monkeypatch.setattr(plans, "check_attention_inputs", lambda op, q, k_cache: None)
    return fake


def test_flashinfer_needs_cuda_and_auto_never_picks_it(fake_importable: types.ModuleType) -> None:
    assert resolve_backend("flashinfer", torch.device("cuda")) == "flashinfer"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("flashinfer", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cuda")) == "triton"  # flashinfer importable: still not picked
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


def test_registered_ops(fake_importable: types.ModuleType) -> None:
    from appliance.kernels.flashinfer import attention, elementwise

    assert registry.get("store_kv", "flashinfer") is attention.store_kv
    assert registry.get("decode_attention", "flashinfer") is attention.decode_attention
    assert registry.get("prefill_attention", "flashinfer") is attention.prefill_attention
    assert registry.get("rms_norm", "flashinfer") is elementwise.rms_norm
    assert registry.get("silu_and_mul", "flashinfer") is elementwise.silu_and_mul
    for op in ("rope", "gemv", "rms_norm_quant", "silu_and_mul_quant"):  # triton's by the fallback order, else torch's
        with pytest.raises(KeyError):
            registry.get(op, "flashinfer")
        want = "triton" if importlib.util.find_spec("triton") is not None else "torch"
        assert registry.resolve(op, "flashinfer") == (want, registry.get(op, want))
    assert registry.resolve("silu_and_mul", "flashinfer") == ("flashinfer", elementwise.silu_and_mul)
    with pytest.raises(KeyError):
        registry.get("sample", "flashinfer")  # not wired: the Triton sampler keeps sampling
    with pytest.raises(KeyError):
        registry.get("rope_store_kv", "flashinfer")  # a fused cache write is never taken from another backend
    assert registry.resolve("rope_store_kv", "flashinfer")[0] == "torch"  # (layers/attention.py asks get, exactly)


@pytest.mark.parametrize("value", ["flashinfer", "flashinfer_full"])
def test_flashinfer_sampling_is_refused_at_start_up(value: str) -> None:
    cfg = build_config(flat={"sampling_backend": value}, env={})
    with pytest.raises(ValueError, match=r"backends.sampling=.*not wired.*supported: auto, torch"):
        _check_supported(cfg, torch.device("cuda"))


def test_graphs_are_off_for_flashinfer(caplog: pytest.LogCaptureFixture) -> None:
    config = SimpleNamespace(backends=SimpleNamespace(enforce_eager=False, cuda_graph_sizes=None,
                                                      cuda_graph_max_bs=16),
                             scheduler=SimpleNamespace(max_num_seqs=64))
    llama = SimpleNamespace(supports_cuda_graphs=True)
    with caplog.at_level(logging.INFO, logger="appliance.executor.cuda_graph"):
        assert graph_settings(config, llama, torch.device("cuda"), backend="flashinfer") is None
    assert any("flashinfer" in r.getMessage() and "eagerly" in r.getMessage() for r in caplog.records)
    assert graph_settings(config, llama, torch.device("cuda"), backend="triton") is not None


# ---- CPU: the glue through the stand-in ------------------------------------------------------------------------

def test_glue_decode_matches_reference(fake_importable: types.ModuleType) -> None:
    decode_case([1, 16, 17, 100, 33], 8, 2, 64, torch.float32, "cpu", 1e-5)
    decode_case([5], 4, 4, 128, torch.float32, "cpu", 1e-5, seed=3)


def test_glue_prefill_with_prefix_and_padding_matches_reference(fake_importable: types.ModuleType) -> None:
    prefill_case([7, 1, 20, 0, 0], [0, 16, 13, 0, 0], 8, 2, 64, torch.float32, "cpu", 1e-5)
    prefill_case([33], [40], 4, 1, 64, torch.float32, "cpu", 1e-5, seed=5)


def test_glue_store_drops_skipped_slots(fake_importable: types.ModuleType) -> None:
    store_case(20, 2, 64, torch.float32, "cpu")
    store_case(20, 2, 64, torch.float32, "cpu", skip_every=3)
    store_case(3, 2, 64, torch.float32, "cpu", skip_every=1)  # every row skipped
    from appliance.kernels.flashinfer import attention

    k = torch.zeros(2, 16, 2, 64)
    with pytest.raises(ValueError, match="outside the cache"):
        attention.store_kv(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), k, k.clone(), torch.tensor([32]))


def test_glue_plans_once_per_step(fake_importable: types.ModuleType) -> None:
    """Three layers over one step's metadata: one decode plan and one prefill plan, outputs equal the torch
    backend's. A first step without decode rows plans the decode wrapper once anyway (its JIT compile then falls
    in the runner's start-up forward) and forgets that plan."""
    fake_importable.BatchDecodeWithPagedKVCacheWrapper.plans = 0
    fake_importable.BatchPrefillWithPagedKVCacheWrapper.plans = 0
    outs, cache = mixed_step("flashinfer", torch.float32, "cpu")
    refs, ref_cache = mixed_step("torch", torch.float32, "cpu")
    for out, ref in zip(outs, refs):
        check_close(out, ref, 1e-5)
    assert torch.equal(cache, ref_cache)
    assert fake_importable.BatchPrefillWithPagedKVCacheWrapper.plans == 1
    assert fake_importable.BatchDecodeWithPagedKVCacheWrapper.plans == 1
    mixed_step("flashinfer", torch.float32, "cpu", layers=2)  # a new step (new metadata tensors): planned again
    assert fake_importable.BatchPrefillWithPagedKVCacheWrapper.plans == 2
    assert fake_importable.BatchDecodeWithPagedKVCacheWrapper.plans == 2


def test_glue_first_prefill_compiles_decode_early(fake_importable: types.ModuleType) -> None:
    decode_wrapper = fake_importable.BatchDecodeWithPagedKVCacheWrapper
    decode_wrapper.plans = 0
    prefill_case([9], [4], 4, 2, 64, torch.float32, "cpu", 1e-5)
    assert decode_wrapper.plans == 1  # the throwaway plan
    prefill_case([3], [0], 4, 2, 64, torch.float32, "cpu", 1e-5)
    assert decode_wrapper.plans == 1  # once per shape
    decode_case([20, 3], 4, 2, 64, torch.float32, "cpu", 1e-5)  # forgotten: the real step plans for itself
    assert decode_wrapper.plans == 2


def test_decode_rejects_group_sizes_its_kernels_lack(fake_importable: types.ModuleType) -> None:
    k, v, table = paged_kv([20], 16, 4, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"28 query heads over 4 kv heads.*backends.attention = triton"):
        registry.get("decode_attention", "flashinfer")(torch.zeros(1, 28, 64), k, v, table,
                                                       torch.tensor([20], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="28 query heads over 4 kv heads"):  # already at the first prefill
        registry.get("prefill_attention", "flashinfer")(torch.zeros(3, 28, 64), k, v,
                                                        torch.tensor([0, 3], dtype=torch.int32),
                                                        torch.tensor([20], dtype=torch.int32), table, 0.1)


def test_glue_rejects_tables_too_narrow(fake_importable: types.ModuleType) -> None:
    k, v, table = paged_kv([40], 16, 2, 64, torch.float32, "cpu", spare_cols=0)
    with pytest.raises(ValueError, match="needs 4 pages but the block table has 3 columns"):
        registry.get("decode_attention", "flashinfer")(torch.zeros(1, 4, 64), k, v, table,
                                                       torch.tensor([60], dtype=torch.int32), 0.1)


def test_glue_elementwise_shapes_and_out_of_place(fake_importable: types.ModuleType,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """rms_norm (2-D, 3-D strided q/k heads, >2-D rows, fused residual on copies) and silu_and_mul route their
    shapes to the stand-in correctly; odd widths take the reference. float32 on the CPU stands in for half."""
    from appliance.kernels.flashinfer import elementwise

    monkeypatch.setattr(elementwise, "_fits", lambda x, width: (width * x.element_size()) % 16 == 0
                        and x.stride(-1) == 1)
    fi, ref = registry.get("rms_norm", "flashinfer"), registry.get("rms_norm", "torch")
    gen = torch.Generator().manual_seed(0)
    w = 1 + 0.1 * torch.randn(64, generator=gen)
    for x in (torch.randn(5, 64, generator=gen), torch.randn(2, 3, 4, 64, generator=gen),
              torch.randn(3, 12, 64, generator=gen)[:, :4]):
        check_close(fi(x, w, 1e-6), ref(x, w, 1e-6), 1e-6)
    x, res = torch.randn(2, 3, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    x0, r0 = x.clone(), res.clone()
    (out, summed), (ref_out, ref_summed) = fi(x, w, 1e-6, res), ref(x, w, 1e-6, res)
    assert out.shape == summed.shape == x.shape
    check_close(out, ref_out, 1e-6)
    check_close(summed, ref_summed, 1e-7)
    assert torch.equal(x, x0) and torch.equal(res, r0)
    odd = torch.randn(3, 6, generator=gen)  # 24 bytes a row: the reference answers
    check_close(fi(odd, torch.ones(6), 1e-6), ref(odd, torch.ones(6), 1e-6), 1e-7)
    with pytest.raises(ValueError, match="does not match hidden size"):
        fi(x, torch.ones(8), 1e-6)
    silu, silu_ref = registry.get("silu_and_mul", "flashinfer"), registry.get("silu_and_mul", "torch")
    for y in (torch.randn(4, 32, generator=gen), torch.randn(4, 64, generator=gen)[:, :32], torch.randn(2, 6)):
        check_close(silu(y), silu_ref(y), 1e-6)


def test_glue_runs_a_model_like_the_torch_backend(fake_importable: types.ModuleType, without_attention_gate: None,
                                                  make_tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole runner on the CPU with attention through the backend's glue (float32, stand-in kernels; rope and
    gemv from torch since Triton cannot run here): chunked prefill over cached prefixes, mixed decode + prefill
    steps; greedy tokens equal the torch backend's."""
    from appliance import LLM, SamplingParams
    from appliance.executor import model_runner

    monkeypatch.setitem(registry.FALLBACK, "flashinfer", (registry.Fallback("torch"),))  # Triton cannot run here
    monkeypatch.setattr(model_runner, "resolve_backend", lambda name, device: name)  # past the CUDA check
    path = make_tiny_model("qwen3")
    prompts = [list(range(100, 140)), list(range(100, 120)) + [3] * 9, [5, 6, 7]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = {}
    for backend in ("flashinfer", "torch"):
        llm = LLM(model=str(path), attention_backend=backend, device="cpu", dtype="float32", max_total_tokens=1024,
                  block_size=16, chunked_prefill_size=16, skip_tokenizer_init=True)
        assert llm.executor.runner.backend == backend
        got[backend] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got["flashinfer"] == got["torch"]
    assert fake_importable.BatchPrefillWithPagedKVCacheWrapper.plans >= 4  # several steps, each planned
    assert fake_importable.BatchDecodeWithPagedKVCacheWrapper.plans >= 4
