"""`appliance translate` on each input form: every result is checked to parse as TOML, to hold exactly the
translated settings, and to pass the config's own validation (`build_config`)."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from appliance.config import build_config
from appliance.config.errors import ConfigError
from appliance.config.loader import resolve
from appliance.translate.emit import to_toml
from appliance.translate.result import Translation
from appliance.translate.translator import TranslateError, translate_text

FIXTURES = Path(__file__).parent / "fixtures" / "translate"


def translate(text: str, base_dir: Path | None = FIXTURES) -> list[Translation]:
    return translate_text(text, base_dir).translations


def fixture(name: str) -> list[Translation]:
    return translate((FIXTURES / name).read_text())


def assert_valid(tr: Translation, tmp_path: Path) -> dict:
    text = to_toml(tr, "test")
    parsed = {k: v for k, v in tomllib.loads(text).items() if v}  # sections holding only pending comments
    assert parsed == tr.document()  # comments carry the rest; the data is exactly the settings
    path = tmp_path / f"{tr.engine}-{tr.line}.toml"
    path.write_text(text)
    # raises ConfigError when the output does not validate (`appliance validate`: an unset ${oc.env:VAR} warns)
    resolve(path, env={}, run_env=False)
    assert tr.problems == []
    return parsed


def warned(tr: Translation) -> str:
    return "\n".join(f"{f.subject}: {f.message}" for f in tr.findings if f.level == "warning")


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.sh")))
def test_every_fixture_translates_to_a_valid_config(name: str, tmp_path: Path) -> None:
    for tr in fixture(name):
        assert_valid(tr, tmp_path)


def test_vllm_in_docker(tmp_path: Path) -> None:
    (tr,) = fixture("vllm_docker_llama.sh")
    doc = assert_valid(tr, tmp_path)
    assert doc["model"] == {"path": "meta-llama/Llama-3.1-8B-Instruct", "max_model_len": 16384}
    assert doc["parallelism"] == {"tp": 2}
    assert doc["scheduler"] == {"chunked_prefill_size": 8192}  # --max-num-batched-tokens, seed 001
    assert tr.settings["scheduler.chunked_prefill_size"].note  # ... with a comment saying what changed
    assert doc["api"]["tool_call_parser"] == "llama3_json" and doc["precision"]["dtype"] == "bfloat16"
    context = "\n".join(tr.context)
    assert "8000:8000" in context and "/root/.cache/huggingface" in context
    assert "['0', '1']" in context  # --gpus device list reported
    assert "HUGGING_FACE_HUB_TOKEN is a secret" in context
    assert "HF_TOKEN" not in to_toml(tr).split("[model]")[1]  # secrets never land in settings


def test_sglang_deepseek_v3_on_8_gpus(tmp_path: Path) -> None:
    (tr,) = fixture("sglang_deepseek_v3.sh")
    doc = assert_valid(tr, tmp_path)
    assert doc["parallelism"]["tp"] == 8  # --tp: argparse abbreviation of --tp-size
    assert doc["cache"] == {"block_size": 64, "gpu_memory_utilization": 0.85}  # --mem-frac abbreviation
    assert doc["model"]["max_model_len"] == 65536
    assert doc["speculative"] == {"algorithm": "MTP", "num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}
    assert doc["api"]["reasoning_parser"] == "deepseek_r1"
    assert tr.unmapped == []  # --enable-dp-attention with tp 8 and no dp: nothing to split, noted
    assert any(f.subject == "--enable-dp-attention" and f.level == "note" for f in tr.findings)


def test_sglang_defaults_that_differ_are_written_out(tmp_path: Path) -> None:
    (tr,) = translate("sglang serve --model-path org/m --dp 2\n")
    doc = assert_valid(tr, tmp_path)
    assert doc["api"]["port"] == 30000 and "SGLang" in tr.settings["api.port"].note
    assert doc["parallelism"]["dp"] == 2


def test_multi_node_sglang_one_translation_per_node(tmp_path: Path) -> None:
    trs = fixture("sglang_multinode.sh")
    assert [t.get("parallelism.node_rank") for t in trs] == [0, 1]
    for tr in trs:
        doc = assert_valid(tr, tmp_path)
        assert doc["parallelism"]["nnodes"] == 2 and doc["parallelism"]["dist_init_addr"] == "10.0.0.1:5000"


def test_vllm_data_parallel_over_nodes(tmp_path: Path) -> None:
    head, worker = fixture("vllm_dp_multinode.sh")
    for tr in (head, worker):
        doc = assert_valid(tr, tmp_path)
        assert doc["parallelism"]["dist_init_addr"] == "10.99.48.128:13345"
        assert doc["parallelism"]["nprocs_per_node"] == 2 and doc["parallelism"]["nnodes"] == 2
        assert doc["model"]["path"] == "deepseek-ai/DeepSeek-V2-Lite"  # $MODEL from the script
    assert head.get("parallelism.node_rank") is None and worker.get("parallelism.node_rank") == 1
    assert any(f.subject == "--headless" for f in worker.findings)


def test_vllm_config_file_and_command_line_precedence(tmp_path: Path) -> None:
    (tr,) = fixture("vllm_with_config.sh")
    doc = assert_valid(tr, tmp_path)
    assert doc["scheduler"]["max_num_seqs"] == 128  # command line beats the file's 64
    assert doc["parallelism"]["tp"] == 2 and doc["model"]["path"] == "Qwen/Qwen3-8B"
    assert doc["cache"]["enable_prefix_caching"] is False and doc["api"]["port"] == 8001


def test_missing_config_file_is_reported(tmp_path: Path) -> None:
    (tr,) = translate("vllm serve m --config nowhere.yaml\n", base_dir=tmp_path)
    assert "nowhere.yaml not found" in warned(tr) and tr.unmapped


def test_legacy_api_server_with_removed_flags(tmp_path: Path) -> None:
    (tr,) = fixture("vllm_legacy_api_server.sh")
    doc = assert_valid(tr, tmp_path)
    assert doc["parallelism"]["tp"] == 4  # --tensor_parallel_size: underscores read as dashes
    assert doc["observability"]["enable_log_requests"] is False
    text = warned(tr)
    assert "--use-v2-block-manager" in text and "removed from vLLM" in text and "--swap-space" in text
    assert "devices ['0', '1', '2', '3']" in "\n".join(tr.context)  # CUDA_VISIBLE_DEVICES prefix


def test_vllm_short_forms_json_and_dotted(tmp_path: Path) -> None:
    (tr,) = fixture("vllm_short_forms.sh")
    doc = assert_valid(tr, tmp_path)
    assert doc["parallelism"] == {"tp": 2, "dp": 2, "enable_expert_parallel": True}
    assert doc["speculative"] == {"algorithm": "EAGLE3", "draft_model_path": "Tengyunw/qwen3_30b_moe_eagle3",
                                  "num_steps": 4}  # the dotted form overrides the JSON's 3
    assert doc["observability"]["kv_events"]["publisher"] == "zmq"
    assert doc["backends"]["cuda_graph_sizes"] == [1, 2, 4, 8, 16]
    assert doc["cache"]["enable_prefix_caching"] is False
    assert any(f.subject.startswith("-O3") for f in tr.findings)  # compilation level: noted


def test_unresolved_variables_and_placeholders_are_never_guessed(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tr,) = fixture("unresolved.sh")
    assert_valid(tr, tmp_path)
    # nothing is guessed: each value is read from the environment the appliance starts in
    assert {k: s.value for k, s in tr.settings.items()} == {
        "model.path": "${oc.env:MODEL_PATH}", "api.port": "${oc.env:PORT}", "api.api_key": "${oc.env:API_KEY}",
        "parallelism.tp": "${oc.env:TP,8}"}
    assert tr.pending == []
    text = to_toml(tr)
    assert 'port = "${oc.env:PORT}"' in text and "set PORT there" in text
    path = tmp_path / "unresolved.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="environment variable PORT is not set"):
        build_config(path, env={})  # what `appliance run` does without the variables
    for name, value in {"MODEL_PATH": "org/m", "PORT": "9000", "API_KEY": "sk-1"}.items():
        monkeypatch.setenv(name, value)
    config = build_config(path, env={})
    assert (config.model.path, config.api.port, config.api.api_key, config.parallelism.tp) == \
        ("org/m", 9000, "sk-1", 8)  # typed by the schema; TP unset takes the script's default


def test_tokenspeed(tmp_path: Path) -> None:
    (tr,) = fixture("tokenspeed_deepseek.sh")
    doc = assert_valid(tr, tmp_path)
    assert doc["speculative"] == {"algorithm": "MTP", "num_steps": 3}
    assert doc["scheduler"]["chunked_prefill_size"] == 8192 and tr.settings["parallelism.tp"].note
    assert doc["backends"]["attention"] == "trtllm_mla"
    assert doc["cache"]["host_cache_size_gb"] == 64 and doc["cache"]["host_cache"] is True  # KVStore: host tier
    assert not any(u.startswith("cache.host_cache:") for u in tr.unsupported)  # a size in GB: the tier runs it


def test_ts_alias_and_every_tokenspeed_flag_family(tmp_path: Path) -> None:
    (tr,) = translate("ts serve org/m --attn-tp-size 2 --moe-tp-size 2 --dense-tp-size 2 --world-size 2 "
                      "--no-enable-prefix-caching --enforce-eager\n")
    doc = assert_valid(tr, tmp_path)
    assert doc["parallelism"] == {"tp": 2, "moe_tp": 2, "dense_tp": 2, "world_size": 2}
    assert doc["cache"]["enable_prefix_caching"] is False and doc["backends"]["enforce_eager"] is True


def test_atlas_in_docker(tmp_path: Path) -> None:
    (tr,) = fixture("atlas_docker.sh")
    doc = assert_valid(tr, tmp_path)
    assert doc["model"]["path"] == "Qwen/Qwen3-Next-80B-A3B-Instruct"
    assert doc["api"]["host"] == "0.0.0.0" and doc["api"]["api_key_file"] == "/etc/atlas/tokens"
    assert doc["scheduler"]["policy"] == "slo" and doc["scheduler"]["slo_tbt_ms"] == 80.0
    assert doc["scheduler"]["chunked_prefill_size"] == -1  # Atlas 0 = no chunking
    assert doc["precision"]["kv_cache_dtype"] == "bfloat16" and doc["cache"]["enable_prefix_caching"] is True
    assert doc["api"]["port"] == 8888  # Atlas's default, kept
    assert doc["observability"]["dump_path"] == "/var/log/atlas.jsonl"
    assert doc["cache"]["ssm_cache_slots"] == 16  # the state-snapshot slots of hybrid models (Qwen3-Next)
    assert not any(u.startswith("cache.ssm_cache_slots:") for u in tr.unsupported)
    assert any(u.startswith("scheduler.policy:") for u in tr.unsupported)  # slo without chunked prefill


def test_atlas_speculative_and_no_abbreviations(tmp_path: Path) -> None:
    (tr,) = translate("spark serve org/m --dflash --draft-model z-lab/d --num-drafts 3 --tbt 50\n")
    doc = assert_valid(tr, tmp_path)
    assert doc["speculative"] == {"algorithm": "DFLASH", "draft_model_path": "z-lab/d", "num_steps": 3}
    assert "--tbt" in warned(tr)  # clap has no abbreviations: --tbt is not --tbt-deadline-ms


def test_abbreviations_no_booleans_and_ambiguity(tmp_path: Path) -> None:
    (tr,) = translate("vllm serve m --tensor 8 --no-enable-prefix --max-num 64 --max 3\n")
    doc = assert_valid(tr, tmp_path)
    assert doc["parallelism"]["tp"] == 8 and doc["cache"]["enable_prefix_caching"] is False
    assert "ambiguous abbreviation" in warned(tr)
    assert "--max-num" in warned(tr)  # --max-num-seqs or --max-num-batched-tokens: ambiguous too


def test_chunked_prefill_off_moves_the_budget(tmp_path: Path) -> None:
    (tr,) = translate("vllm serve m --no-enable-chunked-prefill --max-num-batched-tokens 32768\n")
    doc = assert_valid(tr, tmp_path)
    assert doc["scheduler"] == {"chunked_prefill_size": -1, "max_prefill_tokens": 32768}


def test_backend_names_are_mapped_with_notes(tmp_path: Path) -> None:
    (tr,) = translate("VLLM_ATTENTION_BACKEND=FLASHINFER vllm serve m --all2all-backend deepep_low_latency "
                      "-tp 2 -ep\n")
    doc = assert_valid(tr, tmp_path)
    assert doc["backends"] == {"attention": "flashinfer", "all2all": "deepep", "deepep_mode": "low_latency"}
    assert tr.settings["backends.attention"].note
    # a backend this build lacks is still written, and start-up refuses it (tr.unsupported is support.py's list)
    (tr,) = translate("vllm serve m --attention-backend ROCM_AITER_FA\n")
    assert assert_valid(tr, tmp_path)["backends"] == {"attention": "rocm_aiter_fa"}
    assert any(u.startswith("backends.attention:") for u in tr.unsupported)
    (tr,) = translate("vllm serve m --attention-backend HPC_ATTN\n")  # newer than the table: lower-cased, kept
    assert tr.settings["backends.attention"].value == "hpc_attn" and tr.unmapped == []
    assert any(u.startswith("backends.attention:") for u in tr.unsupported)
    (tr,) = translate("vllm serve m --attention-backend 'NO SUCH'\n")  # not a name at all: a warning
    assert "NO SUCH" in warned(tr) and tr.unmapped and "backends.attention" not in tr.settings


def test_bash_c_inside_docker(tmp_path: Path) -> None:
    (tr,) = translate('docker run --gpus all lmsysorg/sglang:latest bash -c '
                      '"python3 -m sglang.launch_server --model-path org/m --tp-size 2 --port 30001"\n')
    doc = assert_valid(tr, tmp_path)
    assert doc["parallelism"]["tp"] == 2 and doc["api"]["port"] == 30001


def test_unknown_flags_are_reported_not_dropped() -> None:
    (tr,) = translate("vllm serve m --definitely-not-a-flag 3 --tp 2\n")
    assert "--definitely-not-a-flag" in warned(tr) and len(tr.unmapped) == 1
    assert tr.get("parallelism.tp") == 2 and tr.settings["parallelism.tp"].note  # --tp: not vLLM's, noted


def test_inconsistent_source_is_reported_by_validation() -> None:
    (tr,) = translate("python -m sglang.launch_server --model-path m --nnodes 2 --node-rank 1 --tp 16\n")
    assert any("dist_init_addr" in p for p in tr.problems)


@pytest.mark.parametrize("text", ["", "ls -la\necho hi\n", "vllm serve 'unterminated\n"])
def test_unreadable_inputs(text: str) -> None:
    with pytest.raises(TranslateError):
        translate(text)


def test_random_flag_soup_never_crashes() -> None:
    """Any mix of real flags and odd values gives TOML that parses (or a TranslateError), never a crash."""
    import random

    from appliance.translate.tables import TABLES

    rng = random.Random(7)
    launch = {"vllm": "vllm serve org/m", "sglang": "python -m sglang.launch_server --model-path m",
              "tokenspeed": "ts serve m", "atlas": "spark serve m"}
    values = ["1", "2", "0.5", "true", "auto", "fp8", "'{\"a\": 1}'", "'{\"method\": \"mtp\"}'", "$X", "<M>", "-1",
              "1 2 4"]
    for _ in range(300):
        engine = rng.choice(list(TABLES))
        names = [n for f in TABLES[engine].flags for n in f.names]
        words = [launch[engine]]
        for _ in range(rng.randint(0, 6)):
            words.append(rng.choice(names) + rng.choice(["", "=1"]))
            if rng.random() < 0.7:
                words.append(rng.choice(values))
        for tr in translate(" ".join(words) + "\n"):
            parsed = {k: v for k, v in tomllib.loads(to_toml(tr)).items() if v}
            assert parsed == tr.document()


def test_settings_this_build_cannot_honour_are_surfaced(tmp_path: Path) -> None:
    from appliance.config import check_supported

    (tr,) = fixture("vllm_short_forms.sh")
    path = tmp_path / "o.toml"
    path.write_text(to_toml(tr))
    assert tr.unsupported == check_supported(build_config(path, env={}))
    for message in tr.unsupported:
        assert message.split(":")[0] in to_toml(tr).split("\n\n")[0]  # listed in the header comments


def test_dotted_json_forms_merge_into_the_json_value(tmp_path: Path) -> None:
    (tr,) = translate("vllm serve m --hf-overrides '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 2}}' "
                      "--hf-overrides.rope_scaling.factor 4 --rope-theta 1e6 --kv-events-config.publisher zmq "
                      "--kv-events-config.enable_kv_cache_events true\n")
    doc = assert_valid(tr, tmp_path)
    assert doc["model"]["hf_overrides"] == {"rope_scaling": {"rope_type": "yarn", "factor": 4}, "rope_theta": 1e6}
    assert doc["observability"]["kv_events"] == {"publisher": "zmq", "enable_kv_cache_events": True}
