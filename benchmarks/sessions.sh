#!/usr/bin/env bash
# Agentic sessions on one GPU: the host KV tier and the slo policy, ours and the peer's (vLLM 0.26) in the same run,
# with `appliance bench sessions`. Each part runs in under 8 minutes on an H100 80GB.
#
#   bash benchmarks/sessions.sh PART [PART...]     # results: $OUT (or $BENCH_OUT, else a temp dir); ours also
#                                                   # leave NAME_stats.json, the server's /v1/internal/stats
#
# Model: the Llama-3.1-8B shape with dummy bf16 weights (`python -m appliance.bench.presets`).
# Parts:
#   notier    `appliance serve` with the GPU KV pool held to POOL_TOKENS (default 65536) tokens, no host tier:
#             SESSIONS (32) sessions x 10 turns, all open at once (think time THINK_S = 4 s), 2048-token shared
#             system prompt, 256-token first message, 128-token answers, 320-token tool results: the combined
#             final history is ~32 x 6.3k = 203k tokens, ~3x the pool. Reports TTFT p50 of turns 2-10 and the
#             reported cache hit against the ideal.
#   tier      the same with the host tier (cache.host_cache, host_cache_ratio = 4: 256k tokens, 32 GiB of pinned
#             host memory on this shape), written through (host_cache_write_policy = write_through: blocks are
#             copied to the host in steps that load nothing, so an admission that evicts them copies no store).
#   writeback the tier part with the default write policy: blocks are copied to the host when evicted, in the
#             admission step that evicts them.
#   tiersync  the tier part with overlap scheduling off (scheduler.enable_overlap = false): a turn arriving during
#             a step joins the next one instead of the one after (benchmarks/session_timeline.py models both).
#   swap, recompute  the tier part with no room reserved for outputs (scheduler.schedule_conservativeness = 0),
#             so running requests are preempted: swap with scheduler.preemption_mode = auto (the workers' measured
#             copy and prefill rates are in the server log: "preemption costs measured"), recompute without.
#   disk      the tier part with a host tier of 1x the pool and the disk tier behind it (cache.disk_cache, 32 GiB
#             under DISK_DIR, default $out/disk).
#   peer      `vllm serve` with --num-gpu-blocks-override POOL_TOKENS/16 and --enable-prompt-tokens-details,
#             the same sessions.
#   slo, fcfs mixed load: 16 sessions decoding 1024-token answers while 4 prompts of 32000 tokens arrive
#             (one every 5 s, `appliance bench serve` beside them); the sessions' p99 ITL against
#             scheduler.slo_tbt_ms = SLO_TBT_MS (default 50). slo runs scheduler.policy = "slo", fcfs the default.
# Set-up: as benchmarks/gpu_suite.sh (.whl/ for the server's wheels, .peer/ for vLLM). PART_TIMEOUT_S (default
# 470) bounds each part.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${OUT:-${BENCH_OUT:-$(mktemp -d)}}"
mkdir -p "$out"
limit="${PART_TIMEOUT_S:-470}"
models="${MODELS_DIR:-/tmp/appliance_bench_models}"
pool="${POOL_TOKENS:-65536}"
sessions="${SESSIONS:-32}"
think="${THINK_S:-4}"
tbt="${SLO_TBT_MS:-50}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if ! "$py" -c "import pydantic, zmq, starlette" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "sessions: installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:-$PWD}"
model="$models/llama-3.1-8b"
base=http://127.0.0.1:8100

bench() { "$py" -m appliance.cli.main bench "$@"; }

# with_server NAME START_CMD... -- BENCH_FUNCTION: start a server on :8100, wait for /health, run, stop it
with_server() {
  local name="$1"; shift
  local cmd=() log="$out/${name}_server.log" pid t0
  while [[ "$1" != "--" ]]; do cmd+=("$1"); shift; done; shift
  t0=$(date +%s)
  "${cmd[@]}" > "$log" 2>&1 &
  pid=$!
  until "$py" -c "import httpx, sys; sys.exit(httpx.get('$base/health', timeout=2).status_code != 200)" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "sessions: $name server exited; tail of $log:" >&2; tail -20 "$log" >&2; return 1; }
    (( $(date +%s) - t0 > 240 )) && { echo "sessions: $name not ready in 240 s" >&2; kill -TERM "$pid"; return 1; }
    sleep 0.5
  done
  "$@" "$name"
  local rc=$?
  # ours: the engine's counters after the run (preemptions, the tiers' copies: tier_swapped_out, tier_disk_spilled...)
  [[ "$name" != peer ]] && "$py" -c "import httpx; print(httpx.get('$base/v1/internal/stats', timeout=5).text)" \
    > "$out/${name}_stats.json" 2>/dev/null
  kill -TERM "$pid"; wait "$pid"
  return $rc
}

run_sessions() {  # the 3x-pool workload
  bench sessions --base-url "$base" --model bench --num-sessions "$sessions" --max-concurrency "$sessions" \
    --turns 10 --system-len 2048 --user-len 256 --output-len 128 --tool-len 320 --think-time "$think" \
    --save-result --result-filename "$out/$1.json"
}

run_mixed() {  # 16 decoding sessions, 32k-token prompts arriving beside them
  bench serve --base-url "$base" --model bench --random-input-len 32000 --random-output-len 1 --num-prompts 4 \
    --request-rate 0.2 --ignore-eos --disable-tqdm --result-filename "$out/$1_long.json" --save-result &
  local long=$!
  bench sessions --base-url "$base" --model bench --num-sessions=16 --max-concurrency 16 --turns 2 \
    --system-len 1024 --user-len 64 --output-len 1024 --tool-len 64 --save-result --result-filename "$out/$1.json"
  local rc=$?
  wait "$long" || rc=1
  return $rc
}

ours() {  # ours NAME BENCH_FUNCTION --set ... : `appliance serve` on the 8B shape
  local name="$1" fn="$2"; shift 2
  with_server "$name" "$py" -m appliance.cli.main serve "$model" --load-format dummy --dtype bfloat16 \
    --host 127.0.0.1 --port 8100 --seed 0 --served-model-name bench "$@" -- "$fn"
}

part() {
  echo "== $1 -> $out" >&2
  "$py" -m appliance.bench.presets "$models" --tokenizer --only llama-3.1-8b >/dev/null
  case "$1" in
    notier) ours notier run_sessions --max-model-len 16384 --set cache.max_total_tokens="$pool" ;;
    tier|tiersync) ours "$1" run_sessions --max-model-len 16384 --set cache.max_total_tokens="$pool" \
            --set cache.host_cache=true --set cache.host_cache_ratio=4 --set cache.host_cache_write_policy=write_through \
            --set scheduler.enable_overlap="$([[ $1 == tiersync ]] && echo false || echo true)" ;;
    writeback) ours writeback run_sessions --max-model-len 16384 --set cache.max_total_tokens="$pool" \
            --set cache.host_cache=true --set cache.host_cache_ratio=4 ;;
    swap|recompute) ours "$1" run_sessions --max-model-len 16384 --set cache.max_total_tokens="$pool" \
            --set cache.host_cache=true --set cache.host_cache_ratio=4 --set scheduler.schedule_conservativeness=0 \
            --set scheduler.preemption_mode="$([[ $1 == swap ]] && echo auto || echo recompute)" ;;
    disk) ours disk run_sessions --max-model-len 16384 --set cache.max_total_tokens="$pool" \
            --set cache.host_cache=true --set cache.host_cache_ratio=1 --set cache.disk_cache=true \
            --set cache.disk_cache_dir="${DISK_DIR:-$out/disk}" --set cache.disk_cache_size_gb=32 ;;
    peer)
      [[ -f .peer/run_vllm.sh ]] || { echo "sessions: .peer/run_vllm.sh is missing" >&2; return 1; }
      with_server peer bash .peer/run_vllm.sh serve "$model" 8100 --served-model-name bench --max-model-len 16384 \
        --num-gpu-blocks-override $((pool / 16)) --enable-prompt-tokens-details -- run_sessions ;;
    slo) ours slo run_mixed --max-model-len 40960 --set scheduler.policy=slo --set scheduler.slo_tbt_ms="$tbt" ;;
    fcfs) ours fcfs run_mixed --max-model-len 40960 ;;
    *) echo "sessions: unknown part $1 (notier tier writeback tiersync swap recompute disk peer slo fcfs)" >&2
       return 2 ;;
  esac
}

trap 'kill $(jobs -p) 2>/dev/null' EXIT
[[ $# -eq 0 ]] && { sed -n '2,33p' "$0"; exit 2; }
status=0
for p in "$@"; do
  timeout --kill-after=10 "$limit" bash -c "$(declare -p py out limit models pool sessions think tbt model base); \
    $(declare -f bench with_server run_sessions run_mixed ours part); part $p" \
    || { echo "sessions: part $p failed" >&2; status=1; }
done
exit $status
