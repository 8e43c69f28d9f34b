"""The all-reduce choice: when the one-shot over CUDA IPC buffers applies, the NCCL / gloo fallbacks, the knob.

CPU only: the dispatch runs with a stand-in one-shot (the real one needs GPUs: test_custom_all_reduce_gpu.py).
"""
from __future__ import annotations

import pytest
import torch

from appliance.config import build_config, parse_serve_args
from appliance.layers import parallel_state
from appliance.layers.custom_all_reduce import (
    DEFAULT_MAX_BYTES,
    AllReduceSettings,
    PeerInfo,
    build_one_shot,
    message_fits,
    unavailable_reason,
)
from appliance.translate.reverse import to_command
from appliance.translate.translator import translate_text

HOST2 = [PeerInfo("h", 8), PeerInfo("h", 8)]


def _reason(**kw: object) -> str | None:
    args: dict[str, object] = {"device_type": "cuda", "world_size": 2, "peers": HOST2, "symm_mem_importable": True}
    settings = kw.pop("settings", AllReduceSettings())
    args.update(kw)
    return unavailable_reason(settings, **args)  # type: ignore[arg-type]


def test_one_shot_applies_only_to_gpus_of_one_host() -> None:
    assert _reason() is None
    assert "disabled" in _reason(settings=AllReduceSettings(disabled=True))
    assert "world size 1" in _reason(world_size=1, peers=[PeerInfo("h", 8)])
    assert "cpu" in _reason(device_type="cpu", peers=None)
    assert "symmetric memory" in _reason(symm_mem_importable=False)
    assert "several hosts" in _reason(peers=[PeerInfo("a", 8), PeerInfo("b", 8)])  # multi-node
    assert "fewer GPUs" in _reason(peers=[PeerInfo("h", 1), PeerInfo("h", 1)])  # parallelism.devices: one each
    assert "missing" in _reason(peers=[PeerInfo("h", 8)])


def test_message_fits_dtype_size_alignment() -> None:
    row = 4096 * 2  # one bf16 row of an 8B model
    assert message_fits(row, torch.bfloat16, "cuda", True, DEFAULT_MAX_BYTES)
    assert message_fits(DEFAULT_MAX_BYTES, torch.float32, "cuda", True, DEFAULT_MAX_BYTES)
    assert not message_fits(DEFAULT_MAX_BYTES + 16, torch.bfloat16, "cuda", True, DEFAULT_MAX_BYTES)  # too big
    assert not message_fits(row, torch.float16, "cuda", True, DEFAULT_MAX_BYTES)  # torch's kernel: bf16/fp32 only
    assert not message_fits(row, torch.bfloat16, "cpu", True, DEFAULT_MAX_BYTES)
    assert not message_fits(row, torch.bfloat16, "cuda", False, DEFAULT_MAX_BYTES)
    assert not message_fits(6, torch.bfloat16, "cuda", True, DEFAULT_MAX_BYTES)  # 3 bf16: below a 4-byte vector
    assert not message_fits(0, torch.bfloat16, "cuda", True, DEFAULT_MAX_BYTES)
    assert message_fits(row, torch.bfloat16, "cuda", True, DEFAULT_MAX_BYTES, address=4096)
    assert not message_fits(row, torch.bfloat16, "cuda", True, DEFAULT_MAX_BYTES, address=4098)  # misaligned view


class _FakeOneShot:
    """Stands in for OneShotAllReduce: the same fits rule as if x were on a GPU, a recognisable result."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.calls = max_bytes, 0

    def fits(self, x: torch.Tensor) -> bool:
        return message_fits(x.numel() * x.element_size(), x.dtype, "cuda", x.is_contiguous(), self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mul_(2)  # what a sum over two equal ranks gives


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """A stand-in group of two: torch.distributed's all_reduce records its inputs and doubles them."""
    import torch.distributed as dist

    seen: list[torch.Tensor] = []
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(0, 2, object()))
    monkeypatch.setattr(parallel_state, "_ONE_SHOT", None)
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: (seen.append(x), x.mul_(2)))
    return seen


def test_dispatch_small_one_shot_big_and_odd_to_torch(two_ranks: list[torch.Tensor]) -> None:
    fake = _FakeOneShot(max_bytes=1024)
    parallel_state.set_one_shot_all_reduce(fake)
    small = torch.ones(4, 64, dtype=torch.bfloat16)  # 512 bytes
    assert parallel_state.all_reduce_kind(small) == "one_shot"
    assert torch.equal(parallel_state.tp_all_reduce(small), torch.full((4, 64), 2.0, dtype=torch.bfloat16))
    assert fake.calls == 1 and two_ranks == []
    big = torch.ones(16, 64, dtype=torch.bfloat16)  # 2 KiB > the buffer: NCCL
    half = torch.ones(4, 64, dtype=torch.float16)  # fp16: the one-shot kernel has no fp16
    strided = torch.ones(64, 4, dtype=torch.bfloat16).t()
    for x in (big, half, strided):
        assert parallel_state.all_reduce_kind(x) == "torch"
        parallel_state.tp_all_reduce(x)
    assert fake.calls == 1 and [t.shape for t in two_ranks] == [big.shape, half.shape, strided.shape]
    assert torch.all(big == 2)


def test_dispatch_without_one_shot_and_at_world_size_one(two_ranks: list[torch.Tensor],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.ones(2, 8)
    assert parallel_state.all_reduce_kind(x) == "torch"  # no one-shot installed (CPU, disabled, multi-node)
    parallel_state.tp_all_reduce(x)
    assert len(two_ranks) == 1
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState())
    parallel_state.set_one_shot_all_reduce(_FakeOneShot(1 << 20))
    y = torch.ones(2, 8)
    assert parallel_state.all_reduce_kind(y) == "identity" and parallel_state.tp_all_reduce(y) is y
    assert torch.all(y == 1) and len(two_ranks) == 1


def test_new_group_drops_the_old_one_shot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState())
    parallel_state.set_one_shot_all_reduce(_FakeOneShot(1 << 20))
    parallel_state.init_tensor_parallel(0, 1)
    assert parallel_state._ONE_SHOT is None


def test_build_one_shot_declines_without_touching_the_group() -> None:
    """CPU and disabled groups decide locally (no collective, so no group is needed here)."""
    impl, line = build_one_shot(AllReduceSettings(), None, 0, 2, torch.device("cpu"))
    assert impl is None and "gloo for every message" in line and "cpu workers" in line
    impl, line = build_one_shot(AllReduceSettings(disabled=True), None, 0, 2, torch.device("cuda"))
    assert impl is None and "NCCL for every message" in line and "disable_custom_all_reduce" in line
    with pytest.raises(ValueError, match="multiple of 16"):
        AllReduceSettings(max_bytes=100)


def test_config_knob_flags_and_translation() -> None:
    assert AllReduceSettings.from_config(build_config()) == AllReduceSettings()
    on = build_config(flat={"disable_custom_all_reduce": True})
    assert on.parallelism.disable_custom_all_reduce and AllReduceSettings.from_config(on).disabled
    served = parse_serve_args(["m", "--tp", "2", "--disable-custom-all-reduce"], env={})
    assert served.parallelism.disable_custom_all_reduce is True and served.parallelism.tp == 2
    assert parse_serve_args(["m"], env={}).parallelism.disable_custom_all_reduce is False
    for command in ("vllm serve m -tp 2 --disable-custom-all-reduce",
                    "python -m sglang.launch_server --model-path m --tp 2 --disable-custom-all-reduce"):
        (tr,) = translate_text(command).translations
        doc = tr.document()
        assert doc["parallelism"]["disable_custom_all_reduce"] is True and tr.problems == []
        for engine in ("vllm", "sglang"):
            back = to_command(doc, engine)
            assert "--disable-custom-all-reduce" in back.render()
            (again,) = translate_text(back.render()).translations
            assert again.document()["parallelism"]["disable_custom_all_reduce"] is True
