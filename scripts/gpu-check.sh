#!/usr/bin/env bash
# GPU state staged at the device's speed (issue 54): for 1, 4 and 16 GiB of
# CUDA tensors, ckptstore's async save against a copy into pinned memory
# (the floor) and DCP's DefaultStager + FileSystemWriter; blocked, staged
# and durable seconds, peak host memory, a load back bit-identical
# (bench/python/gpu_check.py). On a machine with no GPU it runs the same
# steps on the CPU at a few MiB, says so, and exits 0.
#
#   scripts/gpu-check.sh [WHEEL]
#
# WHEEL (optional): ckptstore's abi3 wheel to install first, without its
# dependencies (a machine with no package registry). Environment: PYTHON
# (default python3), GIB (default 1,4,16), CKPT_GPU_CHECK_DIR (where the
# saves go; default the temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ $# -ge 1 ]; then
    "$PY" -m pip install --quiet --no-deps --force-reinstall "$1"
fi
exec "$PY" bench/python/gpu_check.py --gib "${GIB:-1,4,16}"
