"""tools/gpu_sections_profile.py's idle-gap histogram (run_profile), on synthetic device timelines."""
from __future__ import annotations

import sys
from typing import Any

import pytest
from conftest import TOOLS, load_tool


@pytest.fixture(scope="module")
def prof() -> Any:
    sys.path.insert(0, str(TOOLS))  # the tool imports its sibling gpu_measure
    return load_tool("gpu_sections_profile")


def test_gaps_fall_in_their_buckets_and_overlaps_merge(prof: Any) -> None:
    # kernels at 0-10, 11-20 (1 us gap), 15-30 overlapping, 35-40 (5 us gap), 240-250 (200 us gap), 250-260 (none)
    got = prof.gap_histogram([(11, 20), (0, 10), (15, 30), (35, 40), (240, 250), (250, 260)])
    assert got["0-2 us"] == {"count": 1, "s": pytest.approx(1e-6)}
    assert got["2-10 us"] == {"count": 1, "s": pytest.approx(5e-6)}
    assert got["10-100 us"] == {"count": 0, "s": 0.0}
    assert got[">= 100 us"] == {"count": 1, "s": pytest.approx(200e-6)}


def test_no_intervals_no_gaps(prof: Any) -> None:
    assert all(v == {"count": 0, "s": 0.0} for v in prof.gap_histogram([]).values())
