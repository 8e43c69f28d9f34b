"""`appliance serve MODEL --flags`: every flag of the seeds 000/001, their syntax, JSON flags, errors."""
from __future__ import annotations

import json

import pytest

from appliance.config import ConfigError, parse_serve_args
from appliance.config.flags import flag_table

# Every flag named in seeds 000 (TokenSpeed server parameters) and 001 (compatible parameters), minus the
# families without members (--kvstore-*, --disaggregation-*) and the vLLM recipe flag 001 says to review.
SEED_FLAGS = """--all2all-backend --api-key --attention-backend --attn-tp-size --block-size --chat-template
--chunked-prefill-size --comm-fusion-max-num-tokens --cudagraph-capture-sizes --data-parallel-size
--decode-log-interval --deepep-mode --dense-tp-size --device --dist-init-addr --download-dir --dp-sampling
--draft-moe-backend --drafter-attention-backend --dtype --eagle3-layers-to-capture --enable-allreduce-fusion
--enable-cache-report --enable-custom-logit-processor --enable-expert-parallel --enable-log-requests
--enable-metrics --enable-mla-l1-5-cache --enable-prefix-caching --enforce-eager --ep-size --expert-parallel-size
--gpu-memory-utilization --hf-overrides --host --kv-cache-dtype --kv-cache-quant-method --kv-events-config
--load-format --log-level --log-level-http --log-requests-level --max-cudagraph-capture-size --max-model-len
--max-num-seqs --max-prefill-tokens --max-total-tokens --metrics-reporters --mla-chunk-multiplier --model
--moe-backend --moe-tp-size --nnodes --no-enable-prefix-caching --node-rank --nprocs-per-node --port
--quantization --quantization-param-path --reasoning-parser --revision --sampling-backend --served-model-name
--skip-tokenizer-init --speculative-algorithm --speculative-config --speculative-draft-model-path
--speculative-draft-model-quantization --speculative-eagle-topk --speculative-num-draft-tokens
--speculative-num-steps --stream-interval --stream-output --tensor-parallel-size --tokenizer --tokenizer-mode
--tool-call-parser --tp --trust-remote-code --world-size""".split()


def test_every_seed_flag_has_a_home() -> None:
    known = set(flag_table()) | {"--no-" + n[2:] for n, s in flag_table().items() if s.kind == "bool"}
    assert sorted(set(SEED_FLAGS) - known) == []


def test_a_tokenspeed_command_line_works() -> None:
    argv = ["Qwen/Qwen3-8B", "--tp", "2", "--max-num-seqs", "64", "--kv-cache-dtype", "fp8", "--port", "9000",
            "--max-model-len", "4096", "--no-enable-prefix-caching", "--trust-remote-code",
            "--gpu-memory-utilization", "0.8", "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen",
            "--chunked-prefill-size", "-1", "--cudagraph-capture-sizes", "1", "2", "4",
            "--hf-overrides", '{"rope_theta": 1e6}',
            "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": "tcp://*:5557", "topic": "kv-events"})]
    c = parse_serve_args(argv, env={})
    assert c.model.path == "Qwen/Qwen3-8B" and c.parallelism.tp == 2 and c.scheduler.max_num_seqs == 64
    assert c.precision.kv_cache_dtype == "fp8" and c.api.port == 9000 and c.model.max_model_len == 4096
    assert c.cache.enable_prefix_caching is False and c.model.trust_remote_code is True
    assert c.cache.gpu_memory_utilization == 0.8 and c.scheduler.chunked_prefill_size == -1
    assert (c.api.reasoning_parser, c.api.tool_call_parser) == ("qwen3", "qwen")
    assert c.backends.cuda_graph_sizes == [1, 2, 4] and c.model.hf_overrides == {"rope_theta": 1e6}
    kv = c.observability.kv_events
    assert kv.enable_kv_cache_events and kv.publisher == "zmq" and kv.endpoint == "tcp://*:5557"
    assert kv.topic == "kv-events"


def test_speculative_config_json_and_separate_flags() -> None:
    vllm = parse_serve_args(["--speculative-config", '{"method": "eagle3", "model": "d/e", '
                             '"num_speculative_tokens": 5}'], env={})
    s = vllm.speculative
    assert (s.algorithm, s.draft_model_path, s.num_steps, s.effective_num_draft_tokens) == ("EAGLE3", "d/e", 5, 6)
    flags = parse_serve_args(["--speculative-algorithm", "MTP", "--speculative-num-steps", "1",
                              "--speculative-num-draft-tokens", "2", "--speculative-eagle-topk", "1"], env={})
    assert (flags.speculative.algorithm, flags.speculative.num_draft_tokens) == ("MTP", 2)
    with pytest.raises(ConfigError, match="speculative.draft_model_path"):
        parse_serve_args(["--speculative-algorithm", "EAGLE"], env={})


def test_bool_flag_forms() -> None:
    assert parse_serve_args(["--enable-prefix-caching", "false"], env={}).cache.enable_prefix_caching is False
    assert parse_serve_args(["--no-enable-prefix-caching", "--enable-prefix-caching"],
                            env={}).cache.enable_prefix_caching is True  # the later flag wins
    assert parse_serve_args(["--enforce-eager"], env={}).backends.enforce_eager is True
    with pytest.raises(ConfigError, match="true or false"):
        parse_serve_args(["--enforce-eager", "maybe"], env={})


def test_flags_config_file_set_and_env_layers(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[parallelism]\ntp = 4\n[api]\nport = 1\n")
    env = {"APPLIANCE_API__PORT": "2", "APPLIANCE_SCHEDULER__MAX_NUM_SEQS": "3"}
    c = parse_serve_args(["--config", str(f), "--max-num-seqs", "5", "--set", "api.port=7", "--tp", "2"], env=env)
    assert (c.parallelism.tp, c.api.port, c.scheduler.max_num_seqs) == (2, 7, 5)


@pytest.mark.parametrize("argv,needle", [
    (["--tpp", "2"], "did you mean '--tp'"),
    (["--max-num-seq", "2"], "did you mean '--max-num-seqs'"),
    (["--max-num-batched-tokens", "2"], "--chunked-prefill-size"),
    (["--kv-cache-dtype", "fp7"], "precision.kv_cache_dtype"),
    (["--port", "http"], "api.port"),
    (["--kv-events-config", "{not json"], "not valid JSON"),
    (["--hf-overrides", "[1]"], "JSON object"),
    (["m1", "--model", "m2"], "both positionally and with --model"),
    (["--tp"], "expected one argument"),
])
def test_bad_command_lines(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_serve_args(argv, env={})
    assert needle in str(info.value)
