"""`${oc.env:VAR}` values: resolved from the environment when a config is built, typed by their field; an unset
variable is an error for a deployment that is to run and a warning for `appliance validate`."""
from __future__ import annotations

from pathlib import Path

import pytest

from appliance.cli import main as cli
from appliance.config import build_config
from appliance.config.errors import ConfigError
from appliance.config.loader import resolve

TOML = '''[model]
path = "${oc.env:MODEL_DIR}"
[parallelism]
tp = "${oc.env:TP,2}"
nnodes = 2
dist_init_addr = "${oc.env:HEAD_IP}:${oc.env:HEAD_PORT,5000}"
[api]
port = "${oc.env:HTTP_PORT}"
served_model_name = "${model.path}"
'''


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("MODEL_DIR", "TP", "HEAD_IP", "HEAD_PORT", "HTTP_PORT"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "deploy.toml"
    path.write_text(TOML)
    return path


def test_resolved_and_typed_by_the_schema(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_DIR", "/models/m")
    monkeypatch.setenv("HEAD_IP", "10.0.0.1")
    monkeypatch.setenv("HTTP_PORT", "8100")
    config = build_config(config_file, env={})
    assert config.model.path == "/models/m" and config.api.served_model_name == "/models/m"  # a key reference
    assert config.parallelism.tp == 2 and config.api.port == 8100  # defaults and text typed as int
    assert config.parallelism.dist_init_addr == "10.0.0.1:5000"


def test_unset_variables_stop_a_deployment_and_name_the_key(config_file: Path) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(config_file, env={})
    problems = {p.path: p for p in info.value.problems}
    assert set(problems) == {"model.path", "parallelism.dist_init_addr", "api.port", "api.served_model_name"}
    assert "HEAD_IP" in problems["parallelism.dist_init_addr"].message
    assert problems["api.port"].where == f"{config_file}:8"


def test_validate_warns_and_checks_the_rest(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    resolved = resolve(config_file, env={}, run_env=False)
    assert resolved.config.api.port == 8000  # an int field is checked with its default ...
    assert resolved.config.model.path == "${oc.env:MODEL_DIR}"  # ... a text field as written
    warned = [p.path for p in resolved.warnings if "not set here" in p.message]
    assert warned == ["model.path", "parallelism.dist_init_addr", "api.port", "api.served_model_name"]
    assert cli.main(["validate", str(config_file)]) == 0
    assert "warning: api.port: environment variable HTTP_PORT is not set here" in capsys.readouterr().out


def test_a_bad_resolved_value_is_an_error_with_its_key(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"MODEL_DIR": "m", "HEAD_IP": "h", "HTTP_PORT": "eighty"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="api.port"):
        build_config(config_file, env={})
