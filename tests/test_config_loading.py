"""Layered loading: TOML/YAML, extends, env, --set, flags; precedence; provenance; errors with file and line."""
from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config import ConfigError, build_config
from appliance.config.loader import resolve


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def errors_of(fn, *args, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return [p.format() for p in info.value.problems]


def test_toml_and_yaml_give_the_same_config(tmp_path: Path) -> None:
    toml = write(tmp_path, "a.toml", '[parallelism]\ntp = 2\n[cache]\nblock_size = 32\n[model]\n'
                 'hf_overrides = {rope_theta = 1000.0}\n')
    yaml = write(tmp_path, "a.yaml", "parallelism:\n  tp: 2\ncache:\n  block_size: 32\nmodel:\n"
                 "  hf_overrides:\n    rope_theta: 1000.0\n")
    a, b = build_config(toml, env={}), build_config(yaml, env={})
    assert a == b
    assert a.parallelism.tp == 2 and a.cache.block_size == 32 and a.model.hf_overrides == {"rope_theta": 1000.0}


def test_precedence_defaults_extends_file_env_flags(tmp_path: Path) -> None:
    write(tmp_path, "root.toml", "[scheduler]\nmax_num_seqs = 10\nmax_prefill_tokens = 100\n"
          "[api]\nport = 1000\nrequest_timeout = 5\n")
    write(tmp_path, "mid.toml", 'extends = "root.toml"\n[scheduler]\nmax_num_seqs = 20\n[api]\nport = 2000\n')
    sub = tmp_path / "sub"
    sub.mkdir()
    top = write(sub, "top.toml", 'extends = "../mid.toml"\n[api]\nport = 3000\nstream_interval = 3\n')
    env = {"APPLIANCE_API__STREAM_INTERVAL": "4", "APPLIANCE_CACHE__BLOCK_SIZE": "32", "APPLIANCE_API__HOST": "h"}
    r = resolve(top, env=env, flat={"host": "flag-host"}, dotlist=["cache.block_size=64"])
    c = r.config
    assert c.scheduler.max_prefill_tokens == 100  # root of the extends chain
    assert c.scheduler.max_num_seqs == 20         # the middle file beats its base
    assert c.api.port == 3000                     # the file beats its extends chain
    assert c.api.stream_interval == 4             # env beats the file
    assert c.api.host == "flag-host"              # flags beat env
    assert c.cache.block_size == 64               # --set beats env
    assert c.api.request_timeout == 5.0
    p = r.provenance
    assert p["scheduler.max_prefill_tokens"] == f"{tmp_path / 'root.toml'}:3"
    assert p["scheduler.max_num_seqs"] == f"{tmp_path / 'sub' / '..' / 'mid.toml'}:3".replace("/sub/..", "")
    assert p["api.port"] == f"{top}:3"
    assert p["api.stream_interval"] == "env APPLIANCE_API__STREAM_INTERVAL"
    assert p["api.host"] == "keyword host"
    assert p["cache.block_size"] == "--set cache.block_size"
    assert p["parallelism.tp"] == "default"


def test_yaml_provenance_has_lines(tmp_path: Path) -> None:
    f = write(tmp_path, "c.yaml", "# comment\nscheduler:\n  policy: slo\n  slo_tbt_ms: 50\n")
    r = resolve(f, env={})
    assert r.provenance["scheduler.slo_tbt_ms"] == f"{f}:4"
    assert r.config.scheduler.policy == "slo"


def test_env_values_are_typed_by_the_schema() -> None:
    env = {"APPLIANCE_MODEL__PATH": "123", "APPLIANCE_BACKENDS__CUDA_GRAPH_SIZES": "[1, 2, 4]",
           "APPLIANCE_CACHE__ENABLE_PREFIX_CACHING": "false", "APPLIANCE_OBSERVABILITY__KV_EVENTS__TOPIC": "t",
           "APPLIANCE_UNRELATED": "ignored: no double underscore"}
    c = build_config(env=env)
    assert c.model.path == "123"  # a string field keeps the text
    assert c.backends.cuda_graph_sizes == [1, 2, 4]
    assert c.cache.enable_prefix_caching is False
    assert c.observability.kv_events.topic == "t"


def test_unknown_env_and_set_keys_suggest() -> None:
    msgs = errors_of(build_config, env={"APPLIANCE_SCHEDULER__MAX_NUM_SEQ": "3"})
    assert "did you mean 'max_num_seqs'" in msgs[0] and "APPLIANCE_SCHEDULER__MAX_NUM_SEQ" in msgs[0]
    msgs = errors_of(build_config, dotlist=["cahce.block_size=3"], env={})
    assert "did you mean 'cache'" in msgs[0]
    msgs = errors_of(build_config, dotlist=["noequals"], env={})
    assert "SECTION.KEY=VALUE" in msgs[0]


def test_set_null_unsets_and_lists_parse() -> None:
    c = build_config(dotlist=["model.max_model_len=4096", "model.max_model_len=null",
                              "api.allowed_hosts=[a.example, b.example]"], env={})
    assert c.model.max_model_len is None
    assert c.api.allowed_hosts == ["a.example", "b.example"]


def test_all_errors_of_a_file_at_once_with_lines(tmp_path: Path) -> None:
    f = write(tmp_path, "bad.toml", '[model]\npathh = "x"\n\n[precision]\ndtype = "fp7"\n\n[cache]\n'
              'gpu_memory_utilization = 1.5\nblock_size = "big"\n\n[parallelism]\ntp = 2\nworld_size = 3\n')
    msgs = errors_of(build_config, f, env={})
    joined = "\n".join(msgs)
    assert f"{f}:2: model.pathh: unknown key 'pathh' in model (did you mean 'path'?)" in msgs
    assert f"{f}:5: precision.dtype:" in joined and "'fp7'" in joined
    assert f"{f}:8: cache.gpu_memory_utilization:" in joined
    assert f"{f}:9: cache.block_size:" in joined
    assert f"{f}:13: parallelism.world_size:" in joined  # cross-field check of a valid section, same run
    assert len(msgs) == 5


@pytest.mark.parametrize("name,text,line,needle", [
    ("s.toml", '[model]\npath = "x\n', 2, "TOML syntax error"),
    ("s.toml", "[cache]\nblock_size = 16\nblock_size = 32\n", 3, "TOML syntax error"),
    ("s.yaml", "model:\n  path: [x\n", 3, "YAML syntax error"),
    ("s.yaml", "model:\n path: x\n  tokenizer: y\n", 3, "YAML syntax error"),
    ("s.yaml", "- a\n- b\n", 1, "must be a mapping"),
    ("s.yaml", "api:\n  port: 1\n  port: 2\n", 3, "duplicate key"),
    ("s.toml", "[api]\nport = 1\n\n[bogus]\nx = 1\n", 4, "unknown key 'bogus'"),
])
def test_syntax_and_structure_errors_name_the_line(tmp_path: Path, name: str, text: str, line: int, needle: str) -> None:
    f = write(tmp_path, name, text)
    msgs = errors_of(build_config, f, env={})
    assert len(msgs) == 1 and msgs[0].startswith(f"{f}:{line}: ") and needle in msgs[0]


def test_extends_cycle_and_missing_file(tmp_path: Path) -> None:
    a = write(tmp_path, "a.toml", 'extends = "b.toml"\n')
    write(tmp_path, "b.toml", '# b\nextends = "a.toml"\n')
    msgs = errors_of(build_config, a, env={})
    assert "extends cycle" in msgs[0] and msgs[0].startswith(f"{tmp_path / 'b.toml'}:2: extends:")
    self_loop = write(tmp_path, "self.toml", 'extends = "self.toml"\n')
    assert "extends cycle" in errors_of(build_config, self_loop, env={})[0]
    broken = write(tmp_path, "broken.toml", '# top\n\nextends = "nope.toml"\n[api]\nport = 1\n')
    msg = errors_of(build_config, broken, env={})[0]
    assert msg.startswith(f"{broken}:3: extends:") and "not found" in msg
    misplaced = write(tmp_path, "misplaced.toml", '[api]\nport = 1\nextends = "a.toml"\n')  # inside [api]
    assert errors_of(build_config, misplaced, env={})[0].startswith(f"{misplaced}:3: api.extends: unknown key")
    assert "cannot read" in errors_of(build_config, tmp_path / "absent.toml", env={})[0]


def test_errors_in_an_extended_file_point_at_that_file(tmp_path: Path) -> None:
    write(tmp_path, "base.toml", "[scheduler]\n\nmax_num_seqs = -3\n")
    top = write(tmp_path, "top.toml", 'extends = "base.toml"\n[api]\nport = 1\n')
    msg = errors_of(build_config, top, env={})[0]
    assert msg.startswith(f"{tmp_path / 'base.toml'}:3: scheduler.max_num_seqs:")


def test_flat_keywords_of_the_offline_api() -> None:
    c = build_config(flat=dict(model="/m", dtype="float32", enable_prefix_caching=False, max_num_seqs=8,
                               tensor_parallel_size=1, skip_tokenizer_init=True, block_size=16,
                               max_total_tokens=4096, chunked_prefill_size=64, enforce_eager=True, seed=7,
                               hf_overrides={"a": 1}, speculative_config='{"method": "ngram"}'), env={})
    assert (c.model.path, c.precision.dtype, c.cache.enable_prefix_caching) == ("/m", "float32", False)
    assert (c.scheduler.max_num_seqs, c.scheduler.chunked_prefill_size, c.model.seed) == (8, 64, 7)
    assert c.cache.max_total_tokens == 4096 and c.backends.enforce_eager and c.model.skip_tokenizer_init
    assert c.model.hf_overrides == {"a": 1} and c.speculative.algorithm == "NGRAM"
    msgs = errors_of(build_config, flat={"max_num_seq": 8}, env={})
    assert "did you mean 'max_num_seqs'" in msgs[0]
    msgs = errors_of(build_config, flat={"dtype": "fp7"}, env={})
    assert "precision.dtype" in msgs[0] and "keyword dtype" in msgs[0]
