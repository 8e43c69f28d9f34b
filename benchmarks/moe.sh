#!/usr/bin/env bash
# The MoE / MLA benchmark on one GPU, in one command (~10 minutes on an H100 80GB), ending in one table:
#   1. correctness first: the fused-MoE (+ fp8 GEMM) and MLA (store, decode, prefill) selfchecks at model shapes;
#   2. DeepSeek-V2-Lite and Qwen3-30B-A3B shapes (dummy weights, bf16): `appliance bench throughput` at 1024 in /
#      1024 out with NUM_PROMPTS requests, then `appliance bench latency` of one request alone (BATCH1 output
#      tokens) against the weight-read floor (bytes of the ACTIVE weights one step reads / copy bandwidth).
#
#   bash benchmarks/moe.sh                       # the whole run; results in $BENCH_OUT (default: a temp dir)
#   NUM_PROMPTS=128 bash benchmarks/moe.sh       # fewer requests when time is short
#   bash benchmarks/moe.sh --smoke               # the same steps with tiny shapes on the CPU (a dry run, ~1 minute)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${BENCH_OUT:-$(mktemp -d)}"
mkdir -p "$out"
if [[ "${1:-}" == "--smoke" ]]; then
  where=cpu; export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
  n="${NUM_PROMPTS:-4}"; in_len=32; out_len=16; b1=8; limit=300
  common=(--dtype float32 --set cache.max_total_tokens=4096 --set model.max_model_len=256)
  small_v2='{"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 8, "num_attention_heads": 4, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 2048}'
  small_qwen='{"num_hidden_layers": 2, "hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048}'
  declare -A extra=([deepseek-v2-lite]="$small_v2" [qwen3-30b-a3b]="$small_qwen")
else
  where=cuda
  n="${NUM_PROMPTS:-256}"; in_len=1024; out_len=1024; b1="${BATCH1:-128}"; limit="${SHAPE_TIMEOUT_S:-330}"  # Qwen3-30B-A3B, 200 x 1024/1024: ~160 s on an H100
  common=(--dtype bfloat16 --set model.device=cuda --set model.max_model_len=4096)
  declare -A extra=([deepseek-v2-lite]="" [qwen3-30b-a3b]="")
fi

echo "== selfchecks ($where) -> $out" >&2
# bounded: one selfcheck printed nothing for 420 s on the H100 (2026-11-22); a stall must not eat the benchmark
for k in moe mla; do
  timeout --kill-after=10 "${SELFCHECK_TIMEOUT_S:-150}" "$py" -m "appliance.kernels.$k.selfcheck" "$where" \
    > "$out/selfcheck_$k.jsonl" || echo "   $k selfcheck failed or timed out (exit $?)" >&2
done
for shape in deepseek-v2-lite qwen3-30b-a3b; do
  echo "== $shape: $n requests x $in_len in / $out_len out, then batch 1 x $b1" >&2
  args=(--preset "$shape" --disable-tqdm "${common[@]}")
  if [[ -n "${extra[$shape]}" ]]; then args+=(--set "model.hf_overrides=${extra[$shape]}"); fi
  # a shape that fails or runs out of time leaves its row empty; the table says so
  timeout --kill-after=10 "$limit" "$py" -m appliance.cli.main bench throughput "${args[@]}" --num-prompts "$n" \
    --input-len "$in_len" --output-len "$out_len" --output-json "$out/$shape.json" > "$out/$shape.log" 2>&1 \
    || echo "   $shape failed or timed out (exit $?): see $out/$shape.log" >&2
  timeout --kill-after=10 "$limit" "$py" -m appliance.cli.main bench latency "${args[@]}" --batch-size 1 \
    --input-len "$in_len" --output-len "$b1" --num-iters 1 --num-iters-warmup 1 --weight-floor \
    --output-json "$out/$shape.b1.json" >> "$out/$shape.log" 2>&1 \
    || echo "   $shape batch 1 failed or timed out (exit $?): see $out/$shape.log" >&2
done

"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"\n# MoE / MLA benchmark ({out})\n")
print("| check | cases | within tolerance | worst err / tol |")
print("| --- | --- | --- | --- |")
for name in ("moe", "mla"):
    rows = [json.loads(l) for l in (out / f"selfcheck_{name}.jsonl").read_text().splitlines() if l.startswith("{")]
    ok = [r for r in rows if "error" not in r and r["err"] <= r["tol"]]
    worst = max((r["err"] / r["tol"] for r in rows if "error" not in r), default=float("nan"))
    bad = [r["case"] for r in rows if r not in ok]
    print(f"| {name} selfcheck | {len(rows)} | {len(ok)}{' (failed: ' + ', '.join(bad) + ')' if bad else ''} "
          f"| {worst:.2f} |")
print("\n| shape | requests | output tok/s | total tok/s | batch-1 TPOT ms | active weights GB | copy GB/s "
      "| floor ms | batch 1 / floor |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for shape in ("deepseek-v2-lite", "qwen3-30b-a3b"):
    f, b = out / f"{shape}.json", out / f"{shape}.b1.json"
    if not f.is_file():
        print(f"| {shape} | failed or timed out: see {shape}.log | | | | | | | |")
        continue
    r = json.loads(f.read_text())
    q = json.loads(b.read_text()) if b.is_file() else {}
    b1 = ([f"{q['mean_tpot_ms']:.2f}", f"{q['active_weight_GB']:.2f}", f"{q['copy_GBps']:.0f}", f"{q['floor_ms']:.3f}",
           f"{q['tpot_over_floor']:.2f}x"] if "floor_ms" in q else ["batch 1 failed: see log"] + [""] * 4)
    print(f"| {shape} | {r['num_requests']} | {r['output_throughput']:.0f} | {r['total_token_throughput']:.0f} | "
          + " | ".join(b1) + " |")
PY
