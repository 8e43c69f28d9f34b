"""benchmarks/spec_decode.py --quick runs every measurement on tiny CPU shapes: each speculative run has its
plain baseline and ratio (the draft tree's too), the forced acceptance lengths are met, the n-gram runs report a
real acceptance."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import spec_decode

pytestmark = pytest.mark.slow


def test_quick_run_measures_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs.json"
    runs = {r.name: r for r in spec_decode.main(["--quick", "--output-json", str(out)])}
    assert set(runs) == {"plain b1", "plain b4", "plain code-edit b1", "eagle3 acc2.6 b1", "eagle3 acc2.6 b4",
                         "eagle3 acc1 b1", "eagle3 tree k4 n8 acc2.6 b1", "eagle3 tree k4 n8 acc2.6 b4",
                         "ngram code-edit b1 (dummy weights)",
                         "ngram on the device code-edit b1 (dummy weights)", "plain code-edit default model",
                         "ngram code-edit default model"}
    for r in runs.values():
        assert r.output_tokens == r.batch * 8  # --quick: 8 output tokens per request, EOS ignored
        assert r.seconds > 0
        if r.baseline is not None:
            assert r.speedup == pytest.approx(r.tok_s / runs[r.baseline].tok_s)
    assert runs["eagle3 acc1 b1"].mean_acceptance_length == 1.0
    assert 1.5 < runs["eagle3 acc2.6 b4"].mean_acceptance_length < 3.5  # 8 tokens per request: few verifications
    assert 1.5 < runs["eagle3 tree k4 n8 acc2.6 b4"].mean_acceptance_length < 3.5  # along the tree's longest path
    assert runs["ngram code-edit default model"].mean_acceptance_length is not None
    device, host = runs["ngram on the device code-edit b1 (dummy weights)"], runs["ngram code-edit b1 (dummy weights)"]
    assert device.mean_acceptance_length == host.mean_acceptance_length  # the same drafts
    assert len(json.loads(out.read_text())) == len(runs)
    assert "| eagle3 acc2.6 b1 | 1 |" in capsys.readouterr().out
