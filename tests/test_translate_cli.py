"""`appliance translate` end to end: exit codes, output files, stdin, the reverse direction and round trips."""
from __future__ import annotations

import io
import shutil
import tomllib
from pathlib import Path

import pytest

from appliance.cli import translate_cmd
from appliance.config import build_config
from appliance.translate.emit import to_toml
from appliance.translate.reverse import leaves, to_command
from appliance.translate.translator import translate_text

FIXTURES = Path(__file__).parent / "fixtures" / "translate"
RECIPE = FIXTURES / "full_recipe.toml"


@pytest.fixture
def with_unmapped(tmp_path: Path) -> Path:
    """The SGLang DeepSeek fixture plus a flag without an equivalent here (torch.compile)."""
    script = tmp_path / "dsv3.sh"
    script.write_text((FIXTURES / "sglang_deepseek_v3.sh").read_text().rstrip() + " --enable-torch-compile\n")
    return script


def test_translates_to_stdout(with_unmapped: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert translate_cmd.run([str(with_unmapped)]) == 0
    out, err = capsys.readouterr()
    assert tomllib.loads(out)["parallelism"]["tp"] == 8
    assert "warning:" in err and "--enable-torch-compile" in err  # unmapped: stderr and the TOML
    assert "--enable-torch-compile" in out
    assert "--enable-dp-attention" in out  # tp 8 without dp: noted, nothing to split


def test_strict_fails_on_unmapped_and_writes_nothing(with_unmapped: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert translate_cmd.run(["--strict", str(with_unmapped)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "--strict" in err


def test_strict_passes_when_everything_maps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "ok.sh"
    script.write_text("vllm serve org/m -tp 2 --max-num-seqs 64\n")
    assert translate_cmd.run(["--strict", str(script)]) == 0
    assert tomllib.loads(capsys.readouterr().out)["scheduler"]["max_num_seqs"] == 64


@pytest.mark.parametrize("content", [None, b"\xff\xfe\x00bad", b"echo hello\n", b"vllm serve 'open\n"])
def test_unreadable_input_exits_2(tmp_path: Path, content: bytes | None,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "in.sh"
    if content is not None:
        path.write_bytes(content)
    assert translate_cmd.run([str(path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("python -m sglang.launch_server --model-path m --tp 2\n"))
    assert translate_cmd.run(["-"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["model"]["path"] == "m"


def test_multi_node_writes_one_valid_file_per_node(tmp_path: Path) -> None:
    out = tmp_path / "dsv3.toml"
    assert translate_cmd.run([str(FIXTURES / "sglang_multinode.sh"), "-o", str(out)]) == 0
    for rank in (0, 1):
        path = tmp_path / f"dsv3-node{rank}.toml"
        assert build_config(path, env={}).parallelism.node_rank == rank
    assert not out.exists()


def test_config_file_next_to_the_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("vllm_with_config.sh", "vllm_config.yaml"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    assert translate_cmd.run([str(tmp_path / "vllm_with_config.sh"), "-o", str(tmp_path / "o.toml")]) == 0
    cfg = build_config(tmp_path / "o.toml", env={})
    assert cfg.parallelism.tp == 2 and cfg.scheduler.max_num_seqs == 128 and cfg.api.port == 8001


def test_through_the_appliance_dispatcher(capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.cli.main import main

    assert main(["translate", str(FIXTURES / "tokenspeed_deepseek.sh")]) == 0
    assert tomllib.loads(capsys.readouterr().out)["speculative"]["algorithm"] == "MTP"


def test_reverse_prints_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert translate_cmd.run(["--to", "sglang", str(RECIPE)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# ") and "python -m sglang.launch_server" in out
    assert "--disable-radix-cache" in out and "--page-size 32" in out
    assert "api.caps.max_n" in err
    assert translate_cmd.run(["--to", "vllm", "--strict", str(RECIPE)]) == 1  # policy lpm, caps.max_n


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_round_trip_keeps_every_expressible_setting(engine: str) -> None:
    original = tomllib.loads(RECIPE.read_text())
    command = to_command(original, engine)
    (back,) = translate_text(command.render()).translations
    expected = {k: v for k, v in leaves(original).items() if k not in command.inexpressible}
    got = leaves(back.document())
    if engine == "sglang":  # SGLang says expert parallelism with an explicit size: the effective ep, tp x dp
        assert got.pop("parallelism.ep") == original["parallelism"]["tp"] * original["parallelism"]["dp"]
    assert got == expected
    assert back.problems == []
    if engine == "vllm":  # vLLM can say all but these two
        assert set(command.inexpressible) == {"scheduler.policy", "api.caps.max_n"}


def test_round_trip_from_a_translated_command() -> None:
    """vLLM -> ours -> vLLM -> ours: the second translation equals the first."""
    (first,) = translate_text((FIXTURES / "vllm_short_forms.sh").read_text()).translations
    command = to_command(first.document(), "vllm")
    assert command.inexpressible == {}
    (second,) = translate_text(command.render()).translations
    assert second.document() == first.document()


def test_reverse_resolves_extends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "base.toml").write_text('[model]\npath = "org/base"\n\n[parallelism]\ntp = 2\n')
    (tmp_path / "child.toml").write_text('extends = "base.toml"\n\n[scheduler]\nmax_num_seqs = 32\n')
    assert translate_cmd.run(["--to", "vllm", str(tmp_path / "child.toml")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vllm serve org/base") and "--tensor-parallel-size 2" in out
    assert "--max-num-seqs 32" in out and "extends" not in out


def test_reverse_rejects_an_invalid_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.toml").write_text("[parallelism]\ntp = 0\n")
    assert translate_cmd.run(["--to", "sglang", str(tmp_path / "bad.toml")]) == 2
    assert "parallelism.tp" in capsys.readouterr().err


def test_round_trip_keeps_variables_split_parallelism_and_new_fields(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang -> ours -> SGLang -> ours: environment variables stay variables, DP attention, pp and the host
    tier come back as they went in."""
    command = ("python -m sglang.launch_server --model-path $MODEL --tp 8 --dp 8 --enable-dp-attention "
               "--pp-size 2 --enable-hierarchical-cache --hicache-ratio 2 --dist-init-addr ${MASTER_IP}:5000 "
               "--nnodes 2 --node-rank 0 --port ${PORT:-30000} --tool-call-parser glm47\n")
    (first,) = translate_text(command).translations
    assert first.document()["parallelism"]["tp"] == 1 and first.document()["parallelism"]["dense_tp"] == 8
    back = to_command(first.document(), "sglang")
    assert back.inexpressible == {}
    text = back.render()
    assert '--model-path "${MODEL}"' in text and '"${MASTER_IP}:5000"' in text and '"${PORT:-30000}"' in text
    (second,) = translate_text(text).translations
    assert second.document() == first.document()
    path = tmp_path / "dp.toml"  # the CLI keeps the file's own ${oc.env:...} values when reading it back
    path.write_text(to_toml(first))
    assert translate_cmd.run(["--to", "vllm", str(path)]) == 0
    out = capsys.readouterr().out
    assert 'vllm serve "${MODEL}"' in out and '--master-addr "${MASTER_IP}"' in out
    assert "--pipeline-parallel-size 2" in out
