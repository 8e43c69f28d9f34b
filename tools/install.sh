#!/usr/bin/env bash
# Installs appliance and its test dependencies on a fresh CPU machine.
# The CPU build of torch goes first: a plain `torch` requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
