"""benchmarks/frontend_streams.py on a tiny load: the stand-in scheduler process, the real front end, every
stream to its end."""
from __future__ import annotations

from benchmarks.frontend_streams import Load, measure


def test_every_stream_ends_with_at_most_one_chunk_per_token() -> None:
    seconds, chunks = measure(Load(streams=4, output_len=8, step_s=0.005))
    assert seconds > 8 * 0.005 and 4 <= chunks <= 4 * 8
