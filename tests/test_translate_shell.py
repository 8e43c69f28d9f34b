"""The shell layer of `appliance translate`: continuations, comments, quoting, variables, wrappers."""
from __future__ import annotations

import pytest

from appliance.translate.launcher import detect
from appliance.translate.shell import ShellSyntaxError, parse_script, restore


def argvs(text: str) -> list[list[str]]:
    return [[restore(w) for w in c.argv] for c in parse_script(text)]


def test_continuations_and_comments_after_them() -> None:
    text = "vllm serve m \\\n  --tp 2 \\\n  # a note inside the command\n  --port 9000   # trailing comment\n"
    assert argvs(text) == [["vllm", "serve", "m", "--tp", "2", "--port", "9000"]]


def test_backslash_followed_by_blanks_still_continues() -> None:
    assert argvs("vllm serve m \\   \n --tp 2\n") == [["vllm", "serve", "m", "--tp", "2"]]


def test_several_commands_and_separators() -> None:
    text = "pip install vllm && vllm serve a; echo hi | tee x\nvllm serve b &\n"
    assert argvs(text) == [["pip", "install", "vllm"], ["vllm", "serve", "a"], ["echo", "hi"], ["tee", "x"],
                           ["vllm", "serve", "b"]]


def test_redirections_are_dropped() -> None:
    assert argvs("vllm serve m --tp 2 > log.txt 2>&1\n") == [["vllm", "serve", "m", "--tp", "2"]]


def test_export_and_prefix_variables() -> None:
    cmds = parse_script("export MODEL=org/m\nTP=4\nCUDA_VISIBLE_DEVICES=0,1 vllm serve $MODEL --tp $TP\n")
    assert [restore(w) for w in cmds[0].argv] == ["vllm", "serve", "org/m", "--tp", "4"]
    env = dict(cmds[0].env)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["MODEL"] == "org/m"
    assert "TP" not in env  # a shell variable, not exported
    assert cmds[0].unresolved == ()


def test_unquoted_variable_is_word_split_quoted_is_not() -> None:
    cmds = argvs('ARGS="--tp 2 --dp 2"\nvllm serve m $ARGS\nvllm serve m "$ARGS"\n')
    assert cmds[0] == ["vllm", "serve", "m", "--tp", "2", "--dp", "2"]
    assert cmds[1] == ["vllm", "serve", "m", "--tp 2 --dp 2"]


def test_unresolved_and_single_quoted_dollars() -> None:
    (cmd,) = parse_script("vllm serve m --node-rank $NODE_RANK --api-key 'sk-$x' --host ${HOST:-0.0.0.0}\n")
    assert cmd.unresolved == ("$NODE_RANK", "${HOST:-0.0.0.0}")
    words = list(cmd.argv)
    assert words[words.index("--node-rank") + 1] == "$NODE_RANK"
    assert restore(words[words.index("--api-key") + 1]) == "sk-$x"
    assert words[words.index("--api-key") + 1] != "sk-$x"  # kept apart from unresolved references


def test_command_substitution_stays_one_unresolved_word() -> None:
    (cmd,) = parse_script("vllm serve m --master-addr $(hostname -I) --port 1\n")
    assert cmd.argv[4].startswith("$(") and cmd.argv[5] == "--port"


def test_unterminated_quote_is_an_error() -> None:
    with pytest.raises(ShellSyntaxError):
        parse_script("vllm serve 'm\n")


@pytest.mark.parametrize("argv,engine,args", [
    (["vllm", "serve", "m", "--tp", "2"], "vllm", ["m", "--tp", "2"]),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], "vllm", ["--model", "m"]),
    (["python", "-m", "sglang.launch_server", "--model-path", "m"], "sglang", ["--model-path", "m"]),
    (["python3.11", "-u", "-m", "sglang.launch_server", "--tp", "8"], "sglang", ["--tp", "8"]),
    (["sglang", "serve", "--model-path", "m"], "sglang", ["--model-path", "m"]),
    (["tokenspeed", "serve", "m"], "tokenspeed", ["m"]),
    (["ts", "serve", "m"], "tokenspeed", ["m"]),
    (["spark", "serve", "m"], "atlas", ["m"]),
    (["nohup", "env", "A=1", "uv", "run", "vllm", "serve", "m"], "vllm", ["m"]),
    (["docker", "run", "--gpus", "all", "-p", "8000:8000", "vllm/vllm-openai:v0.11.0", "--model", "m"], "vllm",
     ["--model", "m"]),
    (["docker", "run", "lmsysorg/sglang:latest", "python3", "-m", "sglang.launch_server", "--tp", "8"], "sglang",
     ["--tp", "8"]),
    (["docker", "run", "-it", "avarok/atlas-gb10:latest", "serve", "m", "--port", "9"], "atlas",
     ["m", "--port", "9"]),
])
def test_detect_engine(argv: list[str], engine: str, args: list[str]) -> None:
    launch = detect(argv)
    assert launch.engine == engine
    assert launch.args == args


def test_docker_report_and_env() -> None:
    launch = detect(["docker", "run", "-e", "HF_TOKEN", "-e", "X=1", "-v", "/a:/b", "-p8000:80",
                     "--gpus", '"device=2,3"', "vllm/vllm-openai", "m"])
    assert launch.env == {"HF_TOKEN": "$HF_TOKEN", "X": "1"}
    assert launch.devices == ["2", "3"]
    text = "\n".join(launch.docker)
    assert "8000:80" in text and "/a:/b" in text


def test_bash_c_script_is_returned_for_parsing() -> None:
    launch = detect(["docker", "run", "lmsysorg/sglang", "bash", "-c", "python3 -m sglang.launch_server --tp 2"])
    assert launch.engine is None and launch.script == "python3 -m sglang.launch_server --tp 2"


def test_not_an_engine() -> None:
    assert detect(["pip", "install", "vllm"]).engine is None
