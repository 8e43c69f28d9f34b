#!/usr/bin/env bash
# The published single-GPU figures (docs/benchmarks.md), ours and the peer's (vLLM 0.26) on the same machine, with
# `appliance bench`. Each part runs in under 10 minutes on an H100 80GB; `all` runs every part in turn.
#
#   bash benchmarks/gpu_suite.sh PART [PART...]     # results: $OUT (or $BENCH_OUT, else a temp dir), then a table
#
# Parts (ours, then the same workload through the peer):
#   b1        Llama-3.1-8B shape, dummy bf16 weights: batch 1, 1024 in / 256 out: ms per output token (TPOT)
#             `appliance bench latency --preset llama-3.1-8b`
#   qwen      Qwen3-0.6B shape: 256 sequences, prompt and output lengths uniform in [100, 1024], seed 0: output tok/s
#             `appliance bench throughput --preset qwen3-0.6b`
#   tput8b    Llama-3.1-8B: NUM_PROMPTS (default 1000) x 1024 in / 1024 out: output tok/s, with the engine's step
#             budget and with recipes/llama-3.1-8b.toml's (scheduler.chunked_prefill_size = 640)
#             `appliance bench throughput --preset llama-3.1-8b [--set scheduler.chunked_prefill_size=640]`
#   serve     `appliance serve` on the 8B shape (a word-level tokenizer of its vocabulary), measured by
#             `appliance bench serve` at max concurrency 1 / 16 / 64 / 256 (8 / 64 / 192 / 512 prompts, 1024 in /
#             256 out, ignore_eos, greedy); the start-up to /health 200 is the cold start
#   peer-small  the peer's b1 and qwen;  peer-8b  the peer's 8B throughput;  peer-serve  `vllm serve`, same levels
#   gputests  every test file with a `gpu` test (or those GPU_TEST_FILES names), one pytest per file (-m gpu) under
#             GPU_TEST_TIMEOUT_S (default 150), each file's outcome appended to gpu_tests.txt as it ends (a part cut
#             short keeps what finished), its log in gpu_test_logs/
#   spec      `python -m benchmarks.spec_decode`: EAGLE-3 at forced acceptance 2.6 / 1, batch 1 and 32, n-gram,
#             against plain decoding of the same build
#   fp8       `python -m benchmarks.fp8 --sections gemv,batch1,capacity,qwen3`;  fp8tput  its 1000 x 1024/1024 section
#   models    `python -m benchmarks.models` (gpt-oss-20b, Gemma-3-12B, then gpt-oss-20b with its experts kept in MXFP4:
#             batch 1, throughput, KV per sequence)
#   hybrid    `python -m benchmarks.hybrid` (the Qwen3-Next shape; fla-core from .whl, tools/device_wheels.sh WITH_FLA=1)
#   hybrid-turns  its multi-turn rows alone (`--multi-turn-only`), each phase's extra second turn profiled into
#             hybrid_profile/ (`--profile`: Chrome traces, ops by device time)
#   peer-models  the peer on part models' workloads of gpt-oss-20b and Gemma-3-12B: `python -m benchmarks.models
#             --write-configs` writes the model directories with their exact prompts, `python -m
#             benchmarks.peer_models` runs them through vLLM under the kit's Python path (one process per model; a
#             model it cannot run, or one the part's time leaves out, is a row with the cause)
#   peer-mxfp4   the same for gpt-oss-20b with its experts in MXFP4 (vLLM's MXFP4 experts, by config.json)
#   peer-hybrid  the same for part hybrid's Qwen3-Next shape (without, then with prefix caching)
#   coldstart `python -m benchmarks.cold_start`: `appliance serve` cold, warm and with the kernel list kept
#   summary   the table of whatever $OUT holds (every run ends with it)
#
# Set-up of the GPU machine (Python 3.12 with torch, triton, transformers and httpx, no internet):
#   1. here: `bash tools/device_wheels.sh` writes .whl/ (the server/config wheels that machine lacks); this script
#      installs them into /tmp/site when `import pydantic` fails there;
#   2. the peer kit (vLLM 0.26.0 trimmed to sm_90: run_vllm.sh, bench_vllm.py, mkcfg.py, its site tarball and
#      wheels) copied into .peer/ of the checkout (ignored by git);
#   3. copy the checkout with .whl/ and .peer/ to the GPU machine and run this script from its root, e.g.
#      `OUT=/tmp/out bash benchmarks/gpu_suite.sh b1 qwen peer-small`, `... tput8b`, `... peer-8b`,
#      `... serve peer-serve`. The installs land in /tmp/site (ours) and /tmp/vllm-site (the peer's) and later
#      commands on the same machine reuse them, so where a transfer is limited (the tree ~27 MB, .whl/ ~8 MB,
#      .peer/ ~39 MB) the first command can bring .whl/ and a later one .peer/.
# Limits per command: PART_TIMEOUT_S (default 560) bounds each part. The serve parts take SERVE_MODEL (a model dir
# with a tokenizer; default: the 8B shape written by appliance.bench.presets), SERVE_ARGS (default: --load-format
# dummy --dtype bfloat16), SERVE_LEVELS (concurrency:prompts, default "1:8 16:64 64:192 256:512") and SERVE_LENS (in:out,
# default 1024:256), so they can be dry-run on a CPU with a tiny model.
#   e.g. SERVE_MODEL=DIR SERVE_ARGS="--dtype float32" SERVE_LEVELS="1:2 2:4" SERVE_LENS=16:4 bash benchmarks/gpu_suite.sh serve
set -uo pipefail
cd "$(dirname "$0")/.."
ALL_PARTS=(b1 qwen tput8b serve peer-small peer-8b peer-serve gputests spec fp8 fp8tput models hybrid hybrid-turns
           peer-models peer-mxfp4 peer-hybrid coldstart)
for p in "$@"; do  # every part named is checked before anything is installed or run
  [[ " ${ALL_PARTS[*]} summary all " == *" $p "* ]] \
    || { echo "gpu_suite: unknown part $p (${ALL_PARTS[*]} summary all)" >&2; exit 2; }
done
py="${PYTHON:-python3}"
out="${OUT:-${BENCH_OUT:-$(mktemp -d)}}"
mkdir -p "$out"
limit="${PART_TIMEOUT_S:-560}"
models="${MODELS_DIR:-/tmp/appliance_bench_models}"
serve_model="${SERVE_MODEL:-$models/llama-3.1-8b}"
read -r -a serve_args <<< "${SERVE_ARGS:---load-format dummy --dtype bfloat16}"
levels="${SERVE_LEVELS:-1:8 16:64 64:192 256:512}"
lens="${SERVE_LENS:-1024:256}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if ! "$py" -c "import pydantic, zmq, starlette" 2>/dev/null && [[ -d /tmp/site ]]; then
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # installed by an earlier command on this machine
fi
if ! "$py" -c "import pydantic, zmq, starlette" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  echo "== installing .whl/ into /tmp/site" >&2
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_suite: installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:-$PWD}"

bench() { timeout --kill-after=10 "$limit" "$py" -m appliance.cli.main bench "$@" --disable-tqdm; }
peer() {
  [[ -f .peer/run_vllm.sh ]] || { echo "gpu_suite: .peer/run_vllm.sh is missing (see the set-up above)" >&2; return 1; }
  timeout --kill-after=10 "$limit" bash .peer/run_vllm.sh "$@"
}
# peer_python ARGS...: python3 with the kit's vLLM tree and environment (run_vllm.sh installs the tree before it
# reads its arguments, so a call without any installs it) and this checkout for our benchmarks/ modules
peer_python() {
  [[ -f .peer/run_vllm.sh ]] || { echo "gpu_suite: .peer/run_vllm.sh is missing (see the set-up above)" >&2; return 1; }
  [[ -f /tmp/vllm-site/.ok ]] || bash .peer/run_vllm.sh >/dev/null 2>&1
  [[ -f /tmp/vllm-site/.ok ]] || { echo "gpu_suite: installing the peer kit into /tmp/vllm-site failed" >&2; return 1; }
  env PYTHONPATH="/tmp/vllm-site:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 \
    timeout --kill-after=10 "$limit" python3 "$@"
}

# peer_family NAME OURS_MODULE [--only MODEL...]: write OURS_MODULE's model directories (those models), then run
# them through the peer; its records go to $out/NAME.json
peer_family() {
  local name="$1" module="$2"; shift 2
  rm -rf "$out/${name}_dirs"
  timeout --kill-after=10 "$limit" "$py" -m "$module" --write-configs "$out/${name}_dirs" "$@" >/dev/null || return 1
  peer_python -m benchmarks.peer_models "$out/${name}_dirs" --deadline-s "$((limit - 20))" \
    --output-json "$out/$name.json"
}

# serve_levels NAME START_CMD...: start a server on :8100, time /health, run the levels, stop it
serve_levels() {
  local name="$1"; shift
  local log="$out/${name}_server.log" t0 pid ms
  t0=$(date +%s%N)
  "$@" > "$log" 2>&1 &
  pid=$!
  until "$py" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:8100/health', timeout=2).status_code != 200)" \
        2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "gpu_suite: $name server exited; tail of $log:" >&2; tail -20 "$log" >&2; return 1; }
    (( $(date +%s%N) - t0 > 300000000000 )) && { echo "gpu_suite: $name not ready in 300 s" >&2; kill -TERM "$pid"; return 1; }
    sleep 0.5
  done
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "{\"start_ms\": $ms}" > "$out/${name}_start.json"
  echo "== $name: /health after $ms ms" >&2
  bench serve --base-url http://127.0.0.1:8100 --model bench --tokenizer "$serve_model" \
    --random-input-len 16 --random-output-len 8 --num-prompts 2 --max-concurrency 2 --ignore-eos >/dev/null  # warm-up
  for level in $levels; do
    bench serve --base-url http://127.0.0.1:8100 --model bench --tokenizer "$serve_model" \
      --random-input-len "${lens%%:*}" --random-output-len "${lens##*:}" --ignore-eos --max-concurrency "${level%%:*}" \
      --num-prompts "${level##*:}" --metric-percentiles 50,99 --result-filename "$out/${name}_c${level%%:*}.json"
  done
  kill -TERM "$pid"; wait "$pid"
}

part() {
  echo "== $1 -> $out" >&2
  case "$1" in
    b1) bench latency --preset llama-3.1-8b --output-json "$out/b1.json" ;;
    qwen) bench throughput --preset qwen3-0.6b --output-json "$out/qwen.json" ;;
    tput8b)
      n="${NUM_PROMPTS:-1000}"
      bench throughput --preset llama-3.1-8b --num-prompts "$n" --output-json "$out/tput8b.json"
      bench throughput --preset llama-3.1-8b --num-prompts "$n" --set scheduler.chunked_prefill_size=640 \
        --output-json "$out/tput8b_640.json" ;;
    serve)
      [[ -n "${SERVE_MODEL:-}" ]] || "$py" -m appliance.bench.presets "$models" --tokenizer --only llama-3.1-8b >/dev/null
      serve_levels serve "$py" -m appliance.cli.main serve "$serve_model" "${serve_args[@]}" --host 127.0.0.1 \
        --port 8100 --seed 0 --served-model-name bench ;;
    peer-small) B1=1 A_SIZES=none peer offline llama "$out/peer_b1.json"; peer offline qwen "$out/peer_qwen.json" ;;
    peer-8b) B1=0 A_SIZES="${NUM_PROMPTS:-1000}" peer offline llama "$out/peer_8b.json" ;;
    peer-serve)
      [[ -f .peer/run_vllm.sh ]] || { echo "gpu_suite: .peer/run_vllm.sh is missing (see the set-up above)" >&2; return 1; }
      [[ -n "${SERVE_MODEL:-}" ]] || "$py" -m appliance.bench.presets "$models" --tokenizer --only llama-3.1-8b >/dev/null
      serve_levels peer_serve bash .peer/run_vllm.sh serve "$serve_model" 8100 --served-model-name bench ;;
    gputests)
      : > "$out/gpu_tests.txt"
      mkdir -p "$out/gpu_test_logs"
      for f in ${GPU_TEST_FILES:-$(grep -l "mark.gpu\|pytest.mark.gpu\|pytestmark = .*gpu" tests/test_*.py)}; do
        log="$out/gpu_test_logs/$(basename "$f" .py).txt"
        timeout --kill-after=5 "${GPU_TEST_TIMEOUT_S:-150}" "$py" -m pytest -m gpu -q -rfE -p no:cacheprovider "$f" \
          > "$log" 2>&1
        echo "$f rc=$? $(tail -1 "$log")" >> "$out/gpu_tests.txt"
        grep -E "^(FAILED|ERROR) " "$log" >> "$out/gpu_tests.txt"
      done
      cat "$out/gpu_tests.txt" ;;
    spec) timeout --kill-after=10 "$limit" "$py" -m benchmarks.spec_decode --output-json "$out/spec.json" ;;
    fp8) timeout --kill-after=10 "$limit" "$py" -m benchmarks.fp8 --sections gemv,batch1,capacity,qwen3 \
           --output-json "$out/fp8.json" ;;
    fp8tput) timeout --kill-after=10 "$limit" "$py" -m benchmarks.fp8 --sections throughput \
               --num-prompts "${NUM_PROMPTS:-1000}" --output-json "$out/fp8_tput.json" ;;
    models) timeout --kill-after=10 "$limit" "$py" -m benchmarks.models > "$out/models.jsonl" ;;
    hybrid) timeout --kill-after=10 "$limit" "$py" -m benchmarks.hybrid --output-json "$out/hybrid.json" ;;
    hybrid-turns) timeout --kill-after=10 "$limit" "$py" -m benchmarks.hybrid --multi-turn-only \
                    --profile "$out/hybrid_profile" --output-json "$out/hybrid_turns.json" ;;
    peer-models) peer_family peer_models benchmarks.models --only gpt-oss-20b --only gemma-3-12b ;;
    peer-mxfp4) peer_family peer_mxfp4 benchmarks.models --only gpt-oss-20b-mxfp4 ;;
    peer-hybrid) peer_family peer_hybrid benchmarks.hybrid ;;
    coldstart) timeout --kill-after=10 "$limit" "$py" -m benchmarks.cold_start --out "$out/cold_start" ;;
    summary) ;;
  esac
}

trap 'kill $(jobs -p) 2>/dev/null' EXIT  # a server of a part cut short does not outlive the suite
status=0
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && { sed -n '2,/^#   summary/p' "$0"; exit 2; }  # the header through the parts
[[ "${parts[0]}" == all ]] && parts=("${ALL_PARTS[@]}")
for p in "${parts[@]}"; do part "$p" || { echo "gpu_suite: part $p failed (exit $?)" >&2; status=1; }; done
"$py" -m benchmarks.summary "$out" || status=1
exit $status
