#!/usr/bin/env bash
# torchtitan's smallest model (llama3 "debugmodel") trained for 40 steps
# with checkpoints through ckptstore's checkpoint manager, killed (SIGKILL)
# after step 25 and resumed, beside the same run through torchtitan's own
# checkpointer: both must end in the same state. Real forward/backward on
# a CUDA device; without one (FlexAttention has no CPU backward) gradients
# are drawn per step (bench/python/torchtitan_run.py), so it runs anywhere.
#
#   scripts/torchtitan-check.sh [WHEEL_DIR]
#
# WHEEL_DIR (optional): wheels to install first, without their
# dependencies (a machine with no package registry: ckptstore's abi3
# wheel, and those of python/requirements-torchtitan.txt, from
# `pip download --no-deps -r python/requirements-torchtitan.txt -d DIR`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ $# -ge 1 ]; then
    "$PY" -m pip install --quiet --no-deps --force-reinstall "$1"/*.whl
fi
"$PY" -c "import torch, ckptstore.torchtitan; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'no GPU')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
run() { "$PY" bench/python/torchtitan_run.py "$@" 2>&1 | grep -E "^(resumed|step|killed|final|saves)"; }

echo "--- ckptstore, killed after step 25"
run "$work/ours" --steps 40 --interval 10 --kill-at 25 || true
echo "--- ckptstore, resumed"
out="$(run "$work/ours" --steps 40 --interval 10)"
echo "$out"
ours="$(sed -n 's/^final //p' <<<"$out")"
echo "--- torchtitan's own checkpointer, uninterrupted"
out="$(run "$work/theirs" --steps 40 --interval 10 --manager torchtitan)"
echo "$out"
theirs="$(sed -n 's/^final //p' <<<"$out")"
if [ -n "$ours" ] && [ "$ours" = "$theirs" ]; then
    echo "torchtitan check: the resumed run ends in the same state as torchtitan's own ($ours)"
else
    echo "torchtitan check: FAILED (ckptstore '$ours', torchtitan '$theirs')"
    exit 1
fi
