#!/usr/bin/env bash
# The accelerator check (issue 21): jaxnitro against a hand-written jax.jit loop on every
# visible device: the tutorial MLP and a 4 x 128 char-level GPT, float32 (and bfloat16 when
# the `precision` knob exists), replicated and FSDP; steps/s, ratio, FLOPs/step and MFU.
# Budget: under 5 minutes on one accelerator with the defaults (300 timed steps, 2 repeats).
#
#   bash bench/gpu_check.sh                          # on the accelerator machine
#   GPU_CHECK_STEPS=20 GPU_CHECK_REPEATS=1 GPU_CHECK_GPT=1,32 bash bench/gpu_check.sh   # tiny (CPU: ~1 min)
#
# Run from the repository root with jaxnitro installed (pip install -e ".[test]"), or set PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
"$PYTHON" -c 'import jax; print("jax", jax.__version__, "| backend:", jax.default_backend(), "|", jax.devices())'
exec timeout "${GPU_CHECK_TIMEOUT:-290}" "$PYTHON" bench/gpu_check.py
