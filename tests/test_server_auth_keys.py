"""API keys are compared in constant time against every configured key (no early exit on the first match)."""
from __future__ import annotations

import pytest


def test_key_comparison_is_constant_time_over_all_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    from appliance.server import auth

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = (b"first-key", b"second", b"third-key-long")
    assert auth.key_matches(b"first-key", keys) and not auth.key_matches(b"first-kez", keys)
    assert len(calls) == 6  # every key compared, whichever matched; no early exit on the first
