#!/usr/bin/env bash
# `make gpu-check` on a lent GPU machine (docs/benchmarks.md, "The GPU check"), as one `run` command:
#   bash bench/gpu_check_device.sh        (with `.whl` named in carry)
# The machine's image has CUDA torch, transformers, accelerate and peft, but not TRL, datasets or math-verify: their
# pure-Python wheels travel in .whl/ (downloaded beforehand, see the docs) and go to /tmp/site. This checkout is put
# first on PYTHONPATH, so the package is the working tree's. The JSON and the log come back through $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 3
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
out="${OUT:-.}"
if command -v make >/dev/null; then
    make gpu-check GPU_PYTHON=python3 2>&1 | tee "$out/gpu_check.log"
else  # the same command as the Makefile's target
    python3 bench/gpu_check.py --out gpu_check.json 2>&1 | tee "$out/gpu_check.log"
fi
status=${PIPESTATUS[0]}
cp gpu_check.json "$out/" 2>/dev/null
exit "$status"
