"""`appliance translate` on real launch commands: the corpus in tests/fixtures/translate/corpus (each file names the
public recipe or doc it was copied from) and one test per kind of command the translator once dropped."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from appliance.config import build_config
from appliance.config.errors import ConfigError
from appliance.config.loader import resolve
from appliance.translate.emit import to_toml
from appliance.translate.result import Translation
from appliance.translate.translator import translate_text
from tools import translate_corpus

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fixtures" / "translate" / "corpus"


def corpus(name: str) -> list[Translation]:
    """The translations of one corpus script, by its file name (with or without the number)."""
    (path,) = list(CORPUS.glob(f"{name}.sh")) or list(CORPUS.glob(f"*_{name}.sh"))
    return translate_text(path.read_text(), path.parent).translations


def one(text: str) -> Translation:
    (tr,) = translate_text(text).translations
    return tr


def validated(tr: Translation, tmp_path: Path) -> list[str]:
    """The TOML as `appliance validate` judges it: raises on errors, returns the warnings."""
    path = tmp_path / "out.toml"
    path.write_text(to_toml(tr))
    return [p.format() for p in resolve(path, env={}, run_env=False).warnings]


def notes(tr: Translation) -> str:
    return "\n".join(f"{f.subject}: {f.message}" for f in tr.findings if f.level == "note")


def value(tr: Translation, path: str) -> object:
    return tr.settings[path].value


def test_every_corpus_file_names_its_public_source() -> None:
    files = sorted(CORPUS.glob("*.sh"))
    assert len(files) >= 80
    for path in files:
        assert re.match(r"# source: https://github\.com/[\w.-]+/[\w.-]+/blob/[0-9a-f]{40}/", path.read_text()), path


def test_corpus_translates_validates_and_carries_its_settings() -> None:
    report = translate_corpus.measure(CORPUS)
    assert report.failures == []
    assert report.translated == report.scripts >= 80 and report.valid == report.commands >= report.scripts
    assert report.outcomes["pending"] <= 1  # one JSON document with a placeholder inside: not valid JSON
    assert report.exact_share >= 0.975, report.summary()  # the rest are notes: torch.compile, PD transfer, ...


def test_placeholders_become_environment_interpolation(tmp_path: Path) -> None:
    (tr,) = corpus("111_vllm_moonshotai_kimi_k2_5")[:1]  # docs-style <prefill_http_port_rank0> placeholders
    assert value(tr, "api.port") == "${oc.env:PREFILL_HTTP_PORT_RANK0}"
    assert value(tr, "parallelism.dist_init_addr") == "${oc.env:PREFILL_DP_LEADER_IP}:${oc.env:PREFILL_DP_RPC_PORT}"
    warnings = validated(tr, tmp_path)
    assert any("environment variable PREFILL_HTTP_PORT_RANK0 is not set here" in w for w in warnings)
    head, _ = corpus("094_vllm_moonshotai_kimi_k2_instruct")[:2]  # --data-parallel-address $MASTER_IP ...
    assert value(head, "parallelism.dist_init_addr") == "${oc.env:MASTER_IP}:${oc.env:PORT}"
    assert value(head, "parallelism.nnodes") == 2 and validated(head, tmp_path)


def test_shell_defaults_and_command_substitutions(tmp_path: Path) -> None:
    tr = one("python -m sglang.launch_server --model-path m --tp ${TP:-2} --host ${local_ip} "
             "--dist-init-addr $(hostname -I):5000 --nnodes 2 --node-rank 0\n")
    assert value(tr, "parallelism.tp") == "${oc.env:TP,2}"
    assert value(tr, "api.host") == "${oc.env:local_ip}"
    assert value(tr, "parallelism.dist_init_addr") == "$(hostname_-I):5000"  # no variable names it: verbatim
    assert "replace it before use" in notes(tr)
    validated(tr, tmp_path)


def test_interpolated_values_resolve_when_the_deployment_starts(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tr = one("vllm serve $MODEL --port $PORT -tp ${TP:-2}\n")
    path = tmp_path / "out.toml"
    path.write_text(to_toml(tr))
    with pytest.raises(ConfigError, match="MODEL is not set"):
        build_config(path, env={})
    monkeypatch.setenv("MODEL", "org/m")
    monkeypatch.setenv("PORT", "8123")
    config = build_config(path, env={})
    assert (config.model.path, config.api.port, config.parallelism.tp) == ("org/m", 8123, 2)


def test_eagle_without_a_draft_model_is_mtp_on_mtp_architectures(tmp_path: Path) -> None:
    for name, model in (("sglang_deepseek_v3_mtp", "DeepSeek-V3"), ("sglang_mimo_mtp", "MiMo"),
                        ("sglang_glm46_eagle", "GLM-4.6")):
        (tr,) = corpus(name)
        assert value(tr, "speculative.algorithm") == "MTP", name
        assert model in tr.settings["speculative.algorithm"].note and validated(tr, tmp_path) is not None
    (tr,) = corpus("sglang_eagle3_llama")  # a real draft model: stays EAGLE3 with it
    assert value(tr, "speculative.algorithm") == "EAGLE3"
    assert value(tr, "speculative.draft_model_path") == "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B"


def test_standalone_draft_model_and_draft_from_the_environment(tmp_path: Path) -> None:
    (tr,) = corpus("sglang_standalone_draft")
    assert value(tr, "speculative.algorithm") == "STANDALONE"
    assert value(tr, "speculative.draft_model_path") == "Qwen/Qwen2.5-1.5B-Instruct"
    tr = one("python3 -m sglang.launch_server --model Qwen/Qwen2.5-7B-Instruct --speculative-algorithm "
             "STANDALONE --speculative-draft-model-path $DRAFT_MODEL\n")
    assert value(tr, "speculative.draft_model_path") == "${oc.env:DRAFT_MODEL}"
    assert not any("speculative.algorithm" in u for u in tr.unsupported)  # a standalone draft model is built
    validated(tr, tmp_path)
    tr = one("export DRAFT=Qwen/Qwen3-0.6B\nvllm serve Qwen/Qwen3-8B --speculative-config "
             "'{\"model\": \"'$DRAFT'\", \"num_speculative_tokens\": 4}'\n")
    assert value(tr, "speculative.draft_model_path") == "Qwen/Qwen3-0.6B"
    assert value(tr, "speculative.algorithm") == "STANDALONE"  # no method: vLLM's draft_model


@pytest.mark.parametrize(("config", "expected"), [
    ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}',
     {"algorithm": "NGRAM", "num_steps": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
    ('{"method": "eagle3", "model": "org/eagle3", "num_speculative_tokens": 3}',
     {"algorithm": "EAGLE3", "draft_model_path": "org/eagle3", "num_steps": 3}),
    ('{"method": "eagle", "model": "org/eagle", "num_speculative_tokens": 2}',
     {"algorithm": "EAGLE", "draft_model_path": "org/eagle", "num_steps": 2}),
    ('{"method": "draft_model", "model": "org/small", "num_speculative_tokens": 4}',
     {"algorithm": "STANDALONE", "draft_model_path": "org/small", "num_steps": 4}),
    ('{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}', {"algorithm": "MTP", "num_steps": 2}),
    ('{"method": "mtp", "num_speculative_tokens": 1}', {"algorithm": "MTP", "num_steps": 1}),
    ('{"method": "ngram_gpu", "num_speculative_tokens": 4, "prompt_lookup_max": 5}',
     {"algorithm": "NGRAM", "ngram_proposer": "device", "num_steps": 4, "prompt_lookup_max": 5}),
    ('{"method": "eagle3", "model": "org/e", "num_speculative_tokens": 3, "disable_by_batch_size": 30}',
     {"algorithm": "EAGLE3", "draft_model_path": "org/e", "num_steps": 3, "disable_by_batch_size": 30}),
])
def test_vllm_speculative_config(config: str, expected: dict[str, object], tmp_path: Path) -> None:
    tr = one(f"vllm serve org/m --speculative-config '{config}'\n")
    assert tr.document()["speculative"] == expected
    validated(tr, tmp_path)


def test_ngram_on_the_device_round_trips_through_vllm() -> None:
    from appliance.translate.reverse import to_command

    tr = one("vllm serve org/m --speculative-config.method ngram_gpu --speculative-config.num_speculative_tokens 3\n")
    assert tr.document()["speculative"] == {"algorithm": "NGRAM", "ngram_proposer": "device", "num_steps": 3}
    command = to_command({"model": {"path": "org/m"}, "speculative": {"algorithm": "NGRAM", "ngram_proposer": "device",
                                                                       "num_steps": 3}}, "vllm")
    assert '"method": "ngram_gpu"' in command.render() and command.inexpressible == {}
    assert one(command.render() + "\n").document()["speculative"] == tr.document()["speculative"]
    host = to_command({"speculative": {"algorithm": "NGRAM", "num_steps": 3}}, "vllm")
    assert '"method": "ngram"' in host.render()


def test_sglang_and_tokenspeed_speculative_flags(tmp_path: Path) -> None:
    tr = one("python -m sglang.launch_server --model-path org/m --speculative-algorithm NGRAM "
             "--speculative-ngram-min-match-window-size 1 --speculative-ngram-max-match-window-size 8\n")
    assert tr.document()["speculative"] == {"algorithm": "NGRAM", "prompt_lookup_min": 1, "prompt_lookup_max": 8}
    tr = one("tokenspeed serve org/m --speculative-algorithm EAGLE3 --speculative-draft-model-path org/d "
             "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4\n")
    assert tr.document()["speculative"] == {"algorithm": "EAGLE3", "draft_model_path": "org/d", "num_steps": 3,
                                            "eagle_topk": 1, "num_draft_tokens": 4}
    tr = one("spark serve org/m --ngram-speculative --num-drafts 4\n")
    assert tr.document()["speculative"] == {"algorithm": "NGRAM", "num_steps": 4}
    tr = one("spark serve org/m --speculative --draft-model org/d\n")  # MTP needs no draft: noted, not kept
    assert tr.document()["speculative"] == {"algorithm": "MTP"} and "org/d" in notes(tr)
    validated(tr, tmp_path)


def test_parser_names_are_kept_and_refused_when_missing(tmp_path: Path) -> None:
    (tr,) = corpus("sglang_deepseek_v3_tools")
    assert value(tr, "api.tool_call_parser") == "deepseek_v3"  # SGLang spells it deepseekv3
    cases = {"deepseek_v32": "deepseek_v32", "kimi_k2": "kimik2", "glm47": "glm47", "minimax_m2": "minimax_m2",
             "step3p5": "step3p5", "qwen3_coder": "qwen3_coder", "gpt-oss": "gpt_oss", "deepseekv32": "deepseek_v32"}
    for given, kept in cases.items():
        tr = one(f"python -m sglang.launch_server --model-path org/m --tool-call-parser {given}\n")
        assert value(tr, "api.tool_call_parser") == kept, given
        validated(tr, tmp_path)
    tr = one("vllm serve org/m --reasoning-parser seed_oss --tool-call-parser seed_oss --enable-auto-tool-choice\n")
    assert tr.document()["api"] == {"reasoning_parser": "seed_oss", "tool_call_parser": "seed_oss"}
    assert {u.split(":")[0] for u in tr.unsupported} >= {"api.reasoning_parser", "api.tool_call_parser"}
    assert "--enable-auto-tool-choice" in to_toml(tr)  # kept as a note: parsing follows the parser setting
    for reasoning, tools in (("qwen3", "hermes"), ("glm45", "glm47"), ("openai_gptoss", "openai")):
        tr = one(f"vllm serve org/m --reasoning-parser {reasoning} --tool-call-parser {tools}\n")
        assert tr.unsupported == []  # parsers this build has start


def test_pipeline_and_decode_context_parallel(tmp_path: Path) -> None:
    tr = corpus("093_vllm_moonshotai_kimi_k2_instruct")[-1]  # -tp 8 --pipeline-parallel-size 2 ... -dcp 8
    doc = tr.document()["parallelism"]
    assert doc["tp"] == 8 and doc["pp"] == 2 and doc["dcp"] == 8
    assert {u.split(":")[0] for u in tr.unsupported} >= {"parallelism.pp", "parallelism.dcp"}
    validated(tr, tmp_path)
    tr = one("python3 -m sglang.launch_server --model-path org/m --tp-size 8 --pp-size 2 --nnodes 2 "
             "--node-rank 1 --dist-init-addr 10.0.0.1:5000\n")
    assert tr.document()["parallelism"] == {"tp": 8, "pp": 2, "nnodes": 2, "node_rank": 1,
                                            "dist_init_addr": "10.0.0.1:5000"}
    validated(tr, tmp_path)


def test_backend_and_quantization_names_are_written(tmp_path: Path) -> None:
    tr = one("VLLM_ATTENTION_BACKEND=FLASH_ATTN vllm serve org/m\n")
    assert value(tr, "backends.attention") == "fa3" and tr.settings["backends.attention"].note
    for line, key, expected in (
            ("vllm serve org/m --attention-backend ROCM_AITER_MLA", "backends.attention", "rocm_aiter_mla"),
            ("python -m sglang.launch_server --model-path org/m --attention-backend ascend", "backends.attention",
             "ascend"),
            ("python -m sglang.launch_server --model-path org/m --moe-runner-backend deep_gemm", "backends.moe",
             "deep_gemm"),
            ("python -m sglang.launch_server --model-path org/m --quantization moe_wna16", "precision.quantization",
             "moe_wna16"),
            ("vllm serve org/m --quantization awq_marlin", "precision.quantization", "awq_marlin")):
        tr = one(line + "\n")
        assert value(tr, key) == expected, line
        assert any(u.startswith(key + ":") for u in tr.unsupported), line
        validated(tr, tmp_path)


@pytest.mark.parametrize(("flags", "expected"), [
    ("--kv-cache-dtype fp8", {"kv_cache_dtype": "fp8"}),
    ("--kv-cache-dtype fp8_e4m3 --quantization-param-path scales.json",
     {"kv_cache_dtype": "fp8_e4m3", "quantization_param_path": "scales.json"}),
    ("--kv-cache-dtype fp8_e5m2 --quantization modelopt", {"kv_cache_dtype": "fp8_e5m2", "quantization": "modelopt"}),
    ("--quantization compressed-tensors", {"quantization": "compressed-tensors"}),
    ("--quantization w8a8_fp8", {"quantization": "w8a8_fp8"}),
])
def test_fp8_spellings(flags: str, expected: dict[str, str], tmp_path: Path) -> None:
    for launcher in ("vllm serve org/m", "python -m sglang.launch_server --model-path org/m",
                     "tokenspeed serve org/m"):
        tr = one(f"{launcher} {flags}\n")
        assert tr.document()["precision"] == expected, launcher
        validated(tr, tmp_path)
    tr = one("tokenspeed serve org/m --kv-cache-dtype fp8 --kv-cache-quant-method per_token_head\n")
    assert value(tr, "precision.kv_cache_quant_method") == "per_token_head"


def test_host_kv_tiers(tmp_path: Path) -> None:
    (tr,) = corpus("sglang_hicache_hf3fs")
    cache = tr.document()["cache"]
    assert cache["host_cache"] is True and cache["host_cache_ratio"] == 2
    assert cache["host_cache_storage_backend"] == "hf3fs" and cache["host_cache_write_policy"] == "write_through"
    assert any(u.startswith("cache.host_cache:") for u in tr.unsupported)
    validated(tr, tmp_path)
    tr = one("tokenspeed serve org/m --kvstore-ratio 4 --kvstore-io-backend kernel\n")
    assert tr.document()["cache"] == {"host_cache": True, "host_cache_ratio": 4, "host_cache_io_backend": "kernel"}
    tr = one("tokenspeed serve org/m --disable-kvstore\n")
    assert tr.document()["cache"] == {"host_cache": False} and tr.unsupported == []
    tr = one("spark serve org/m --high-speed-swap --high-speed-swap-dir /nvme/kv --high-speed-swap-gb 200 "
             "--ssm-cache-slots 64 --ssm-checkpoint-interval 512 --scheduling-policy slai --tbt-deadline-ms 40\n")
    doc = tr.document()
    assert {k: doc["cache"][k] for k in ("disk_cache", "disk_cache_dir", "disk_cache_size_gb", "ssm_cache_slots",
                                         "ssm_checkpoint_interval")} == \
        {"disk_cache": True, "disk_cache_dir": "/nvme/kv", "disk_cache_size_gb": 200, "ssm_cache_slots": 64,
         "ssm_checkpoint_interval": 512}
    assert doc["scheduler"]["policy"] == "slo" and doc["scheduler"]["slo_tbt_ms"] == 40
    unsupported = {u.split(":")[0] for u in tr.unsupported}
    assert "cache.disk_cache" in unsupported  # Atlas's disk swap without the host tier it sits behind here
    # honoured for hybrid linear-attention models (state snapshots, engine/state_snapshots.py)
    assert not unsupported & {"cache.ssm_cache_slots", "cache.ssm_checkpoint_interval"}
    validated(tr, tmp_path)


def test_config_heredoc_model_variables_router_and_docker(tmp_path: Path) -> None:
    (tr,) = corpus("sglang_config_heredoc")  # cat > config.yaml << EOF ... --config config.yaml
    assert tr.document()["model"] == {"path": "meta-llama/Meta-Llama-3-8B-Instruct"}
    assert tr.document()["parallelism"] == {"tp": 2} and value(tr, "observability.enable_metrics") is True
    (tr,) = corpus("sglang_hicache_mooncake")  # --model-path $MODEL_PATH
    assert value(tr, "model.path") == "${oc.env:MODEL_PATH}"
    (tr,) = corpus("sglang_router_dp")
    assert tr.engine == "sglang" and tr.document()["parallelism"] == {"tp": 2, "dp": 2}
    tr = one("python -m sglang_router.launch_server --model-path org/m --dp-size 4 --router-policy cache_aware\n")
    assert "--router-policy" in "\n".join(f.subject for f in tr.findings)
    (tr,) = corpus("sglang_docker_multinode")
    assert value(tr, "parallelism.dist_init_addr") == "192.168.114.10:20000"
    tr = one("docker run --gpus all --entrypoint python3 lmsysorg/sglang:latest -m sglang.launch_server "
             "--model-path org/m --tp 2\n")
    assert tr.engine == "sglang" and value(tr, "parallelism.tp") == 2
    tr = one("alias dr='docker run --rm -it --gpus all --ipc=host'\n"
             "dr vllm/vllm-openai:latest --model org/m --tensor-parallel-size 4\n")
    assert tr.engine == "vllm" and value(tr, "parallelism.tp") == 4
    validated(tr, tmp_path)


def test_validate_never_checks_the_embedded_model_in_place_of_the_configured_one(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text('[model]\npath = "${oc.env:MODEL}"\n[parallelism]\ntp = 8\n')
    warnings = [p.message for p in resolve(path, env={}, run_env=False).warnings]
    assert any("MODEL is not set" in w for w in warnings)
    assert any("checks against the model's config are skipped" in w for w in warnings)
    path.write_text('[model]\npath = "/nowhere/DeepSeek-V3"\n[parallelism]\ntp = 8\n')
    assert resolve(path, env={}, run_env=False).config.parallelism.tp == 8  # no "4 attention heads" error
    path.write_text("[parallelism]\ntp = 8\n")  # no path: the embedded model is the one named, and checked
    with pytest.raises(ConfigError, match="attention heads are not divisible by tp 8"):
        resolve(path, env={}, run_env=False)


@pytest.mark.parametrize("line", [
    "$ vllm serve org/m -tp 2",  # a copied prompt
    "(venv) $ vllm serve org/m -tp 2",
    "kubectl exec pod-0 -- vllm serve org/m -tp 2",
    "ray job submit -- vllm serve org/m -tp 2",
    "uvx vllm serve org/m -tp 2",
    "apptainer exec --nv -B /models:/models vllm.sif vllm serve org/m -tp 2",
    "torchrun --nproc-per-node 2 -m sglang.launch_server --model-path org/m --tp 2",
    ("docker run --gpus all --entrypoint /bin/bash lmsysorg/sglang -c 'python3 -m sglang.launch_server "
     "--model-path org/m --tp 2'"),
])
def test_launch_wrappers(line: str) -> None:
    tr = one(line + "\n")
    assert value(tr, "model.path") == "org/m" and value(tr, "parallelism.tp") == 2


def test_multimodal_settings_are_written_and_refused_unless_text_only(tmp_path: Path) -> None:
    tr = one("vllm serve Qwen/Qwen3-VL-8B --mm-encoder-tp-mode data --mm-processor-cache-gb 32 "
             "--limit-mm-per-prompt '{\"image\": 4}' --limit-mm-per-prompt.video 0\n")
    assert tr.document()["multimodal"] == {"encoder_tp_mode": "data", "processor_cache_gb": 32,
                                           "limit_per_prompt": {"image": 4, "video": 0}}
    assert any(u.startswith("multimodal:") for u in tr.unsupported)
    validated(tr, tmp_path)
    tr = one("vllm serve Qwen/Qwen3-VL-8B --limit-mm-per-prompt '{\"image\": 0, \"video\": 0}' "
             "--mm-processor-cache-gb 0 --language-model-only\n")
    assert tr.document()["multimodal"] == {"limit_per_prompt": {"image": 0, "video": 0}, "processor_cache_gb": 0}
    assert tr.unsupported == []  # text only: what this build serves
