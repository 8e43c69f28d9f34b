#!/usr/bin/env bash
# Downloads into .whl/ the cp312 wheels a GPU host lacks (its Python 3.12 has torch, triton, transformers, httpx,
# anyio, click, h11 but not the appliance's server/config dependencies), then prints the line to install them there.
# Versions follow this machine's environment (what CI tests), so the GPU host runs the same code paths.
#   tools/device_wheels.sh            # server + config + test deps
#   WITH_XGRAMMAR=1 tools/device_wheels.sh   # also xgrammar (structured output)
#   WITH_FLA=1 tools/device_wheels.sh       # also fla-core + einops (the hybrid models' gated-delta kernels on
#                                            # the GPU: benchmarks/hybrid.py, gpu_suite part hybrid)
#   WITH_FLASHINFER=1 tools/device_wheels.sh # also the optional flashinfer kernel backend (benchmarks/flashinfer.sh):
#                                            # flashinfer-python 0.6.14 + apache-tvm-ffi (the pair tested on an H100;
#                                            # its other declared dependencies are not needed for the kernels we use)
# On the GPU host (with .whl/ copied beside the checkout), start the command with the printed line.
set -euo pipefail
cd "$(dirname "$0")/.."
NAMES=(pydantic pydantic_core annotated-types typing-inspection typing_extensions pydantic-settings python-dotenv
       starlette uvicorn h11 click anyio sniffio pyzmq omegaconf antlr4-python3-runtime tomli
       openai distro jiter httpx2 httpcore2 truststore)
[[ "${WITH_XGRAMMAR:-0}" == 1 ]] && NAMES+=(xgrammar)

version_of() {  # the version installed here; empty when absent
  python3 - "$1" <<'PY'
import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass
PY
}

SPECS=()
for name in "${NAMES[@]}"; do
  v="$(version_of "$name")"
  if [[ -z "$v" ]]; then
    echo "device_wheels: $name is not installed here; fetching the newest" >&2
    SPECS+=("$name")
  else
    SPECS+=("$name==$v")
  fi
done

# pinned, not taken from this machine (flashinfer is not installed here; it needs a GPU)
[[ "${WITH_FLA:-0}" == 1 ]] && SPECS+=("fla-core==0.6.0" "einops==0.8.2")
[[ "${WITH_FLASHINFER:-0}" == 1 ]] && SPECS+=("flashinfer-python==0.6.14" "apache-tvm-ffi==0.1.15.post2")

grep -qs '^/.whl/' .gitignore || echo "device_wheels: warning: /.whl/ is not in .gitignore" >&2
mkdir -p .whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  PLATFORMS+=(--platform "$p")
done
for spec in "${SPECS[@]}"; do  # one at a time so a missing one names itself
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$spec" || { echo "device_wheels: could not fetch $spec" >&2; exit 1; }
done

# Keep one version per project: two stop the whole install on the GPU host.
python3 - <<'PY'
import collections, pathlib, re
seen = collections.defaultdict(list)
for w in pathlib.Path(".whl").glob("*.whl"):
    seen[re.split(r"-\d", w.name, maxsplit=1)[0].lower().replace("_", "-")].append(w.name)
dups = {k: v for k, v in seen.items() if len(v) > 1}
if dups:
    raise SystemExit(f"device_wheels: several versions in .whl/, delete the stale ones: {dups}")
PY
du -sh .whl
echo "On the GPU host (with .whl/ in the checkout), begin the command with:"
echo 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;'
