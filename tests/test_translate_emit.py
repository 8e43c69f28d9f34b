"""The TOML emitter: whatever it writes parses back to the same data, with comments that never break a line."""
from __future__ import annotations

import tomllib

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.translate.emit import to_toml, toml_value
from appliance.translate.result import Translation

scalars = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.text(max_size=20),
                    st.floats(allow_nan=False, allow_infinity=True))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=10)


@settings(max_examples=100, deadline=None)
@given(values)
def test_values_round_trip_through_tomllib(value: object) -> None:
    assert tomllib.loads(f"k = {toml_value(value)}")["k"] == value


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=40), st.dictionaries(st.text(max_size=6), st.integers(), max_size=3))
def test_sources_and_notes_with_newlines_stay_comments(source: str, overrides: dict[str, int]) -> None:
    tr = Translation("vllm", "vLLM", 1, ["vllm", "serve", source])
    tr.set("model.path", source, source, note=source)
    tr.set("model.hf_overrides", overrides, "--hf-overrides\n" + source)
    tr.warn(source, source)
    parsed = tomllib.loads(to_toml(tr))
    assert parsed["model"]["path"] == source and parsed["model"]["hf_overrides"] == overrides
