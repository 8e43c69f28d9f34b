"""The measured per-GPU tables (appliance/kernels/tuned/*.json): every file names the command that regenerates it
and the machine it was measured on, parses into its reader's typed table, ships as package data, and an
architecture without files has empty tables.

    python -m pytest -q tests/test_tuned_tables.py
"""
from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path

import pytest

from appliance.kernels import cublaslt, tuned

REPO = Path(__file__).resolve().parents[1]
FILES = sorted(tuned.TUNED_DIR.glob("*.json"))


def test_every_file_names_its_generator_and_machine() -> None:
    assert {p.name for p in FILES} >= {"sm90_cublaslt_algos.json", "sm90_cublaslt_padded.json",
                                       "sm90_skinny_gemm.json", "sm90_fp8_gemv.json"}
    for path in FILES:
        doc = json.loads(path.read_text())
        assert list(doc) == list(tuned.HEADER), path.name
        command = shlex.split(doc["generator"])  # python -m tools.NAME ...
        assert command[:2] == ["python", "-m"], doc["generator"]
        assert (REPO / (command[2].replace(".", "/") + ".py")).is_file(), doc["generator"]
        assert doc["measured_on"] and doc["entries"], path.name
        assert tuned.dumps(doc) == path.read_text(), f"{path.name}: rewrite it with kernels.tuned.write"


def test_the_tables_parse_into_their_readers() -> None:
    pytest.importorskip("triton")
    from appliance.kernels.triton.skinny_gemm import SkinnyGemmConfig, tuned_table

    lt = cublaslt.tables("sm90")
    assert lt.algos and all(isinstance(a, cublaslt.LtAlgo) for rows in lt.algos.values() for a in rows.values())
    assert lt.padded and all(to > rows for by in lt.padded.values() for rows, to in by.items())
    from appliance.kernels.triton.fp8_gemv import Fp8GemvConfig, tuned_config

    for shape in tuned.load("fp8_gemv", "sm90"):
        assert isinstance(tuned_config(*tuned.parse_shape(shape), "sm90"), Fp8GemvConfig), shape
    assert tuned_config(4096, 4096, "sm75") is None
    skinny = tuned_table("sm90")
    assert skinny and all(cfg is None or isinstance(cfg, SkinnyGemmConfig)
                          for buckets in skinny.values() for _, cfg in buckets)


def test_an_architecture_without_files_has_empty_tables() -> None:
    assert tuned.load("cublaslt_algos", "sm75") == {}
    assert cublaslt.tables("sm75") == cublaslt.LtTables({}, {})
    assert tuned.arch_name((9, 0)) == "sm90" and tuned.parse_shape(tuned.shape_key(4096, 1024)) == (4096, 1024)


def test_a_file_without_its_header_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuned, "TUNED_DIR", tmp_path)
    (tmp_path / "sm99_x.json").write_text(json.dumps({"entries": {"1x1": {}}}))
    tuned.load.cache_clear()
    try:
        with pytest.raises(ValueError, match="generator"):
            tuned.load("x", "sm99")
    finally:
        tuned.load.cache_clear()


def test_the_files_ship_as_package_data() -> None:
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["appliance"]
    assert "kernels/tuned/*.json" in patterns
