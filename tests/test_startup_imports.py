"""benchmarks/startup_imports.py: the import-time log summed by package, and one fresh worker start-up timed."""
from __future__ import annotations

import subprocess
import sys

from appliance.config import build_config
from benchmarks.startup_imports import median_of, package_self_times, run_once

LOG = """import time: self [us] | cumulative | imported package
import time:       120 |        120 |   _io
import time:     20000 |      50000 | torch
import time:     30000 |      30000 |   torch._C
import time:      5000 |       5000 |     transformers.utils.hub
import time:      1000 |       6000 | transformers
"""


def test_self_times_are_summed_per_top_level_package() -> None:
    got = package_self_times(LOG)
    assert got == {"_io": 120e-6, "torch": 0.05, "transformers": 0.006}


def test_medians_take_each_phase_over_the_runs() -> None:
    runs = [{"imports": 1.0, "x": 3.0}, {"imports": 3.0}, {"imports": 2.0, "x": 1.0}]
    assert median_of(runs) == {"imports": 2.0, "x": 1.0}


def test_a_fresh_worker_start_up_reports_its_phases() -> None:
    took, total, packages = run_once(build_config(dotlist=["model.device=cpu"]).to_dict())
    assert ["imports", "reading the model config", "loading weights", "allocating the KV cache"] == [
        p for p in took if p in ("imports", "reading the model config", "loading weights", "allocating the KV cache")]
    assert 0 < sum(took.values()) <= total
    assert packages["torch"] > 0 and "prometheus_client" not in packages


def test_the_tokenizer_and_scheduler_stages_report_their_phases() -> None:
    config = build_config(dotlist=["model.device=cpu"]).to_dict()
    took, total, packages = run_once(config, "tokenizer")
    assert list(took) == ["process start", "imports", "loading the tokenizer"] and 0 < sum(took.values()) <= total
    assert "torch" not in packages and packages["transformers"] > 0  # a Llama tokenizer loads without torch
    took, total, packages = run_once(config, "scheduler")
    assert list(took) == ["process start", "imports"] and "torch" not in packages and "zmq" in packages


def test_a_dense_model_worker_imports_only_what_it_runs() -> None:
    """The embedded Llama built on the CPU: its config read without transformers (models/config_json.py), no MLA,
    MoE or fp8-block layers or kernels (the fp8 KV calibration looks for MLA layers without importing them), no
    Triton on the torch backend, and nothing of torch.compile."""
    code = ("import sys\n"
            "from appliance.config import build_config\n"
            "from appliance.executor.model_runner import ModelRunner\n"
            "ModelRunner(build_config(dotlist=['model.device=cpu', 'backends.enforce_eager=true']))\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} | set(m for m in sys.modules if m.startswith(('appliance', 'torch._dynamo', 'torch._inductor')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(eval(out.stdout.strip().splitlines()[-1]))
    assert "appliance.models.llama" in loaded and "torch" in loaded
    unwanted = {"transformers", "sympy", "triton", "appliance.layers.mla", "appliance.kernels.mla",
                "appliance.kernels.moe", "appliance.layers.fp8", "appliance.layers.moe", "appliance.kernels.triton",
                "torch._dynamo", "torch._inductor"}
    assert not unwanted & loaded, sorted(unwanted & loaded)
