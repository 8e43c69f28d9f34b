"""The HTTP process runs its event loop on uvloop where uvloop is installed (uvicorn's own "auto" choice, which
uvicorn applies only to loops it makes itself), else on asyncio's."""
from __future__ import annotations

import sys
import types

from appliance.runtime.tokenizer_proc import event_loop_factory


def test_uvloop_where_it_is_installed(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: asyncio's own loop
    assert event_loop_factory() is None
    fake = types.ModuleType("uvloop")
    fake.new_event_loop = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "uvloop", fake)
    assert event_loop_factory() is fake.new_event_loop
