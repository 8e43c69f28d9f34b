"""A prompt's token ids are checked by C-level scans (engine/request.py exact_ints, min / max) where they are plain
ints, and by the per-id loop otherwise: both accept and refuse exactly the same prompts."""
from __future__ import annotations

import numpy as np
import pytest

from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.request import exact_ints
from appliance.runtime.messages import GenerateRequest
from appliance.runtime.scheduler_proc import SchedulerLoop


def _core() -> EngineCore:
    cfg = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    return EngineCore(cfg, FakeExecutor(64, 4))


def test_exact_ints() -> None:
    assert exact_ints([1, 2, 3]) and exact_ints([])
    assert not exact_ints([1, True]) and not exact_ints([1, 2.0]) and not exact_ints([np.int64(1)])


@pytest.mark.parametrize("prompt, stored", [
    ([5, 6, 7], [5, 6, 7]),
    ([np.int64(5), np.int32(6)], [5, 6]),  # numpy ints become ints
    ((5, 6), [5, 6]),
    ([True, 5], [1, 5]),  # operator.index takes a bool as its int, as before
])
def test_prompts_accepted(prompt, stored) -> None:
    core = _core()
    core.add_request("r", prompt)
    got = core.get_request("r").prompt_token_ids
    assert got == stored and all(type(t) is int for t in got)


@pytest.mark.parametrize("prompt", [[5, -1], [-3], [5, 2.0], [5, "6"], [], [np.int64(-1)]])
def test_prompts_refused(prompt) -> None:
    with pytest.raises(ValueError):
        _core().add_request("r", prompt)


@pytest.mark.parametrize("ids, sampling, ok", [
    ([0, 99], {}, True),
    ([0, 100], {}, False),
    ([-1, 5], {}, False),
    ([5], {"stop_token_ids": [99]}, True),
    ([5], {"stop_token_ids": [100]}, False),
])
def test_the_scheduler_checks_ids_against_the_vocabulary(ids, sampling, ok) -> None:
    loop = SchedulerLoop(_core(), None, None, 0, None, vocab_size=100)  # type: ignore[arg-type]
    err = loop._add(GenerateRequest("r", ids, {"max_tokens": 4, **sampling}))
    assert (err is None) == ok
    if not ok:
        assert err.error_status == 400 and "token ids must be in [0, 100)" in err.error
