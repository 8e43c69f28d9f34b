"""`appliance validate`, `appliance config show`, `appliance schema` through the CLI's one dispatch table."""
from __future__ import annotations

import io
import json
import sys
import tomllib
from pathlib import Path

import pytest

from appliance.cli import main as cli
from appliance.config import build_config
from appliance.config.docs import REPO_ROOT

RECIPES = sorted((REPO_ROOT / "recipes").glob("*.toml"))


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_recipes_validate(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(RECIPES) >= 6
    code, out, err = run(["validate", *map(str, RECIPES)], capsys)
    assert code == 0, out + err
    assert "error" not in out
    # every shipped recipe runs in this build as written (MTP speculative decoding, fp8, expert parallelism on
    # deepseek-v3 included): the one warning a recipe may get is that its model (a Hugging Face repo id) is not a
    # local directory here, so the checks against the model's config.json are skipped
    lines = out.splitlines()
    assert all("model.path" in line and "is not a local model directory here" in line for line in lines), out
    counts = {str(r): sum(line.startswith(f"{r}:") for line in lines) for r in RECIPES}
    assert err.splitlines() == [f"{r}: ok (0 errors, {counts[str(r)]} warnings)" for r in RECIPES]
    assert all(n <= 1 for n in counts.values())


def test_recipe_contents() -> None:
    ds = build_config(REPO_ROOT / "recipes" / "deepseek-v3.toml", env={})
    assert ds.parallelism.tp == 8 and ds.parallelism.enable_expert_parallel
    assert ds.precision.quantization == "fp8" and ds.speculative.algorithm == "MTP"
    assert build_config(REPO_ROOT / "recipes" / "llama-3.1-70b.toml", env={}).parallelism.tp == 4
    assert build_config(REPO_ROOT / "recipes" / "qwen3-30b-a3b.toml", env={}).parallelism.effective_ep > 1
    assert build_config(REPO_ROOT / "recipes" / "default.toml", env={}).model.path is None
    oss = build_config(REPO_ROOT / "recipes" / "gpt-oss-120b.toml", env={})
    assert oss.parallelism.tp == 8 and oss.api.reasoning_parser == oss.api.tool_call_parser == "gpt_oss"
    assert build_config(REPO_ROOT / "recipes" / "glm-4.5-air.toml", env={}).api.tool_call_parser == "glm45"
    assert build_config(REPO_ROOT / "recipes" / "gemma-3-27b.toml", env={}).parallelism.tp == 1


def test_validate_reports_each_problem_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[cache]\nblock_size = 3\n[api]\nportt = 1\n')
    good = tmp_path / "good.yaml"
    good.write_text("api:\n  port: 9000\n")
    code, out, _ = run(["validate", str(good), str(bad)], capsys)
    assert code == 1
    lines = out.strip().splitlines()
    assert lines == [f"{bad}:2: cache.block_size: must be a power of two, got 3",
                     f"{bad}:4: api.portt: unknown key 'portt' in api (did you mean 'port'?)"]


def test_validate_json_and_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("[parallelism]\ntp = 2\nworld_size = 3\n"))
    code, out, _ = run(["validate", "--json", "-"], capsys)
    report = json.loads(out)
    assert code == 1 and report["valid"] is False
    problem = report["files"][0]["problems"][0]
    assert problem["path"] == "parallelism.world_size" and problem["where"] == "<stdin>:3"
    monkeypatch.setattr(sys, "stdin", io.StringIO("scheduler:\n  policy: slo\n"))  # YAML on stdin
    assert run(["validate", "-"], capsys)[0] == 0


def test_validate_strict_turns_warnings_into_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "dflash.toml"
    f.write_text('[speculative]\nalgorithm = "DFLASH"\ndraft_model_path = "drafter"\n')  # valid, but this build cannot honour it
    code, out, err = run(["validate", str(f)], capsys)
    assert code == 0 and out.startswith(f"{f}:2: warning: speculative.algorithm: DFLASH and DSPARK")
    assert err.strip() == f"{f}: ok (0 errors, 1 warnings)"
    code, out, err = run(["validate", "--strict", str(f)], capsys)
    assert code == 1 and out.startswith(f"{f}:2: speculative.algorithm: DFLASH and DSPARK")
    assert err.strip() == f"{f}: INVALID (1 errors, 0 warnings)"


def test_config_show_round_trips_and_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[api]\napi_key = "sekrit"\nport = 1234\n[model]\nhf_overrides = {a = 1}\n')
    monkeypatch.setenv("APPLIANCE_SCHEDULER__MAX_NUM_SEQS", "9")
    code, out, _ = run(["config", "show", str(f), "--tp", "2", "--set", "cache.block_size=32",
                        "--show-secrets"], capsys)
    assert code == 0
    shown = tmp_path / "shown.toml"
    shown.write_text(out)
    again = build_config(shown, env={})
    assert again.parallelism.tp == 2 and again.scheduler.max_num_seqs == 9 and again.cache.block_size == 32
    assert again.api.api_key == "sekrit" and again.model.hf_overrides == {"a": 1}
    assert again == build_config(f, flat={"tp": 2}, dotlist=["cache.block_size=32"],
                                 env={"APPLIANCE_SCHEDULER__MAX_NUM_SEQS": "9"})
    code, out, _ = run(["config", "show", str(f), "--tp", "2", "--explain"], capsys)
    assert 'api_key = "***"' in out  # secrets hidden unless asked
    assert f"port = 1234  # {f}:3" in out
    assert "tp = 2  # flag --tp" in out
    assert "max_num_seqs = 9  # env APPLIANCE_SCHEDULER__MAX_NUM_SEQS" in out
    assert "block_size = 16  # default" in out
    tomllib.loads(out)  # comments keep it valid TOML


def test_config_show_reports_errors(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["config", "show", "--set", "cache.block_size=3"], capsys)
    assert code == 1 and "cache.block_size" in err


def test_schema_check_and_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["schema", "--check"], capsys)[0] == 0
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "x.toml").write_text("# x\n")
    assert run(["schema", "--check", "--root", str(tmp_path)], capsys)[0] == 1
    code, out, _ = run(["schema", "--root", str(tmp_path)], capsys)
    assert code == 0 and (tmp_path / "schemas" / "appliance.schema.json").exists()
    assert (tmp_path / "appliance" / "recipes" / "x.toml").read_text() == "# x\n"
    assert run(["schema", "--check", "--root", str(tmp_path)], capsys)[0] == 0


def test_dispatch_is_one_table_and_lazy(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert {"run", "serve", "validate", "config", "schema", "translate"} <= set(cli.COMMANDS)
    monkeypatch.setitem(cli.COMMANDS, "translate", ("appliance.cli.no_such_module", "broken"))
    code, _, err = run(["translate", "x"], capsys)
    assert code == 2 and "not available" in err
    assert run(["validate", str(RECIPES[0])], capsys)[0] == 0  # a broken module breaks only itself
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "validate" in out and "translate" in out
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])


def test_unknown_config_flag_suggests(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["config", "show", "--max-num-seq", "4"])
    assert info.value.code == 2
    assert "did you mean '--max-num-seqs'" in capsys.readouterr().err
