"""Triton variants compiled ahead (executor/compile_ahead.py): a recorded variant of one of our kernels compiles for
sm_90 on the CPU, in pool processes, into the configured Triton cache; stale records are skipped; the list is keyed
by what decides the variants; and the warm-up start on a GPU loads every listed variant from the cache."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from appliance.config import build_config
from appliance.executor import compile_ahead
from appliance.executor.compile_ahead import (
    AheadReport,
    CompileAhead,
    CompiledVariants,
    compile_variants,
    fingerprint,
    manifest_path,
    read_manifest,
    source_of,
)

MODULE, NAME = "appliance.kernels.triton.positions", "_decode_positions_kernel"
H100 = {"backend": "cuda", "arch": 90, "warp_size": 32}


def positions_variant(block_size: int = 16, block_r: int = 64) -> tuple[Any, ...]:
    """What the JIT builds for one decode_positions launch on an H100 under a graph capture: (signature,
    constexprs, attrs, options, target)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    ptrs = {"rows_ptr": "*i64", "table_ptr": "*i32", "lens_ptr": "*i64", "pos_ptr": "*i64", "slots_ptr": "*i64",
            "seq_lens_ptr": "*i32"}
    signature = {**ptrs, "n": "i32", "width": "i32", "stride": "i32", "BLOCK_SIZE": "constexpr",
                 "BLOCK_R": "constexpr"}
    attrs = {(i,): backend.parse_attr("D") for i in range(len(ptrs))}
    options = backend.parse_options({"num_warps": 4, "launch_pdl": True})
    return signature, {(9,): block_size, (10,): block_r}, attrs, options, target


def positions_record(block_size: int = 16, block_r: int = 64) -> dict[str, Any]:
    """The record Triton's compile hook gives for that variant (serialized by Triton's own serializer)."""
    from triton.runtime.jit import serialize_specialization_data

    signature, constexprs, attrs, options, target = positions_variant(block_size, block_r)
    spec = serialize_specialization_data(f"{MODULE}.{NAME}", signature, constexprs, attrs, options, "key", target)
    return {"module": MODULE, "name": NAME, "spec": spec, "target": H100}


def test_a_record_rebuilds_the_jits_source_and_options_exactly() -> None:
    """The same source hash and options hash, so the same Triton cache key: the warm-up's launch finds what the
    pool compiled from the record."""
    from triton.compiler import ASTSource

    from appliance.kernels.triton.positions import _decode_positions_kernel

    signature, constexprs, attrs, options, target = positions_variant(32, 128)
    src, got_target, got_options = source_of(positions_record(32, 128))
    assert src.hash() == ASTSource(_decode_positions_kernel, signature, constexprs, attrs).hash()
    assert got_options.hash() == options.hash() and got_options.launch_pdl and got_target == target
    assert source_of(positions_record(16, 128))[0].hash() != src.hash()


def cubins(cache: Path) -> list[str]:
    """Kernel names of the compiled entries in a Triton cache directory."""
    return sorted(json.loads(p.read_text())["name"] for p in cache.rglob("*.json")
                  if not p.name.startswith("__grp__") and "name" in json.loads(p.read_text()))


@pytest.fixture
def triton_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "triton"
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    return cache


def test_a_recorded_variant_compiles_without_a_device_and_stale_ones_are_skipped(triton_cache: Path) -> None:
    good = positions_record()
    renamed = {**good, "name": "_no_such_kernel"}
    changed = json.loads(good["spec"])
    changed["signature"]["extra"] = "i32"  # a parameter the kernel no longer has
    assert compile_variants([good, renamed, {**good, "spec": json.dumps(changed)}]) == 1
    assert cubins(triton_cache) == [NAME]
    assert any(p.suffix == ".cubin" for p in triton_cache.rglob("*"))
    files = sorted(triton_cache.rglob("*"))
    assert compile_variants([good]) == 1 and sorted(triton_cache.rglob("*")) == files  # a cache hit
    untargeted = json.loads(good["spec"])
    del untargeted["target"]  # an older Triton's record: the target kept beside it serves
    assert compile_variants([{**good, "spec": json.dumps(untargeted)}]) == 1
    assert compile_variants([{**good, "spec": json.dumps(untargeted), "target": None}]) == 0


def test_the_pool_compiles_the_list_and_finish_writes_it_with_this_starts_variants(triton_cache: Path,
                                                                                   tmp_path: Path) -> None:
    from triton import knobs

    listed = [positions_record(16, 64), positions_record(32, 64), {**positions_record(), "name": "_gone"}]
    path = tmp_path / "kernels" / "k.json"
    ahead = CompileAhead(path, listed, workers=2, target=H100)
    assert knobs.runtime.jit_post_compile_hook is ahead.recorder and len(ahead.procs) == 2
    # a variant this process met, as Triton's hook reports it
    new = positions_record(16, 128)
    ahead.recorder(key="k", repr="r", fn=SimpleNamespace(module=MODULE, name=NAME),
                   compile={"specialization_data": new["spec"]}, is_manual_warmup=False, already_compiled=False)
    assert ahead.finish(wait=True) == AheadReport(listed=4, compiled=2, stopped=0)
    assert cubins(triton_cache) == [NAME, NAME]
    assert knobs.runtime.jit_post_compile_hook is None and ahead.procs == []  # the hook before it; reaped
    assert read_manifest(path) == listed + [new]
    assert CompileAhead(path, read_manifest(path), workers=0, target=H100).procs == []  # 0 workers: nothing compiles


def test_finish_stops_a_pool_the_warm_up_outran(triton_cache: Path, tmp_path: Path) -> None:
    listed = [positions_record(16, r) for r in (16, 32, 64, 128, 256, 512)]
    ahead = CompileAhead(tmp_path / "k.json", listed, workers=1, target=H100)
    proc = ahead.procs[0]
    report = ahead.finish()  # at once: the process is still importing
    assert report == AheadReport(listed=6, compiled=0, stopped=1) and proc.returncode is not None
    assert not (tmp_path / "k.json").exists()  # nothing new met: the list is not rewritten
    dropped = CompileAhead(tmp_path / "k.json", listed, workers=1, target=H100)
    proc = dropped.procs[0]
    dropped.recorder.uninstall()
    del dropped  # a start that failed before finish(): its pool goes with it
    assert proc.returncode is not None


def test_the_recorder_chains_the_hook_already_installed() -> None:
    from triton import knobs

    seen: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        rec = CompiledVariants(H100)
        rec.install()
        assert knobs.runtime.jit_post_compile_hook is rec
        knobs.runtime.jit_post_compile_hook(key="k", repr="r", fn=SimpleNamespace(module="m", name="f"),
                                            compile={"specialization_data": "{}"}, is_manual_warmup=False,
                                            already_compiled=False)
        rec.uninstall()
        assert seen == ["f"]
        assert list(rec.entries.values()) == [{"module": "m", "name": "f", "spec": "{}", "target": H100}]
        assert knobs.runtime.jit_post_compile_hook is not rec
    finally:
        knobs.runtime.jit_post_compile_hook = None


def test_the_list_is_keyed_by_the_layer_shapes_and_the_kernel_settings(tmp_path: Path) -> None:
    base = build_config().model_dump(mode="json")
    shape = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_key_value_heads": 2, "vocab_size": 100}
    key = fingerprint(base, {**shape, "num_hidden_layers": 2}, "cuda:90:32", "3.9.0")

    def changed(section: str, field: str, value: Any) -> dict[str, Any]:
        out = json.loads(json.dumps(base))
        out[section][field] = value
        return out

    # depth, context, batch and step sizes, paths, the server: one list for all (the union of what they meet)
    assert fingerprint(base, {**shape, "num_hidden_layers": 32, "max_position_embeddings": 9}, "cuda:90:32",
                       "3.9.0") == key
    for section, field, value in (("scheduler", "max_num_seqs", 8), ("model", "path", "/elsewhere"),
                                  ("cache", "compile_cache_dir", "/tmp/x"), ("api", "port", 9999)):
        assert fingerprint(changed(section, field, value), {**shape, "num_hidden_layers": 2}, "cuda:90:32",
                           "3.9.0") == key
    # the layer shapes, the kernel settings, the GPU and the compiler: another list
    assert fingerprint(base, {**shape, "hidden_size": 128}, "cuda:90:32", "3.9.0") != key
    assert fingerprint(changed("precision", "kv_cache_dtype", "fp8"), shape, "cuda:90:32", "3.9.0") != key
    assert fingerprint(changed("backends", "decode_chain", False), shape, "cuda:90:32", "3.9.0") != key
    assert fingerprint(base, shape, "cuda:100:32", "3.9.0") != key
    assert fingerprint(base, shape, "cuda:90:32", "3.10.0") != key
    assert manifest_path("~/c", key) == Path(os.path.expanduser("~/c")) / "kernels" / f"{key}.json"
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert read_manifest(bad) == [] and read_manifest(tmp_path / "missing.json") == []


def test_begin_is_off_on_the_cpu_and_at_zero_workers(tmp_path: Path) -> None:
    cpu = build_config(dotlist=[f"cache.compile_cache_dir={tmp_path}"])
    assert compile_ahead.begin(cpu, tmp_path, torch.device("cpu"), torch.float32) is None
    off = build_config(dotlist=["cache.compile_workers=0"])
    assert off.cache.compile_workers == 0
    assert compile_ahead.begin(off, tmp_path, torch.device("cuda"), torch.bfloat16) is None
    with pytest.raises(Exception, match="compile_workers"):
        build_config(dotlist=["cache.compile_workers=-1"])
    assert compile_ahead.default_workers(16) == 8 and compile_ahead.default_workers(2) == 1
    assert compile_ahead.default_workers(64) == 8


START = """
import sys
from appliance import LLM
from appliance.config import build_config
LLM(config=build_config(dotlist=[f"model.path={sys.argv[2]}", "model.skip_tokenizer_init=true",
                                 "precision.dtype=bfloat16", "scheduler.max_num_seqs=8",
                                 f"cache.compile_cache_dir={sys.argv[1]}", f"cache.compile_workers={sys.argv[3]}"]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_listed_start_compiles_ahead_exactly_what_the_warm_up_loads(tmp_path: Path, tiny_model: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A start lists its variants; from an empty Triton cache the pool compiles every one of them from its record;
    a start after that (no pool) compiles nothing itself: each variant it meets is a cache hit, so the pool's
    compiles are the JIT's own."""
    import shutil
    import subprocess
    import sys

    def start(workers: int) -> None:
        run = subprocess.run([sys.executable, "-c", START, str(tmp_path), str(tiny_model), str(workers)],
                             capture_output=True, text=True, check=False, timeout=600,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                                            os.environ.get("PYTHONPATH")]))})
        assert run.returncode == 0, run.stderr[-3000:]

    cache = tmp_path / "triton"
    start(workers=2)  # nothing listed yet: no pool; it lists what it met
    lists = list((tmp_path / "kernels").glob("*.json"))
    assert len(lists) == 1
    listed = read_manifest(lists[0])
    assert len(listed) > 10
    shutil.rmtree(cache)
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    report = CompileAhead(tmp_path / "unused.json", listed, workers=4, target=listed[0]["target"]).finish(wait=True)
    assert report.compiled == len(listed) and report.stopped == 0
    compiled = jit_entries(cache)
    start(workers=0)
    assert jit_entries(cache) == compiled


def jit_entries(cache: Path) -> list[str]:
    """The Triton cache's entries of JIT kernels: torch.compile's own (inductor's triton_poi_ / triton_red_ ...
    kernels, which a start rebuilds from inductor's cache, not from the listed variants) left out."""
    out = []
    for entry in cache.iterdir():
        names = {f.stem for f in entry.glob("*.json") if not f.name.startswith("__grp__")}
        if names and not all(n.startswith("triton_") for n in names):
            out.append(entry.name)
    return sorted(out)
